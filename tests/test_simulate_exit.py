"""`simulate` ends when its nodes do: every node failed at join, so it stops its coordinator and exits 1 within
seconds, naming each node's error line (before, its coordinator waited ``--max-idle 600`` s for nodes that were gone).
Nodes that all exit 0 leave the coordinator its end of run, and only that."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from composer_diloco.config import load_config
from coordinator.simulate import Simulation, _print_causes, last_error_line
import prefork
from tests_support import process_tree, stop_processes

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
NODES = 2


def test_last_error_line_is_the_cli_error_else_the_last_line():
    log = "INFO joined\nWARNING env error: the env said no\ncomposer-node: error: no peer sent the model\nINFO bye\n\n"
    assert last_error_line(log) == "composer-node: error: no peer sent the model"
    traceback = "WARNING env error: retrying\nTraceback (most recent call last):\n  File x\nRuntimeError: boom\n"
    assert last_error_line(traceback) == "RuntimeError: boom"
    assert last_error_line("") == ""


def _stand_ins(tmp_path: Path, coordinator: str, *nodes: str) -> Simulation:
    """A `Simulation` whose coordinator and nodes are ``python -c CODE`` processes (its output in a string)."""
    sim = Simulation(nodes=len(nodes), run_dir=tmp_path, console=Console(file=io.StringIO(), width=100))
    sim._spawn("coordinator", ["-c", coordinator])
    for i, code in enumerate(nodes):
        sim._spawn(f"node-{i}", ["-c", code])
    return sim


SLEEPS = "import time; time.sleep(600)"  # a coordinator waiting for nodes that are gone
FAILS = "import sys; print('INFO joining', file=sys.stderr); sys.exit('composer-node: error: boom [lora]')"


@pytest.mark.timeout(60)
def test_a_node_that_fails_stops_the_coordinator_once_every_node_has_exited(tmp_path):
    sim = _stand_ins(tmp_path, SLEEPS, FAILS, "import time; time.sleep(1)")
    try:
        codes = sim.wait(total_rounds=2)  # returns once node-1 exits too: the coordinator never would
        assert codes == {"coordinator": -signal.SIGTERM, "node-0": 1, "node-1": 0}
        assert sim.coordinator_stopped.startswith("every node had exited (node-0 with an error)")
        _print_causes(sim, {n: c for n, c in codes.items() if c != 0})
        lines = sim.console.file.getvalue().splitlines()
        assert lines[-2].startswith("coordinator stopped by simulate (exit -15): every node had exited"), lines
        assert lines[-1] == "node-0 exited with code 1: composer-node: error: boom [lora]", lines
    finally:
        sim.stop_all()


@pytest.mark.timeout(60)
def test_nodes_that_exit_0_leave_the_coordinator_its_end_of_run(tmp_path):
    sim = _stand_ins(tmp_path, "import time; time.sleep(2)", "pass", "pass")  # it ends the run by itself
    try:
        assert sim.wait(total_rounds=2) == {"coordinator": 0, "node-0": 0, "node-1": 0}
        assert sim.coordinator_stopped is None
    finally:
        sim.stop_all()
    sim = _stand_ins(tmp_path, SLEEPS, "pass")  # stuck: stopped once its end of run is over
    sim.end_grace_s = lambda: 1.0
    try:
        assert sim.wait(total_rounds=2) == {"coordinator": -signal.SIGTERM, "node-0": 0}
        assert sim.coordinator_stopped == "every node had exited 0, and it was still running 1 s later"
    finally:
        sim.stop_all()


def test_end_grace_is_the_runs_linger_plus_a_margin(tmp_path):
    sim = Simulation(nodes=1, run_dir=tmp_path)
    assert sim.end_grace_s() == 45.0 + 5.0 + sim.end_margin_s  # no config.json: the default averaging timeout
    config = json.loads(load_config(SMOKE).to_json())
    config["network"]["averaging_timeout_s"] = 7.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert sim.end_grace_s() == 7.0 + 5.0 + sim.end_margin_s


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_simulate_whose_nodes_all_fail_at_join_exits_1_within_15_s_naming_their_errors(run_dir):
    # 1000 bytes of "device memory": each node's memory plan refuses at join, right after reading the run's config
    # from the DHT (the coordinator plans no memory, so it starts as usual)
    env = {**os.environ, "COMPOSER_DILOCO_DEVICE_MEMORY_BYTES": "1000"}
    out_path, err_path = run_dir.parent / "simulate.out", run_dir.parent / "simulate.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        sim = prefork.popen(
            [sys.executable, "-m", "coordinator", "simulate", "--nodes", str(NODES), "--rounds", "2", "--config",
             str(SMOKE), "--eval-episodes", "0", "--run-dir", str(run_dir)],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
    started: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 240  # the coordinator's start (warm start cached) and the nodes' failures
        while sim.poll() is None:
            assert time.monotonic() < deadline, f"simulate still running after 240 s:\n{err_path.read_text()[-3000:]}"
            started.update((p.pid, p) for p in process_tree(sim.pid)[1:])
            time.sleep(0.2)
        ended_at = time.time()
        stderr = err_path.read_text()
        assert sim.returncode == 1, stderr[-3000:]

        logs = [run_dir / "logs" / f"node-{i}.log" for i in range(NODES)]
        # a node's log is last written when it exits (its error line, then its shutdown): the gap below is at least
        # the time simulate took to notice the nodes' failure, stop the coordinator and exit
        nodes_failed_at = max(log.stat().st_mtime for log in logs)
        gap_s = ended_at - nodes_failed_at
        assert gap_s < 15.0, f"simulate exited {gap_s:.1f} s after its nodes failed:\n{stderr[-3000:]}"

        assert "coordinator stopped by simulate" in stderr and "every node had exited" in stderr, stderr[-3000:]
        for i, log in enumerate(logs):
            error = last_error_line(log.read_text())
            assert error.startswith("composer-node: error: not enough host RAM"), log.read_text()[-3000:]
            assert f"node-{i} exited with code 1: {error}" in stderr.splitlines(), stderr[-3000:]

        # what simulate started (coordinator, nodes, their DHT processes and p2pd) is gone with it
        deadline = time.monotonic() + 30
        while left := [p for p in started.values() if _alive(p)]:
            assert time.monotonic() < deadline, [_cmdline(p) for p in left]
            time.sleep(0.2)
    finally:
        stop_processes([sim])
        for p in started.values():  # never leak what simulate started, whatever failed
            try:
                p.kill()
            except psutil.Error:
                pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""
