"""Helpers for tests that start real processes: stop them (SIGTERM, then SIGKILL) in `finally`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serve(args: list[str], port: int, log_path: Path | None = None,
          timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """``python ARGS`` (an env server listening on 127.0.0.1:``port``) in its own process group, from the repo root;
    returns it and its URL once ``/health`` answers. The process is stopped if it does not within ``timeout_s``.
    Output goes to ``log_path`` (default: discarded)."""
    from composer_diloco.rollout.env_process import wait_for_env

    out = open(log_path, "w") if log_path is not None else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_env(url, timeout_s=timeout_s, process=proc)
    except BaseException:
        stop_processes([proc])
        raise
    return proc, url


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Terminate each process (its group if it leads one), wait, then kill; safe on exited processes."""
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait(timeout=timeout_s)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
    except ProcessLookupError:
        pass


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line a CLI printed on stderr (fails the test if there is not exactly one)."""
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def imported_modules(result: subprocess.CompletedProcess) -> set[str]:
    """The modules a ``python -X importtime`` process imported (read from its stderr)."""
    return {line.rpartition("|")[2].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


def run_processes_snapshot() -> set[int]:
    """PIDs of processes a run leaves behind if it leaks: p2pd daemons and env servers."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if p.info.get("name") == "p2pd" or "envs.tool_env.server" in cmd or "-m nodes" in cmd \
                or "-m coordinator" in cmd:
            pids.add(p.info["pid"])
    return pids


def process_tree(pid: int) -> list:
    """``psutil.Process`` es of ``pid`` and all its descendants now (empty if ``pid`` is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def run_peer_trio(script: Path, out_dir: Path, timeout_s: float) -> list:
    """Run three processes of a peer script (``--index i --out DIR/i.json``; peer 0 also ``--addr-out``, the others
    ``--peer`` its multiaddr), wait for all to exit 0 within ``timeout_s``, stop any left; returns the three JSON
    results in index order."""
    import json
    import time

    import prefork  # forked from the suite's process template (its imports done once)

    procs: list[subprocess.Popen] = []
    try:
        addr_file = out_dir / "addr"
        procs.append(prefork.popen([sys.executable, str(script), "--index", "0", "--out", str(out_dir / "0.json"),
                                       "--addr-out", str(addr_file)]))
        deadline = time.monotonic() + 60
        while not addr_file.exists() or not addr_file.read_text():
            assert procs[0].poll() is None, "peer 0 died"
            assert time.monotonic() < deadline, "peer 0 printed no address"
            time.sleep(0.2)
        for i in (1, 2):
            procs.append(prefork.popen([sys.executable, str(script), "--index", str(i), "--peer",
                                           addr_file.read_text(), "--out", str(out_dir / f"{i}.json")]))
        for p in procs:
            assert p.wait(timeout=timeout_s) == 0
    finally:
        stop_processes(procs)
    return [json.loads((out_dir / f"{i}.json").read_text()) for i in range(3)]


def peer_script_args():
    """A trio peer script's arguments (``--index``, ``--peer``, ``--out``, ``--addr-out``) and its started hivemind
    DHT (peer 0 writes its visible multiaddr to ``--addr-out``). Returns ``(args, dht)``."""
    import argparse

    from hivemind import DHT

    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--peer", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--addr-out", default=None)
    args = ap.parse_args()
    dht = DHT(initial_peers=[args.peer] if args.peer else None, start=True)
    if args.addr_out:
        with open(args.addr_out, "w") as f:
            f.write(str(dht.get_visible_maddrs()[0]))
    return args, dht


def run_scenario_in_child(module: str, function: str, tmp_path: Path,
                          timeout_s: float = 280) -> subprocess.CompletedProcess:
    """Run ``module.function(tmp_path)`` (a test module in this folder) in a fresh Python process and return it.

    For scenarios that hold several hivemind averagers in one process: such a process can abort at interpreter exit
    (torch's shared-memory manager, "Broken pipe"), which must not take pytest down. The scenario prints "scenario
    passed" and leaves through `end_peer_scenario`."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {module} as t; "
            f"t.{function}(t.Path({str(tmp_path)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          start_new_session=True)


def close_peers(peers, dhts) -> None:
    """Stop in-process `DiLoCoPeer`s (their heartbeats and averagers), then their DHTs."""
    for peer in peers:
        peer.swarm.close()
        peer.shutdown()
    for dht in dhts:
        dht.shutdown()


def end_peer_scenario() -> None:
    """Say "scenario passed" and leave at once, skipping the interpreter teardown (see `run_scenario_in_child`)."""
    print("scenario passed", flush=True)
    os._exit(0)


def cmdline(p) -> str:
    """A `psutil.Process`'s command line as one string; "" once it is gone (or a zombie on some platforms)."""
    import psutil

    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def alive(p) -> bool:
    """Whether a `psutil.Process` still runs (a zombie does not)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
