"""bench/long_run.py counts statuses, group sizes and the two transport faults its docstring names."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from long_run import summarize  # noqa: E402


def _write(run_dir: Path, peer: str, records: list[dict]) -> None:
    (run_dir / peer).mkdir(parents=True)
    (run_dir / peer / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_s_rounds_and_faults_are_counted(tmp_path):
    _write(tmp_path, "coordinator", [{"round": 0, "status": "averaged", "peers": 3},
                                     {"round": 1, "status": "resynced", "peers": 0}])
    _write(tmp_path, "node-0", [{"round": 0, "status": "averaged", "peers": 3, "sync_seconds": 0.5},
                                {"round": 1, "status": "averaged", "peers": 2, "sync_seconds": 45.0}])
    (tmp_path / "logs").mkdir()
    # rich wraps long lines: the counts must survive a line break inside the message
    (tmp_path / "logs" / "node-0.log").write_text("WARN peer X sent 15\n     parts, but we expected 16\n"
                                                  "WARN ... could not find a group')\n")
    out = summarize(tmp_path)
    assert out["rounds"] == 2 and out["statuses"] == {"averaged": 3, "resynced": 1}
    assert out["peers"] == {3: 2, 0: 1, 2: 1} and out["node_rounds_over_5s"] == 1 and out["sync_s_max"] == 45.0
    assert out["truncated_reply_streams"] == 1 and out["could_not_find_a_group"] == 1


def test_an_empty_run_dir_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics"):
        summarize(tmp_path)
