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
