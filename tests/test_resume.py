"""`composer-coordinator start --resume`: a stopped run continues from its last checkpoint, at the right round."""

import subprocess
import sys
from pathlib import Path

import pytest

from composer_diloco.metrics import read_metrics
from composer_diloco.checkpoint import latest_checkpoint, read_outer_state
from local_run import assert_peer_line, coordinator_line, free_listen_address
from tests_support import stop_processes

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_resume_continues_from_the_last_checkpoint(run_dir):
    first = subprocess.run([sys.executable, "-m", "coordinator", "simulate", "--eval-episodes", "0", "--nodes", "1", "--rounds", "1",
                            "--config", str(SMOKE), "--run-dir", str(run_dir)], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    after_one = read_outer_state(latest_checkpoint(run_dir))
    assert after_one["round"] == 1

    procs = []
    try:
        listen = free_listen_address()  # its line is known (its key is in the run dir): the node starts beside it
        peer = coordinator_line(run_dir, listen)
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "start", "--resume", "--rounds", "2", "--config", str(SMOKE),
             "--run-dir", str(run_dir), "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=ROOT)
        procs.append(coordinator)
        node = subprocess.Popen([sys.executable, "-m", "nodes", "join", "--peer", peer, "--run-dir",
                                 str(run_dir), "--name", "node-b", "--device", "cpu"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        procs.append(node)
        assert_peer_line(coordinator, peer)
        assert node.wait(timeout=600) == 0
        assert coordinator.wait(timeout=60) == 0
    finally:
        stop_processes(procs)

    metrics = read_metrics(run_dir)
    assert [r["round"] for r in metrics["node-b"]] == [1]  # the joiner started at the resumed round
    coordinator_rounds = [r["round"] for r in metrics["coordinator"]]
    assert coordinator_rounds == [0, 1]
    final = read_outer_state(latest_checkpoint(run_dir))
    assert final["round"] == 2 and final["global_sha256"] == metrics["node-b"][0]["global_sha256"]
    assert final["global_sha256"] != after_one["global_sha256"]


@pytest.mark.timeout(120)
def test_resume_without_a_checkpoint_fails_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "coordinator", "start", "--resume", "--run-dir", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert r.returncode == 1 and "--resume: no checkpoint in" in r.stderr
