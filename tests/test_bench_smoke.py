"""Benchmarks are not run whole in CI: a short run of each script checks that it still works."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_collator_bench_smoke():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "collator.py"), "--turns", "8", "--traces", "1",
                        "--repeats", "1"], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["turns"] == 8 and row["prefix_retokenize_s"] > 0 and row["ours_raw_trace_s"] > 0


def _with_warm_start(out: Path, warm_cache: Path) -> Path:
    """A bench --out folder whose shared warm start is the test session's (no second warm start)."""
    out.mkdir()
    (out / "warmstart").symlink_to(warm_cache, target_is_directory=True)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_learning_bench_smoke(tmp_path, warm_cache):
    out = _with_warm_start(tmp_path / "learning", warm_cache)
    bench = str(ROOT / "bench" / "learning.py")
    r = subprocess.run([sys.executable, bench, "run", "--smoke", "--out", str(out)], capture_output=True, text=True,
                       timeout=280, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, bench, "report", "--out", str(out), "--figures", str(tmp_path / "fig"),
                        "--bin", "8"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"diloco-N2-H2"}
    for arm in summary.values():
        assert arm["rounds"] == 1 and arm["curve"] and 0.0 <= arm["final_reward"][0] <= 1.0
    assert "| diloco-N2-H2 | 1 | 1 |" in r.stdout
    assert (tmp_path / "fig" / "learning_other.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compression_bench_smoke(tmp_path, warm_cache):
    out = _with_warm_start(tmp_path / "traffic", warm_cache)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "compression.py"), "--nodes", "1", "--rounds", "1",
                        "--codecs", "int8", "--out", str(out)], capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    traffic = json.loads((out / "traffic.json").read_text())
    assert traffic["params"] > 0 and traffic["rows"][0]["per_node_per_round"] > 0 and traffic["rows"][0]["agree"]
