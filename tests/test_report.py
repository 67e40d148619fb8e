"""``[report]`` (`composer_diloco.report`): the metrics a tracker gets, the config's checks and refusals.

The run that reports to trackio, its store read back and its dashboard in a real browser, is the main job's run:
tests/test_localhost_run.py (one run for the main checks and these: the suite's time).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from composer_diloco.config import ConfigError, RunConfig, load_config
from composer_diloco.report import PEERS_TABLE_COLUMNS, check_trackers, flatten, peers_table, theta_agreement
from composer_diloco.outer.swarm import PeerRecord
import prefork

ROOT = Path(__file__).resolve().parents[1]


def test_flatten_keeps_the_numbers_under_the_metrics_names():
    record = {"round": 3, "mean_reward": 0.5, "status": "averaged", "rejected": ["node-1"], "deadline_hit": False,
              "inner_phase_seconds": {"generation": 1.25, "optimizer": 0.5}, "loss": float("nan"), "x": None}
    assert flatten(record) == {"round": 3, "mean_reward": 0.5, "deadline_hit": 0,
                               "inner_phase_seconds/generation": 1.25, "inner_phase_seconds/optimizer": 0.5}


def test_peers_table_has_a_row_per_live_peer_coordinator_first():
    peers = [PeerRecord("node-1", "node", 4, t=1.0), PeerRecord("coordinator", "coordinator", 4, t=1.0),
             PeerRecord("node-0", "node", 3, t=1.0)]
    rows = peers_table(4, peers)
    assert [r[1] for r in rows] == ["coordinator", "node-0", "node-1"]
    assert all(len(r) == len(PEERS_TABLE_COLUMNS) and r[0] == 4 for r in rows)
    assert rows[1][PEERS_TABLE_COLUMNS.index("peer_round")] == 3
    assert rows[0][PEERS_TABLE_COLUMNS.index("inner_s")] is None  # not "": wandb refuses a column of mixed types


def test_theta_agreement_reads_the_hash_of_the_round_or_the_lineage_past_it():
    a, b = "a" * 64, "b" * 64
    peers = [PeerRecord("coordinator", "coordinator", 5, t=1.0, sha=a),  # in round 5: its sha
             PeerRecord("node-0", "node", 6, t=1.0, sha=b, lineage={5: a[:16], 6: b[:16]}),  # past it: its lineage
             PeerRecord("node-1", "node", 5, t=1.0, sha="")]  # no hash yet: not counted
    assert theta_agreement(peers, 5) == (2, 1)
    peers.append(PeerRecord("node-2", "node", 5, t=1.0, sha=b))
    assert theta_agreement(peers, 5) == (3, 2)
    assert theta_agreement(peers, 9) == (0, 0)


def test_a_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    with pytest.raises(ConfigError, match=r'trackio package is not installed: pip install -e "\.\[trackio\]"'):
        check_trackers(RunConfig.model_validate({"report": {"to": ["trackio"]}}))
    check_trackers(RunConfig())  # reporting nowhere needs nothing


def test_report_off_keeps_the_config_digest_of_runs_before_it(tmp_path):
    plain = load_config(None)
    (tmp_path / "off.toml").write_text("[report]\nto = []\n")
    assert load_config(tmp_path / "off.toml").digest() == plain.digest()
    assert "report" not in json.loads(plain.to_json())


@pytest.mark.parametrize("body,expected", [
    ('[report]\nto = ["tensorboard"]\n', "field 'report.to.0': Input should be 'trackio' or 'wandb'"),
    ('[report]\nto = ["trackio"]\nproject = "a b"\n', "field 'report.project'"),
])
def test_a_bad_report_section_is_refused_before_the_network(tmp_path, body, expected):
    (tmp_path / "bad.toml").write_text(body)
    proc = prefork.run([sys.executable, "-m", "coordinator", "start", "--config", str(tmp_path / "bad.toml"),
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and expected in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written
