"""The trainer-overhead bench still runs: a smoke run of `bench/overhead.py` (2 steps per arm) on the session's
warm-started policy, so the SDPO and DPO channels have sites and pairs to train on."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("a_trl", "b_ours", "c_sdpo", "d_dpo", "e_both")


def test_overhead_bench_smoke(tmp_path, warm_cache):
    (tmp_path / "warmstart").symlink_to(warm_cache, target_is_directory=True)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--smoke", "--warmstart-steps", "200",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "overhead.json").read_text())
    assert set(result["arms"]) == set(ARMS) and result["same_episodes"]
    for name in ARMS:
        arm = result["arms"][name]
        assert arm["step_s"]["median"] > 0 and arm["rollout_s"]["median"] > 0 and arm["train_s"]["median"] > 0, name
        assert len(arm["step_s"]["values"]) == result["steps"] == 2
    both = result["arms"]["e_both"]
    assert both["sdpo_sites_per_step"] + both["dpo_pairs_per_step"] > 0  # the extra channels had work to do
