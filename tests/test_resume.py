"""`composer-coordinator start --resume` without a checkpoint. A stopped run continuing from its last checkpoint, at the
right round, is `tests/test_localhost_run.py::test_the_main_run_resumes_from_its_last_checkpoint` (the main run, resumed:
the suite's time)."""

import sys
from pathlib import Path

import pytest

import prefork

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_resume_without_a_checkpoint_fails_in_one_line(tmp_path):
    r = prefork.run([sys.executable, "-m", "coordinator", "start", "--resume", "--run-dir", str(tmp_path / "x")],
                    capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert r.returncode == 1 and "--resume: no checkpoint in" in r.stderr
