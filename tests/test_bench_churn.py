"""The churn bench's accounting (`bench/churn.py`): where a life's lost tail starts with the sync overlapped, which
blocked seconds it puts near another node's new life, and the sample weight the coordinator averaged in from phases
no node line records. Pure functions on hand-made metrics lines: the bench itself runs for minutes (BENCHMARKS 3m)."""

import importlib.util
import sys
from pathlib import Path

from composer_diloco.metrics import thetas_by_round

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("churn_bench", ROOT / "bench" / "churn.py")
churn = importlib.util.module_from_spec(_spec)
sys.modules["churn_bench"] = churn  # dataclasses look their module up
_spec.loader.exec_module(churn)


def _line(peer: str, round_: int, *, started: float, inner: float = 4.0, blocked: float = 0.5, samples: int = 32,
          sha: str = "s", written: float | None = None) -> dict:
    return {"role": "node", "peer": peer, "round": round_, "inner_started": started, "inner_seconds": inner,
            "blocked_seconds": blocked, "sync_seconds": 3.0, "samples": samples, "global_sha256": f"{sha}{round_}",
            "time": written if written is not None else started + inner + blocked}


def test_a_lifes_tail_starts_where_its_last_recorded_phase_ended_not_at_the_lines_write_time():
    # with [outer] overlap the line of round 7 is written one phase later than the phase it records ends
    line = _line("node-0", 7, started=100.0, inner=4.0, blocked=0.5, written=109.0)
    assert churn._phase_ended(line) == 104.5


def test_blocked_seconds_are_split_by_size_and_by_a_new_life_nearby():
    records = {"node-0": [_line("node-0", 1, started=100.0, blocked=0.5),
                          _line("node-0", 2, started=110.0, blocked=6.0)],  # ends inner at 114: node-1 began at 108
               "node-1": [_line("node-1", 2, started=112.0, blocked=3.0)]}  # its own new life does not count
    lives = [churn.Life("node-0", None, 90.0), churn.Life("node-1", None, 108.0)]
    assert churn._blocked(records, lives) == {"total": 9.5, "over_2s": 9.0, "near_a_new_life": 6.0}


def test_weight_the_coordinator_averaged_beyond_the_node_lines_is_unrecorded():
    records = {"node-0": [_line("node-0", 3, started=0.0), _line("node-0", 4, started=5.0)],
               "node-1": [_line("node-1", 3, started=0.0)],  # killed in round 5's phase: no line of round 4
               "coordinator": [{"role": "coordinator", "round": 3, "global_sha256": "s3", "weight_total": 64.0},
                               {"role": "coordinator", "round": 4, "global_sha256": "s4", "weight_total": 64.0}]}
    assert churn._unrecorded_samples(records) == 32
    records["coordinator"][1]["global_sha256"] = "other"  # a node line of another theta is no part of that round
    assert churn._unrecorded_samples(records) == 64


def test_steady_goodput_starts_at_the_last_nodes_first_phase():
    records = {"node-0": [_line("node-0", 0, started=10.0), _line("node-0", 1, started=20.0)],
               "node-1": [_line("node-1", 1, started=20.0)],  # its first start took until 20
               "coordinator": [{"role": "coordinator", "round": 1, "global_sha256": "s1", "weight_total": 64.0}]}
    lives = [churn.Life("node-0", None, 0.0, ended=30.0), churn.Life("node-1", None, 0.0, ended=30.0)]
    # after 20: node-0's round 1 and node-1's round 1, 4 s each, over 10 + 10 node-seconds alive
    # and 64 samples over the 4 s from 20 to the last phase's end, 32 of them of the coordinator's theta
    records["node-1"][0]["global_sha256"] = "other"
    canonical = {1: "s1"}
    assert churn._steady(records, canonical, lives, end=30.0) == {"from": 20.0, "goodput": 0.4, "node_seconds_alive": 20.0,
                                                       "samples_per_s": 16.0, "kept_samples_per_s": 8.0}
    records["node-2"] = []  # a node that never trained: no steady state to speak of
    assert churn._steady(records, canonical, lives, end=30.0)["goodput"] is None


def test_rounds_the_coordinator_missed_count_as_kept_when_its_next_theta_descends_from_them():
    def node(peer, round_, sha=None, status="averaged"):
        line = _line(peer, round_, started=10.0 * round_)
        line["status"] = status
        if sha is not None:
            line["global_sha256"] = sha
        return line

    coordinator = [{"role": "coordinator", "round": r, "global_sha256": f"s{r}"} for r in (0, 1, 4, 5)]
    records = {"node-0": [node("node-0", r) for r in range(6)], "node-1": [node("node-1", r) for r in range(6)],
               "coordinator": coordinator}
    # down for rounds 2-3, back from a live node's theta of round 3: its round 4 is the nodes'
    assert churn._reached_model(records) == {r: f"s{r}" for r in range(6)}
    # back with another theta, the nodes healed to it in round 4: rounds 2-3 never reached its model
    records["node-0"][4]["status"] = records["node-1"][4]["status"] = "resynced"
    assert sorted(churn._reached_model(records)) == [0, 1, 4, 5]
    # one node averaged round 4, the other took the same theta from a peer (killed in the all-reduce): counted
    records["node-0"][4]["status"] = "averaged"
    assert churn._reached_model(records) == {r: f"s{r}" for r in range(6)}
    records["node-0"][4]["status"] = records["node-1"][4]["status"] = "averaged"
    records["coordinator"][2]["global_sha256"] = "other"  # its round 4 is not the nodes' theta
    assert sorted(churn._reached_model(records)) == [0, 1, 4, 5]
    records["coordinator"][2]["global_sha256"] = "s4"
    records["node-1"][2] = node("node-1", 2, sha="split")  # the nodes disagreed in round 2: not counted
    assert sorted(churn._reached_model(records)) == [0, 1, 3, 4, 5]


def test_a_split_round_is_reported_with_whether_its_peers_ended_it_on_one_theta():
    records = {n: [_line(n, r, started=10.0 * r) for r in range(3)] for n in ("node-0", "node-1", "coordinator")}
    assert churn._split_rounds(records, thetas_by_round(records)) == []
    # round 1: node-1's group averaged apart, then took the run's theta (a second record of the round)
    records["node-1"][1] = _line("node-1", 1, started=10.0, sha="split")
    records["node-1"].insert(2, _line("node-1", 1, started=10.0))
    assert churn._split_rounds(records, thetas_by_round(records)) == [{"round": 1, "thetas": 2, "healed": True}]
    # round 2: node-0 kept its own theta
    records["node-0"][2] = _line("node-0", 2, started=20.0, sha="split")
    assert churn._split_rounds(records, thetas_by_round(records))[1] == {"round": 2, "thetas": 2, "healed": False}


def test_a_life_its_standby_forked_is_found_in_node_pid_once_with_the_kill_it_replaces(tmp_path):
    """A process the bench did not start (a standby's forked life, `nodes.standby.Standby.run_lives`) is registered
    from ``node.pid`` once, its life beginning at its start and replacing the kill before it; a pid the bench spawned
    as a waiting standby (a standby that became the node itself) is marked as having taken over instead."""
    import json
    import subprocess
    import time

    forked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    standby = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = churn.Churn(tmp_path, rounds=10, listen="")
        (tmp_path / "node-0").mkdir()
        (tmp_path / "node-1").mkdir()
        since = time.time()  # what the life wrote: its begin (not its start time from /proc, read to the second)
        (tmp_path / "node-0" / "node.pid").write_text(json.dumps({"pid": forked.pid, "since": since}))
        (tmp_path / "node-1" / "node.pid").write_text(json.dumps({"pid": standby.pid, "since": time.time()}))
        run.lives.append(churn.Life("node-1", standby, time.time(), standby=True))
        killed_at = {"node-0": 123.0, "node-1": 456.0}
        new = run.adopt_forked_lives(["node-0", "node-1", "node-2"], killed_at)
        assert [(x.name, x.proc.pid, x.standby, x.replaces_kill_at) for x in new] == [("node-0", forked.pid, True,
                                                                                      123.0)]
        assert new[0].began == new[0].started == since and new[0].proc.poll() is None
        assert run.lives[0].took_over is not None and run.lives[0].replaces_kill_at == 456.0
        assert run.adopt_forked_lives(["node-0", "node-1"], killed_at) == [] and killed_at == {}
        assert run.live("node-0") is new[0]
        forked.kill()
        forked.wait()
        assert new[0].proc.poll() == 0 and run.live("node-0") is None
    finally:
        for p in (forked, standby):
            p.kill()
            p.wait()


def test_a_first_life_forked_under_with_standby_begins_at_the_commands_start(tmp_path):
    """``--with-standby``: the node's first life is forked by the command the bench spawned, after that command's
    imports; its node-seconds (and its startup) count from the spawn, as a plain node's do, not from the fork. A later
    life of the same node begins at its own fork."""
    import json
    import subprocess
    import time

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = churn.Churn(tmp_path, rounds=10, listen="")
        (tmp_path / "node-0").mkdir()
        spawned = time.time() - 20.0  # the command's imports took 20 s before it forked the first life
        run.lives.append(churn.Life("node-0", launcher, spawned, standby=True, starts_node=True))
        assert run.live("node-0") is None  # the command itself is the standby, not the node
        forked_at = time.time()
        (tmp_path / "node-0" / "node.pid").write_text(json.dumps({"pid": first.pid, "since": forked_at}))
        [life] = run.adopt_forked_lives(["node-0"], {})
        assert life.began == life.started == spawned and run.live("node-0") is life
        first.kill()
        first.wait()
        (tmp_path / "node-0" / "node.pid").write_text(json.dumps({"pid": second.pid, "since": time.time()}))
        [later] = run.adopt_forked_lives(["node-0"], {"node-0": forked_at + 1})
        assert later.began > forked_at and later.replaces_kill_at == forked_at + 1
    finally:
        for p in (launcher, first, second):
            p.kill()
            p.wait()


def test_a_resumed_phase_counts_its_last_lifes_seconds_and_episodes():
    """A life that went on from its last life's journal (`composer_diloco.inner.journal`): the cut phase's seconds are
    inner-loop seconds and its episodes part of the weight the coordinator averaged, not unrecorded samples."""
    resumed = {**_line("node-1", 3, started=20.0), "resumed_inner_seconds": 2.0, "resumed_samples": 8}
    records = {"node-0": [_line("node-0", 3, started=20.0)], "node-1": [resumed],
               "coordinator": [{"role": "coordinator", "round": 3, "global_sha256": "s3", "weight_total": 72.0}]}
    assert churn._unrecorded_samples(records) == 0
    lives = [churn.Life("node-0", None, 20.0, ended=30.0), churn.Life("node-1", None, 20.0, ended=30.0)]
    steady = churn._steady(records, {3: "s3"}, lives, end=30.0)
    assert steady["goodput"] == 0.5 and steady["samples_per_s"] == 18.0  # (4 + 4 + 2) / 20; 72 episodes over 4 s
    # the same life re-sent a handed-off phase of 3 s and 16 episodes too (its round was averaged without it)
    resumed.update(resent_inner_seconds=3.0, resent_samples=16)
    records["coordinator"][0]["weight_total"] = 88.0
    assert churn._unrecorded_samples(records) == 0
    steady = churn._steady(records, {3: "s3"}, lives, end=30.0)
    assert steady["goodput"] == 0.65 and steady["samples_per_s"] == 22.0  # (4 + 4 + 2 + 3) / 20; 88 over 4 s


def test_a_landed_phase_counts_in_its_own_round_not_in_the_line_that_records_it():
    """A life killed after its group counted round 2's phase, before its line: the next life records it as landed in
    its round-3 line (``landed_*``). Its seconds are inner-loop seconds, its episodes no longer unrecorded in round 2's
    average, and round 3's average is not charged with them."""
    line2 = {**_line("node-0", 2, started=10.0)}
    line3 = {**_line("node-1", 3, started=20.0), "landed_round": 2, "landed_samples": 32,
             "landed_inner_seconds": 4.0}
    records = {"node-0": [line2, _line("node-0", 3, started=20.0)], "node-1": [line3],
               "coordinator": [{"role": "coordinator", "round": 2, "global_sha256": "s2", "weight_total": 64.0},
                               {"role": "coordinator", "round": 3, "global_sha256": "s3", "weight_total": 64.0}]}
    assert churn._unrecorded_samples(records) == 0
    del line3["landed_round"]  # the same samples, unrecorded: round 2 held 32 more than its lines
    assert churn._unrecorded_samples(records) == 32
    line3["landed_round"] = 2
    lives = [churn.Life("node-0", None, 20.0, ended=30.0), churn.Life("node-1", None, 20.0, ended=30.0)]
    steady = churn._steady(records, {2: "s2", 3: "s3"}, lives, end=30.0)
    assert steady["goodput"] == 0.6 and steady["samples_per_s"] == 24.0  # (4 + 4 + 4) / 20; 32 + 32 + 32 over 4 s
