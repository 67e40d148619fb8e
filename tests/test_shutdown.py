"""SIGINT/SIGTERM: the coordinator and a node mid-training leave within 10 s, their env servers with them."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from local_run import coordinator_line, free_listen_address
from tests_support import process_tree, run_processes_snapshot, stop_processes

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
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "start", "--config", str(SMOKE), "--rounds", "50",
             "--run-dir", str(run_dir), "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=ROOT,
        )
        procs.append(coordinator)
        node = subprocess.Popen(
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


def _cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone, or a zombie on some platforms
        return ""


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigterm_to_simulate_stops_every_process_it_started(tmp_path):
    """A SIGTERM to `simulate` (a process manager, ``kill``, a CI timeout) stops its coordinator, its nodes and
    their env servers and p2pd daemons, as Ctrl+C does, and it exits 143. (They run in their own sessions, so
    before the fix they ran on after `simulate` was gone.)"""
    sim = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "simulate", "--nodes", "2", "--config", str(SMOKE), "--rounds", "50",
         "--eval-episodes", "0", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    started = []
    try:
        deadline = time.monotonic() + 240
        while True:  # both nodes up, each with its env server: every kind of process the run starts
            assert sim.poll() is None, f"simulate exited with {sim.returncode} before its nodes were up"
            assert time.monotonic() < deadline, "simulate's nodes did not start their env servers in 240 s"
            started = process_tree(sim.pid)[1:]
            cmds = [_cmdline(p) for p in started]
            if sum("-m nodes" in c for c in cmds) >= 2 and sum("envs.tool_env.server" in c for c in cmds) >= 2:
                break
            time.sleep(0.5)
        sim.send_signal(signal.SIGTERM)
        assert wait_exit(sim, 30) < 30
        assert sim.returncode == 128 + signal.SIGTERM
        time.sleep(1.0)
        left = [_cmdline(p) for p in started if _alive(p)]
        assert left == [], left
    finally:
        stop_processes([sim])
        for p in started:  # never leak what the test started, whatever failed
            try:
                p.kill()
            except psutil.Error:
                pass
