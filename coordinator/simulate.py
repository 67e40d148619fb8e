"""`composer-coordinator simulate`: a whole run as real OS processes on 127.0.0.1.

It starts ``python -m coordinator start``, waits for its ``peer:`` line, starts N ``python -m nodes join``
(each starts its own env server process), shows progress from the metrics files, waits for all, prints the
per-round table (with a WARNING line under it for each round in which no episode produced a parsed tool call),
and returns 0 only if every process exited 0, every round completed and every round's ``global_sha256`` agreed;
else 1. Each process logs to ``<run-dir>/logs/<name>.log``. Ctrl+C, SIGTERM or SIGHUP stops them all (SIGTERM to
each process group, then SIGKILL after 10 s; exit 130, or 128 + the signal number).

It ends when its nodes do. Once every node process has exited and one of them exited non-zero, it stops the
coordinator at once (SIGTERM to its process, SIGKILL to its group 20 s later if it still runs) and returns 1 within
seconds, its last lines naming the stopped coordinator and each failed node with the node's last error line
(``node-0 exited with code 1: composer-node: error: ...``). A node that exits 0 (its rounds done) is no failure:
when every node exited 0, the coordinator has `Simulation.end_grace_s` to end the run by itself (its linger of
``network.averaging_timeout_s`` + 5 s, its last checkpoint, its shutdown); one still running then is stopped and
counted as failed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from composer_diloco.metrics import format_table, no_tool_call_rounds, read_metrics, round_table


class SimulationError(RuntimeError):
    """A process of the simulation failed to start."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def error_line(self) -> str:
        """The cause of this process's failure, as one line of its log (`last_error_line`); "" without a log."""
        try:
            return last_error_line(self.log_path.read_text(errors="replace"))
        except OSError:
            return ""


_CLI_ERROR = re.compile(r"^[\w.-]+: error: ")  # the one line each CLI prints on a fatal error


def last_error_line(log: str) -> str:
    """The line of a process's log that names why it failed: the last CLI error line (``composer-node: error: ...``,
    ``composer-coordinator: error: ...``), else the last non-empty line (a traceback's exception line, or whatever the
    process said last); "" for an empty log."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if _CLI_ERROR.match(line)]
    return errors[-1] if errors else (lines[-1] if lines else "")


@dataclass
class Simulation:
    """The processes of one simulated run (see module docstring)."""

    nodes: int
    run_dir: Path
    config_path: Path | None = None
    rounds: int | None = None
    model: str | None = None
    device: str = "cpu"
    rollout: str = "auto"
    dtype: str = "auto"
    verbose: bool = False
    eval_episodes: int = 256
    max_idle_s: float = 600.0  # a node loading a large --model sends no heartbeat for minutes
    peer_timeout_s: float = 3600.0  # a machine's first run warm-starts the default policy: ~10 min on the coding env
    end_margin_s: float = 60.0  # beyond its linger: the coordinator's last checkpoint (a large model's) and shutdown
    procs: list[Proc] = field(default_factory=list)
    console: Console = field(default_factory=lambda: Console(stderr=True))
    coordinator_stopped: str | None = field(default=None, init=False)  # why `wait` stopped it; None: it was not
    _nodes_ended_at: float | None = field(default=None, init=False)  # time.monotonic() when the last node exited

    def _spawn(self, name: str, args: list[str], stdout: int | None = None, threads: int = 1) -> Proc:
        log_path = self.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads))  # N trainers on few cores: no thread oversubscription
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                [sys.executable, *args], stdout=stdout if stdout is not None else log_file, stderr=log_file,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def start_coordinator(self) -> str:
        """Start the coordinator and return its multiaddr (its ``peer:`` line). Raises SimulationError."""
        # --max-idle: if every node dies, the coordinator ends (exit 1) instead of waiting for nodes that never come
        args = ["-m", "coordinator", "start", "--run-dir", str(self.run_dir), "--max-idle", f"{self.max_idle_s:g}"]
        if self.config_path is not None:
            args += ["--config", str(self.config_path)]
        if self.rounds is not None:
            args += ["--rounds", str(self.rounds)]
        if self.model is not None:
            args += ["--model", self.model]
        if self.verbose:
            args.append("--verbose")
        # The coordinator's warm start runs before any node starts, alone on the machine: 2 threads halve it (a
        # fixed count, not the core count, so that its bytes do not depend on it); then the coordinator is nearly idle.
        proc = self._spawn("coordinator", args, stdout=subprocess.PIPE, threads=2)
        found: list[str] = []

        def read_stdout() -> None:
            for raw in proc.popen.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith("peer: ") and not found:
                    found.append(line.removeprefix("peer: ").strip())

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.monotonic() + self.peer_timeout_s
        while not found:
            if proc.popen.poll() is not None:
                raise SimulationError(f"the coordinator exited with code {proc.popen.returncode}:\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise SimulationError(f"the coordinator printed no peer line in {self.peer_timeout_s:.0f} s")
            time.sleep(0.2)
        return found[0]

    def start_nodes(self, peer: str) -> None:
        for i in range(self.nodes):
            args = ["-m", "nodes", "join", "--peer", peer, "--run-dir", str(self.run_dir), "--name", f"node-{i}",
                    "--device", self.device, "--task-shard", f"{i}/{self.nodes}", "--rollout", self.rollout,
                    "--dtype", self.dtype]
            if self.verbose:
                args.append("--verbose")
            self._spawn(f"node-{i}", args)

    def wait(self, total_rounds: int) -> dict[str, int]:
        """Show progress until every process exits, stopping the coordinator once every node has exited
        (`_end_with_nodes`); returns ``{name: exit code}`` (a stopped process's code: 130, or minus the signal)."""
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=self.console, transient=False) as progress:
            tasks = {p.name: progress.add_task(p.name, total=total_rounds) for p in self.procs}
            while any(p.popen.poll() is None for p in self.procs):
                if self._end_with_nodes():
                    continue
                metrics = read_metrics(self.run_dir)
                for p in self.procs:
                    done = len(metrics.get(p.name, []))
                    state = "" if p.popen.poll() is None else f" (exit {p.popen.returncode})"
                    progress.update(tasks[p.name], completed=done, description=f"{p.name}{state}")
                time.sleep(0.5)
            metrics = read_metrics(self.run_dir)
            for p in self.procs:
                progress.update(tasks[p.name], completed=len(metrics.get(p.name, [])),
                                description=f"{p.name} (exit {p.popen.returncode})")
        return {p.name: p.popen.returncode for p in self.procs}

    def _end_with_nodes(self) -> bool:
        """Once every node has exited, stop a coordinator still running: at once when a node exited non-zero (the
        run cannot go on, and the coordinator would wait ``max_idle_s`` for nodes that never come), else after
        `end_grace_s` (a coordinator still up by then is stuck). Sets `coordinator_stopped` to why.

        Returns:
            True when it stopped the coordinator (it has exited then).
        """
        nodes = [p for p in self.procs if p.name != "coordinator"]
        coordinator = next((p for p in self.procs if p.name == "coordinator"), None)
        if not nodes or coordinator is None or coordinator.popen.poll() is not None \
                or any(p.popen.poll() is None for p in nodes):
            return False
        if self._nodes_ended_at is None:
            self._nodes_ended_at = time.monotonic()
        failed = [p.name for p in nodes if p.popen.returncode != 0]
        if failed:
            self.coordinator_stopped = (f"every node had exited ({', '.join(failed)} with an error), so the run "
                                        "could not go on")
            self._stop_coordinator(coordinator)
            return True
        grace_s = self.end_grace_s()
        if time.monotonic() - self._nodes_ended_at < grace_s:
            return False
        self.coordinator_stopped = f"every node had exited 0, and it was still running {grace_s:.0f} s later"
        self._stop_coordinator(coordinator)
        return True

    def _stop_coordinator(self, coordinator: Proc, timeout_s: float = 10.0) -> None:
        """SIGTERM the coordinator's process alone, so that it shuts its DHT, averager and p2pd down itself (in 1 s
        on 2 cores; a SIGTERM to its whole process group kills them under it, and it waits out its 8 s hard exit);
        if it still runs after ``timeout_s``, `stop_all` (its group: SIGTERM, then SIGKILL)."""
        coordinator.popen.send_signal(signal.SIGTERM)  # a no-op once it has exited
        try:
            coordinator.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.stop_all()

    def end_grace_s(self) -> float:
        """Seconds the coordinator may run on after every node exited 0: its linger (``network.averaging_timeout_s``
        + 5 s, read from the ``<run-dir>/config.json`` it wrote at start; 45 s when that cannot be read) plus
        `end_margin_s` for its last checkpoint and shutdown."""
        from composer_diloco.config import ConfigError, RunConfig

        try:
            averaging_timeout_s = RunConfig.from_json((self.run_dir / "config.json").read_text()) \
                .network.averaging_timeout_s
        except (OSError, ConfigError):
            averaging_timeout_s = 45.0  # the default of network.averaging_timeout_s
        return averaging_timeout_s + 5.0 + self.end_margin_s

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every process group still running, then SIGKILL what is left after ``timeout_s``."""
        for p in self.procs:
            if p.popen.poll() is None:
                _signal_group(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.popen.pid, signal.SIGKILL)
                p.popen.wait()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached `simulate`: handled like Ctrl+C (every process group stopped), exit 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _terminate_like_ctrl_c() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Stopped` in the main thread, as SIGINT raises KeyboardInterrupt.

    Without it a SIGTERM (a process manager, ``kill``, a CI timeout) ended `simulate` at once, and the coordinator
    and nodes it had started, each in its own session, ran on. Off the main thread (no handlers there) a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise Stopped(signum)

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_simulation(sim: Simulation, total_rounds: int) -> int:
    """Run it all; print the table to stdout; returns the exit code (0 = all succeeded and agreed; 130 on Ctrl+C,
    128 + signum on SIGTERM / SIGHUP, after every process it started has been stopped)."""
    try:
        with _terminate_like_ctrl_c():
            return _run_simulation(sim, total_rounds)
    except KeyboardInterrupt as e:
        sim.console.print("interrupted: stopping all processes")
        sim.stop_all()
        return 128 + e.signum if isinstance(e, Stopped) else 130


def _run_simulation(sim: Simulation, total_rounds: int) -> int:
    console = sim.console
    try:
        console.print(f"starting the coordinator (run dir {sim.run_dir}; the first run on this machine warm-starts "
                      "the policy, cached per user)")
        peer = sim.start_coordinator()
        console.print(f"coordinator at {peer}; starting {sim.nodes} node(s)")
        sim.start_nodes(peer)
        codes = sim.wait(total_rounds)
    except SimulationError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        sim.stop_all()
        return 1
    finally:
        sim.stop_all()
    metrics = read_metrics(sim.run_dir)
    rows = round_table(metrics) if metrics else []  # no metrics (every node failed at join): skip its torch import
    print(format_table(rows))
    for rnd in no_tool_call_rounds(rows):
        print(f"WARNING: round {rnd}: no episode produced a parsed tool call (it trained on nothing: check the chat "
              "template / tools / --model)")
    failed = {n: c for n, c in codes.items() if c != 0 or (n == "coordinator" and sim.coordinator_stopped)}
    nodes_failed = any(name != "coordinator" for name in failed)
    for name, code in failed.items():
        if name == "coordinator" and sim.coordinator_stopped and nodes_failed:
            continue  # its log ends with its shutdown, not the cause: `_print_causes` says why it was stopped
        proc = next(p for p in sim.procs if p.name == name)
        console.print(f"[red]{name} exited with code {code}[/red]; last lines of {proc.log_path}:\n"
                      f"{escape(proc.tail())}", soft_wrap=True)
    for row in rows:
        if row["healed"]:
            console.print(f"[yellow]WARNING: round {row['round']}: the replicas parted (several all-reduce groups, or "
                          f"a partition); {', '.join(row['healed'])} took the canonical theta at their next sync "
                          "(heal_split): their pseudo-gradients of that round and the inner steps after it were "
                          "dropped[/yellow]")
    disagree = [r["round"] for r in rows if not r["sha_agree"]]
    if disagree:
        console.print(f"[red]global_sha256 differs between peers in round(s) {disagree}[/red]")
    if len(rows) < total_rounds:
        console.print(f"[red]only {len(rows)} of {total_rounds} rounds completed[/red]")
    _print_causes(sim, failed)
    ok = not failed and not disagree and len(rows) >= total_rounds
    if ok and sim.eval_episodes > 0:
        for line in evaluate_run(sim.run_dir, sim.eval_episodes):
            print(line)
    return 0 if ok else 1


def _print_causes(sim: Simulation, failed: dict[str, int]) -> None:
    """Last, one line per failed process: ``NAME exited with code C: <its last error line>``; for a coordinator that
    `simulate` stopped, why it did instead (its own last line would only say that it was stopped)."""
    for name, code in failed.items():
        proc = next(p for p in sim.procs if p.name == name)
        if name == "coordinator" and sim.coordinator_stopped:
            cause = f"stopped by simulate (exit {code}): {sim.coordinator_stopped}"
        else:
            cause = f"exited with code {code}: {proc.error_line() or f'(nothing in {proc.log_path})'}"
        sim.console.print(f"[red]{name}[/red] {escape(cause)}", soft_wrap=True)


def evaluate_run(run_dir: Path, episodes: int, seed: int = 12345) -> list[str]:
    """The fixed evaluation of a finished run: its first checkpoint (the warm start, round 0) against its last, on
    ``episodes`` held-out tasks of its env (``reset(seed, "eval-i")``: ids no warm start or run draws), sampled at the
    run's GRPO temperature and greedy, played in this process (`composer_diloco.policy.evaluate.compare_policies`).

    Returns:
        the lines to print under the table, each ``eval: ...``; one line saying why when the run cannot be evaluated
        here (a ``[tasks]`` dataset run, whose tasks are not the env's own; a missing checkpoint; an env that fails).
    """
    from composer_diloco.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint_policy, read_outer_state
    from composer_diloco.config import RunConfig
    from composer_diloco.policy.evaluate import compare_policies

    first, final = checkpoint_dir(run_dir) / "round-000000", latest_checkpoint(run_dir)
    if final is None or not (first / "outer.pt").is_file():
        return ["eval: skipped (the run has no round-0 and final checkpoint to compare)"]
    final_state = read_outer_state(final)
    config = RunConfig.from_json(final_state["config"])
    if config.tasks.path is not None:
        return [f"eval: skipped (tasks come from {config.tasks.path}, not the env's own generator; evaluate with "
                "python -m composer_diloco.policy evaluate)"]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars between the table and the eval lines
    try:
        before, tokenizer = load_checkpoint_policy(first)
        after, _ = load_checkpoint_policy(final)
        comparisons = compare_policies(
            before, after, tokenizer, episodes, seed, temperatures=(config.grpo.temperature, 0.0),
            env=config.env.server_module, max_calls=config.env.max_tool_calls,
            max_new_tokens=config.env.max_turn_tokens, reset_kwargs=config.env.reset_kwargs or None)
    except Exception as e:  # noqa: BLE001 (the run itself succeeded: say why the evaluation did not)
        return [f"eval: failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
    rounds = int(final_state["round"])
    if config.report.to:
        report_evaluation(config, comparisons, rounds)
    return [f"eval: {c.describe('warm start', f'round {rounds}')}" for c in comparisons]


def report_evaluation(config, comparisons, rounds: int) -> None:
    """Send the fixed evaluation to the run's trackers (``[report]``) as a run of its own, ``evaluation``, in the
    run's group: ``eval/<greedy|sampled>/before``, ``.../after``, ``.../diff``, ``.../diff_se`` (mean rewards) at
    step ``rounds``."""
    from composer_diloco.report import Reporter

    values = {}
    for c in comparisons:
        how = "greedy" if c.temperature == 0 else "sampled"
        values.update({f"eval/{how}/before": c.before, f"eval/{how}/after": c.after, f"eval/{how}/diff": c.diff,
                       f"eval/{how}/diff_se": c.diff_se, f"eval/{how}/episodes": c.n_episodes})
    reporter = Reporter(config, peer="evaluation", role="evaluation")
    try:
        reporter.log_extra(values, step=rounds)
    finally:
        reporter.finish()
