"""SIGINT/SIGTERM: the coordinator and a node mid-training leave within 10 s, their env servers with them. A SIGTERM to
`simulate` stopping every process it started is checked on the live run of `tests/test_status.py` (the suite's time)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import prefork
from local_run import coordinator_line, free_listen_address
from tests_support import run_processes_snapshot, stop_processes

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    proc.wait(timeout=timeout_s)
    return time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_sigterm_and_sigint_stop_node_and_coordinator_within_10_s(run_dir):
    before = run_processes_snapshot()
    procs = []
    try:
        listen = free_listen_address()  # its line is known (its key made first): the node starts beside it
        peer = coordinator_line(run_dir, listen)
        coordinator = prefork.popen(
            [sys.executable, "-m", "coordinator", "start", "--config", str(SMOKE), "--rounds", "50",
             "--run-dir", str(run_dir), "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=ROOT,
        )
        procs.append(coordinator)
        node = prefork.popen(
            [sys.executable, "-m", "nodes", "join", "--peer", peer, "--run-dir",
             str(run_dir), "--name", "node-0", "--device", "cpu"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd=ROOT,
        )
        procs.append(node)
        deadline = time.monotonic() + 240
        metrics = run_dir / "node-0" / "metrics.jsonl"
        while not metrics.exists():  # the node is in its second round's inner phase right after this
            assert node.poll() is None, "the node died"
            assert time.monotonic() < deadline, "the node wrote no metrics"
            time.sleep(0.5)
        env_servers = [c for c in psutil.Process(node.pid).children(recursive=True)
                       if "envs.tool_env.server" in " ".join(c.cmdline())]
        assert env_servers, "the node started no env server"

        node.send_signal(signal.SIGTERM)  # what a process manager sends; Ctrl+C (SIGINT) goes to the coordinator
        assert wait_exit(node, 12) < 10.0
        assert node.returncode == 130
        for child in env_servers:
            assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE

        coordinator.send_signal(signal.SIGINT)
        assert wait_exit(coordinator, 12) < 10.0
        assert coordinator.returncode == 130
    finally:
        stop_processes(procs)
    time.sleep(1.0)
    assert run_processes_snapshot() - before == set()

