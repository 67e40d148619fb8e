"""A run on 127.0.0.1 driven step by step by a test: start, kill (SIGKILL of a whole peer), restart, wait.

Unlike `composer-coordinator simulate`, each process is started and stopped by the test, so faults can be
injected between rounds. Every peer is its own process group (a machine): `kill` takes down the peer with its
DHT, averager, p2pd and env server processes at once, as a lost machine would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from composer_diloco.metrics import read_metrics
from composer_diloco.outer.identity import IDENTITY_FILE, load_or_create_identity
import prefork
from tests_support import stop_processes

ROOT = Path(__file__).resolve().parents[1]


def free_listen_address() -> str:
    """A ``--listen`` multiaddr on 127.0.0.1 at a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"


def coordinator_line(run_dir: Path, listen: str) -> str:
    """The ``peer:`` line a coordinator started on ``run_dir`` with ``--listen listen`` will print: its key in the run
    dir (made now if there is none, as its first start would make it), so nodes can start beside it."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return f"{listen}/p2p/{load_or_create_identity(Path(run_dir) / IDENTITY_FILE)}"


def assert_peer_line(coordinator: subprocess.Popen, expected: str, why_not: Callable[[], str] | None = None) -> None:
    """Read a coordinator's stdout (text mode) up to its ``peer:`` line and assert it is ``expected`` (the line
    `coordinator_line` predicted for the nodes started beside it); ``why_not()`` is added to the message of a
    coordinator that exited first (e.g. its log's tail)."""
    line = ""
    while not line.startswith("peer: "):
        line = coordinator.stdout.readline()
        assert line, f"the coordinator exited without a peer line: {why_not() if why_not else ''}"
    assert line.split()[1] == expected, (line, expected)


def write_config(path: Path, text: str) -> Path:
    """Write a TOML run config for a test and return its path."""
    path.write_text(text)
    return path


class LocalRun:
    """The coordinator and nodes of one run dir, as real processes (see module docstring)."""

    def __init__(self, run_dir: Path, config: Path):
        self.run_dir, self.config = Path(run_dir), Path(config)
        self.procs: dict[str, subprocess.Popen | prefork.ForkedProcess] = {}
        self.peer = ""
        self._peer_line: list[str] = []
        self._expected: str | None = None
        self._all: list[subprocess.Popen] = []

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None, stdout=None,
               prefix: list[str] | None = None) -> subprocess.Popen:
        log_path = self.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        with open(log_path, "ab") as log:  # forked from the suite's process template where it can be (`prefork`)
            proc = prefork.popen([*(prefix or []), sys.executable, *args], stdout=stdout or log, stderr=log,
                                 stdin=subprocess.DEVNULL, env=full_env, cwd=ROOT, start_new_session=True)
        self.procs[name] = proc
        self._all.append(proc)
        return proc

    def start_coordinator(self, *extra: str, env: dict[str, str] | None = None, timeout_s: float = 300,
                          wait: bool = True) -> str:
        """Start (or restart) the coordinator; returns its multiaddr (the ``peer:`` line).

        ``wait=False`` returns at once the line it will print, as an operator's job script knows it: its key in the
        run dir (made now if there is none, as its first start would) and a ``--listen`` port (picked now unless
        ``extra`` has one), so nodes start beside it instead of after its imports (the suite's time); they re-dial
        until it listens. `wait_peer_line` checks the line it printed."""
        expected = None
        if not wait:  # the line is known before it starts: its key made first (it would make one), its port picked
            if "--listen" not in extra:
                extra = (*extra, "--listen", free_listen_address())
            expected = coordinator_line(self.run_dir, extra[list(extra).index("--listen") + 1])
        proc = self._spawn("coordinator", ["-m", "coordinator", "start", "--config", str(self.config),
                                           "--run-dir", str(self.run_dir), *extra], env, stdout=subprocess.PIPE)
        self._peer_line = found = []
        self._expected = expected

        def read() -> None:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith("peer: ") and not found:
                    found.append(line.split()[1])

        threading.Thread(target=read, daemon=True).start()
        if not wait:
            self.peer = expected
            return self.peer
        return self.wait_peer_line(timeout_s)

    def wait_peer_line(self, timeout_s: float = 300) -> str:
        """Wait for the coordinator's ``peer:`` line; check it is the one `start_coordinator` (``wait=False``) said."""
        found = self._peer_line
        proc = self.procs["coordinator"]
        self.wait_until(lambda: bool(found) or proc.poll() is not None, timeout_s, "the coordinator's peer line")
        assert found, f"the coordinator exited with {proc.returncode}:\n{self.log_tail('coordinator')}"
        if self._expected is not None and self._expected.startswith("/ip4/0.0.0.0/"):  # it prints an address it is
            # reachable at, not the wildcard: the same port and peer ID
            assert found[0].split("/")[3:] == self._expected.split("/")[3:], (found[0], self._expected)
        else:
            assert self._expected in (None, found[0]), (found[0], self._expected)
        self.peer = found[0]
        return self.peer

    def start_node(self, name: str, *extra: str, env: dict[str, str] | None = None, peer: str | None = None,
                   prefix: list[str] | None = None) -> subprocess.Popen:
        """Start (or restart, with the same command) node ``name``; ``peer`` replaces the coordinator's ``peer:``
        line, ``prefix`` goes before the command (e.g. ``ip netns exec NS``)."""
        return self._spawn(name, ["-m", "nodes", "join", "--peer", peer or self.peer, "--run-dir", str(self.run_dir),
                                  "--name", name, "--device", "cpu", *extra], env, prefix=prefix)

    def start_standby(self, name: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start node ``name``'s warm standby (``--standby``, `nodes.standby`), logged and known as
        ``<name>-standby``: the node's own command otherwise."""
        return self._spawn(f"{name}-standby", ["-m", "nodes", "join", "--peer", self.peer, "--run-dir",
                                               str(self.run_dir), "--name", name, "--device", "cpu", "--standby",
                                               *extra], env)

    def restart_while_held(self, name: str, hold: Path, ready: Callable[[], bool], what: str) -> float:
        """Restart node ``name`` (the same command) while ``hold`` exists, so that a peer pausing on it keeps the run
        from ending; remove ``hold`` once ``ready()`` (``what``, for the timeout message), then wait for a round of
        the restarted node. Returns the wall time (time.time()) of the restart."""
        hold.touch()
        restarted_at = time.time()
        self.start_node(name)
        self.wait_until(ready, 240, what)
        hold.unlink()
        self.wait_until(lambda: any(r["time"] > restarted_at for r in self.records().get(name, [])), 240,
                        f"a round of the restarted {name}")
        return restarted_at

    def kill(self, name: str) -> float:
        """SIGKILL the peer's whole process group (a lost machine); returns the wall time (time.time())."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        return time.time()

    def records(self) -> dict[str, list[dict]]:
        return read_metrics(self.run_dir)

    def rounds_of(self, name: str) -> list[int]:
        return [r["round"] for r in self.records().get(name, [])]

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.3) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.all_tails()}"
                                     f"{self.dump_stacks()}")
            time.sleep(poll_s)

    def dump_stacks(self, settle_s: float = 1.5) -> str:
        """Where this run's live processes are: SIGUSR1 (`prefork.DUMP_SIGNAL`) to every process forked from the
        suite's template (each peer, and the DHT and averager processes hivemind forks from it, which keep the
        template's command line), then, per peer, the stack lines they wrote to its log (each thread's frames in
        this checkout's code and hivemind's, innermost first). Exec'd processes (env servers, the reaper, p2pd) are
        left alone: SIGUSR1 would end them. "" when nothing was running."""
        import psutil

        sizes, signalled = {}, 0
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            log_path = self.run_dir / "logs" / f"{name}.log"
            sizes[name] = log_path.stat().st_size if log_path.exists() else 0
            try:
                root = psutil.Process(proc.pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in tree:
                try:
                    if any("prefork.py" in part for part in p.cmdline()):
                        p.send_signal(prefork.DUMP_SIGNAL)
                        signalled += 1
                except psutil.Error:
                    pass
        if not signalled:
            return ""
        time.sleep(settle_s)
        out = []
        for name, size in sizes.items():
            with open(self.run_dir / "logs" / f"{name}.log", "rb") as f:
                f.seek(size)
                text = f.read().decode(errors="replace")
            keep: list[str] = []
            for block in text.split("\n\n"):  # one thread's stack a block (faulthandler's format)
                lines = block.strip().splitlines()
                frames = [line.strip() for line in lines[1:] if line.strip().startswith("File ") and any(
                    m in line for m in ("composer_diloco", "hivemind", "/nodes/", "/coordinator/", "asyncio"))]
                if lines and "hread 0x" in lines[0] and frames:  # threads idle in the standard library: left out
                    keep += [lines[0].split(" (")[0], *(f"  {f}" for f in frames[:8])]
            out.append(f"--- {name}: stacks ---\n" + "\n".join(keep[:150]))
        return "\n" + "\n".join(out)

    def wait_round(self, name: str, round_: int, timeout_s: float = 300) -> dict:
        """Wait until ``name`` wrote its metrics line of ``round_``; returns it."""
        self.wait_until(lambda: round_ in self.rounds_of(name), timeout_s, f"{name}'s round {round_}")
        return next(r for r in self.records()[name] if r["round"] == round_)

    def wait_exit(self, name: str, timeout_s: float = 300) -> int:
        try:
            return self.procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout_s:.0f} s\n{self.all_tails()}"
                                 f"{self.dump_stacks()}") from None

    def assert_exit_ok(self, *names: str, timeout_s: float = 300) -> None:
        """Wait for each peer in ``names`` in turn (``timeout_s`` each) and assert it exited 0, with its log's tail."""
        for name in names:
            assert self.wait_exit(name, timeout_s) == 0, self.log_tail(name)

    def log_tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log(self, name: str) -> str:
        """The peer's log with whitespace collapsed (rich wraps long lines), for substring checks."""
        return " ".join((self.run_dir / "logs" / f"{name}.log").read_text(errors="replace").split())

    def all_tails(self) -> str:
        return "\n".join(f"--- {n} ---\n{self.log_tail(n)}" for n in self.procs)

    def stop(self) -> None:
        """Stop every process this run started (SIGTERM, then SIGKILL), restarted ones included."""
        stop_processes(self._all)


def assert_agree(records: dict[str, list[dict]], rounds: range | list[int]) -> dict[int, str]:
    """Every peer that recorded a round has the same ``global_sha256`` for it; returns ``{round: sha}``."""
    shas = {}
    for r in rounds:
        at = {name: rec["global_sha256"] for name, recs in records.items() for rec in recs if rec["round"] == r}
        assert at, f"nobody recorded round {r}"
        assert len(set(at.values())) == 1, f"round {r}: peers disagree: {at}"
        shas[r] = next(iter(at.values()))
    return shas
