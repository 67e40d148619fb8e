"""Benchmarks are not run whole in CI: a short run of each script checks that it still works.

The learning, traffic and overhead smokes run side by side (three subprocesses at once), as the join-check
refusals do: each is mostly process start-up, and the suite has a time budget. `bench/sync_cost.py` has its own
test (`test_bench_sync_cost.py`).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = pytest.mark.bench  # not in the default run: python -m pytest -m bench

ROOT = Path(__file__).resolve().parents[1]
OVERHEAD_ARMS = ("a_trl", "b_ours", "c_sdpo", "d_dpo", "e_both")


@pytest.mark.timeout(180)
def test_collator_bench_smoke():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "collator.py"), "--turns", "8", "--traces", "1",
                        "--repeats", "1"], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["turns"] == 8 and row["prefix_retokenize_s"] > 0 and row["ours_raw_trace_s"] > 0


def _bench(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "bench" / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait for a bench subprocess; assert exit 0; return its stdout."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{err[-3000:]}"
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_learning_traffic_and_overhead_bench_smokes(tmp_path, warm_cache):
    # the benches' processes inherit the session's COMPOSER_DILOCO_CACHE, where warm_cache is: no second warm start
    learning_out, traffic_out, overhead_out = (tmp_path / "learning", tmp_path / "traffic", tmp_path / "overhead")
    procs = [
        _bench("learning.py", "run", "--smoke", "--out", str(learning_out)),
        _bench("compression.py", "--nodes", "1", "--rounds", "1", "--codecs", "int8", "--out", str(traffic_out)),
        # the session's warm start, so the SDPO and DPO channels have sites and pairs to train on
        _bench("overhead.py", "--smoke", "--warmstart-steps", "200", "--out", str(overhead_out)),
    ]
    try:
        for proc in procs:
            _finish(proc, 380)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    # learning: one arm, one round, a curve, a table row and a figure
    report = _finish(_bench("learning.py", "report", "--out", str(learning_out), "--figures",
                            str(tmp_path / "fig"), "--bin", "8"), 120)
    summary = json.loads((learning_out / "summary.json").read_text())
    assert set(summary) == {"diloco-N2-H2"}
    arm = summary["diloco-N2-H2"]
    assert arm["rounds"] == 1 and arm["curve"] and 0.0 <= arm["final_reward"][0] <= 1.0
    assert "| diloco-N2-H2 | 1 | 1 |" in report and 0.0 <= arm["first_reward"][0] <= 1.0
    assert len(arm["flat_groups"]) == 1 and 0.0 <= arm["flat_groups"][0] <= 1.0  # the nodes' frac_reward_zero_std
    assert (tmp_path / "fig" / "learning_other.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # traffic: measured bytes per node, replicas identical
    traffic = json.loads((traffic_out / "traffic.json").read_text())
    assert traffic["params"] > 0 and traffic["rows"][0]["per_node_per_round"] > 0 and traffic["rows"][0]["agree"]

    # overhead: every arm timed on the same episodes; the extra channels had work to do
    result = json.loads((overhead_out / "overhead.json").read_text())
    assert set(result["arms"]) == set(OVERHEAD_ARMS) and result["same_episodes"]
    for name in OVERHEAD_ARMS:
        timed = result["arms"][name]
        assert timed["step_s"]["median"] > 0 and timed["rollout_s"]["median"] > 0 and timed["train_s"]["median"] > 0
        assert len(timed["step_s"]["values"]) == result["steps"] == 2
    both = result["arms"]["e_both"]
    assert both["sdpo_sites_per_step"] + both["dpo_pairs_per_step"] > 0


@pytest.mark.timeout(300)
def test_coding_eval_bench_smoke(tmp_path):
    """An untrained tiny policy plays 2 fixed coding tasks end to end against a coding env server it starts (it
    earns nothing; the numbers are checked). Two cold Python starts (the bench, the server): slow on a busy CPU."""
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    tokenizer = load_default_tokenizer()
    build_tiny_model(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "coding_eval.py"), str(tmp_path / "tiny"), "--episodes",
                        "2", "--temperature", "0", "--max-turn-tokens", "16"],
                       capture_output=True, text=True, timeout=290, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["episodes"] == 2 and row["temperature"] == 0.0 and 0.0 <= row["mean_reward"] <= 1.0
    assert sum(1 for _ in row["by_family"]) >= 1
