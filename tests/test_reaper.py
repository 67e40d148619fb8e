"""A SIGKILLed node or coordinator leaves nothing behind (`composer_diloco.reaper`), and the survivors go on.

Only the peer's main process is killed (``os.kill(pid, SIGKILL)``, not its process group): that is what the OOM
killer or a container runtime does, and what left hivemind's DHT and averager processes and their ``p2pd``
daemons running as orphans before the reaper.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from composer_diloco.reaper import _alive, reap
from local_run import LocalRun, write_config
from tests_support import process_tree

CONFIG = """
rounds = 6
inner_steps = 2
[network]
round_slack_s = 60.0
heartbeat_s = 1.0
heartbeat_ttl_s = 6.0
averaging_timeout_s = 10.0
"""

GONE_WITHIN_S = 5.0  # the reaper polls every 0.5 s; SIGKILL is immediate


def kill_main_process(run: LocalRun, name: str) -> tuple[list[psutil.Process], set[str], float]:
    """SIGKILL ``name``'s main process only; returns the process tree it had (reaper excluded), the names of its
    processes, and the kill time."""
    proc = run.procs[name]
    tree = [p for p in process_tree(proc.pid) if "composer_diloco.reaper" not in " ".join(_cmdline(p))]
    names = {_name(p) for p in tree}
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return tree, names, time.time()


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def wait_gone(tree: list[psutil.Process], what: str) -> float:
    """Seconds until no process of ``tree`` runs (a zombie counts as gone); fails after `GONE_WITHIN_S`."""
    start = time.monotonic()
    while True:
        alive = [p for p in tree if _running(p)]
        if not alive:
            return time.monotonic() - start
        if time.monotonic() - start > GONE_WITHIN_S:
            names = [f"{p.pid} {' '.join(_cmdline(p))[:80]}" for p in alive]
            raise AssertionError(f"{what}: {len(alive)} of {len(tree)} processes still run {GONE_WITHIN_S} s after "
                                 f"the SIGKILL: {names}")
        time.sleep(0.1)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_sigkilled_node_then_coordinator_leave_no_process_and_the_survivors_go_on(run_dir, tmp_path):
    run = LocalRun(run_dir, write_config(tmp_path / "reaper.toml", CONFIG))
    try:
        run.start_coordinator(wait=False)  # the nodes start beside it (the suite's time)
        for name in ("node-0", "node-1"):
            run.start_node(name)
        run.wait_peer_line()
        run.wait_round("node-1", 0)

        # a node, in its next inner phase
        tree, names, killed_at = kill_main_process(run, "node-1")
        assert "p2pd" in names and len(tree) >= 4, f"expected the DHT, averager, p2pd and env server in {names}"
        took = wait_gone(tree, "node-1")
        print(f"\nnode-1 SIGKILLed: its {len(tree)} processes ({', '.join(sorted(names))}) gone after {took:.1f} s")
        went_on = run.wait_round("coordinator", 1, timeout_s=120)
        assert went_on["peers"] == 2 and went_on["status"] == "averaged"
        print(f"the coordinator and node-0 averaged round 1 {went_on['time'] - killed_at:.1f} s after the kill")

        # the coordinator, in a later round
        run.wait_round("node-0", 2)
        tree, names, killed_at = kill_main_process(run, "coordinator")
        took = wait_gone(tree, "the coordinator")
        print(f"coordinator SIGKILLed: its {len(tree)} processes ({', '.join(sorted(names))}) gone after {took:.1f} s")
        assert run.wait_exit("node-0", timeout_s=240) == 0, run.log_tail("node-0")
        last = run.records()["node-0"][-1]
        assert last["round"] == 5, last
        print(f"node-0 finished the run alone: round 5 status {last['status']}")
    finally:
        run.stop()


FORK_THEN_EXIT = """
import os, sys, time
sys.stdin.readline()
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
os._exit(0)
"""


def test_a_fork_made_after_the_last_snapshot_is_killed_too():
    """The peer forks (an averager) and exits between two snapshots: the orphan is found by its command line."""
    peer = subprocess.Popen([sys.executable, "-c", FORK_THEN_EXIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    reaper = threading.Thread(target=reap, args=(peer.pid,), kwargs={"poll_s": 3.0})
    reaper.start()
    time.sleep(0.5)  # the reaper took its first snapshot (no child yet) and sleeps
    peer.stdin.write("go\n")
    peer.stdin.flush()
    child = int(peer.stdout.readline())
    try:
        reaper.join(timeout=30)
        assert not reaper.is_alive()
        deadline = time.monotonic() + GONE_WITHIN_S
        while _alive(child):
            assert time.monotonic() < deadline, f"the orphaned fork {child} outlived the reaper"
            time.sleep(0.05)
    finally:
        peer.wait()
        if psutil.pid_exists(child):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
