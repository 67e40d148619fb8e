"""`bench/gpu.py --dry-run`: the GPU yardstick's code paths on the CPU, so the script cannot rot between GPU loans.

Every run's config is written and checked (`load_config`) before anything runs; one run goes through at 2-layer sizes
(the suite's time: the others are the same code with other configs, and their two-node mechanics are the localhost
tests'): the 16-episode step with continuous batching (model build, simulate, the phase split, tokens per second, the
memory columns, the markdown table)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench  # a bench script's smoke: `python -m pytest -m bench` (the suite's time: ~35 s)
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_gpu_bench_dry_run_writes_its_table(tmp_path):
    out = tmp_path / "gpu"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--out", str(out), "--only",
                        "0.6b-16ep-continuous"], capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "gpu.json").read_text())
    assert report["dry_run"] and report["device"] == "cpu" and report["torch"]
    runs = {run["name"]: run["summary"] for run in report["runs"]}
    assert set(runs) == {"0.6b-16ep-continuous"}
    perf = runs["0.6b-16ep-continuous"]
    assert perf["exit"] == 0 and perf["agree"] and perf["rounds"] == 1, perf
    written = sorted(p.name for p in (out / "configs").iterdir())
    assert written == sorted(f"{n}.toml" for n in ("0.6b-lora-2nodes", "0.6b-full-2nodes", "0.6b-16ep-batched",
                                                   "0.6b-16ep-batched-fp32", "0.6b-16ep-continuous", "1.7b-16ep"))
    assert perf["generated_tokens_per_s"] > 0 and perf["inner_phase_seconds"]["generation"] > 0, perf
    assert perf["memory_peak_gb"] is not None and perf["memory_planned_gb"] > 0, perf
    table = (out / "gpu.md").read_text()
    assert "| 0.6b-16ep-continuous | 0 | yes |" in table and "(dry run)" in table, table
