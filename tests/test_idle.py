"""Runs that cannot go on or cannot learn say so: a coordinator with no node alive (`IdleWatch`, ``--max-idle``),
and a node whose episodes never produced a parsed tool call (`ToolCallTally`)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from composer_diloco.rollout.episodes import Episode, Turn
from composer_diloco.outer.swarm import PeerRecord
from local_run import LocalRun, write_config

CALL = {"name": "submit", "arguments": {"answer": "4"}}


def episode(i: int, *calls: dict | None) -> Episode:
    """An episode whose assistant turns carry ``calls`` (None: a turn that did not parse as a tool call)."""
    turns = [Turn("user", "q")]
    for call in calls:
        turns.append(Turn("assistant", "...", call))
        if call is not None:
            turns.append(Turn("tool", "ok"))
    return Episode(0, f"e{i}", turns, [], [])


def round_stats(*episodes: Episode):
    from composer_diloco.channels.base import registered_channels
    from composer_diloco.inner.step import RoundStats

    stats = RoundStats(registered_channels(), episodes_per_step=2)
    stats.add_episodes(episodes)
    return stats


# -------------------------------------------------------------------------- a node's episodes without a tool call


def test_round_stats_counts_episodes_without_a_parsed_tool_call():
    stats = round_stats(episode(0, None), episode(1, None, CALL), episode(2), episode(3, CALL, CALL))
    assert [e.tool_calls for e in stats.episodes] == [0, 1, 0, 2]
    assert stats.episodes_without_tool_call == 2 and not stats.no_tool_call
    assert stats.record()["episodes_without_tool_call"] == 2
    assert round_stats(episode(0, None), episode(1)).no_tool_call
    assert not round_stats().no_tool_call  # no episode played: nothing to warn about


def test_a_run_without_any_tool_call_is_refused_at_its_end_and_warned_each_round(caplog):
    from nodes.node import ToolCallTally, TrainedOnNothing

    empty, some = round_stats(episode(0, None), episode(1)), round_stats(episode(0, None), episode(1, CALL))
    tally = ToolCallTally()
    with caplog.at_level(logging.WARNING):
        tally.add(empty, 0, "node-0")
        tally.add(empty, 1, "node-0")
    assert [r.getMessage() for r in caplog.records if "NO TOOL CALL" in r.getMessage()] == [
        f"node-0 round {r}: NO TOOL CALL in any of the 2 episodes: the policy's turns never parsed as a tool call, "
        "so this round trains on nothing (check the chat template / tools / --model)" for r in (0, 1)]
    with pytest.raises(TrainedOnNothing, match=r"^trained on nothing: no episode of 2 round\(s\) produced a parsed "
                                               r"tool call; .*check the chat template / tools / --model$"):
        tally.check()

    late = ToolCallTally()  # a model that needed a round to emit its first call: warned, not refused
    late.add(empty, 0, "node-0")
    late.add(some, 1, "node-0")
    late.check()
    ToolCallTally().check()  # no round played (joined a finished run): nothing to refuse


def test_the_table_rows_name_the_rounds_without_any_tool_call():
    from composer_diloco.metrics import format_table, no_tool_call_rounds, round_table

    def line(rnd: int, peer: str, without: int | None) -> dict:
        out = {"round": rnd, "peer": peer, "role": "node", "samples": 4, "global_sha256": "a"}
        return out if without is None else {**out, "episodes_without_tool_call": without}

    metrics = {"node-0": [line(0, "node-0", 4), line(1, "node-0", 4), line(2, "node-0", None)],
               "node-1": [line(0, "node-1", 4), line(1, "node-1", 3), line(2, "node-1", None)]}
    rows = round_table(metrics)
    assert no_tool_call_rounds(rows) == [0]  # round 1 had one call; round 2 is a run dir from before the key
    old = {name: [{k: v for k, v in r.items() if k != "episodes_without_tool_call"} for r in recs]
           for name, recs in metrics.items()}
    assert format_table(rows) == format_table(round_table(old))  # the table itself is unchanged


def test_the_table_judges_agreement_on_the_theta_each_peer_ended_the_round_on():
    """Recorded at N = 8 (bench/learning.py, grpo-avg-N8-H64 seed 1, 2026-11-25): round 0's matchmaking split the 9
    peers into three all-reduce groups; at the next sync the nodes outside the coordinator's group took its theta
    (`heal_split`), each appending a "resynced" record of round 0. The run ended on one theta: not a disagreement."""
    from composer_diloco.metrics import round_table

    def line(rnd: int, role: str, sha: str, status: str = "averaged") -> dict:
        return {"round": rnd, "role": role, "samples": 0 if role == "coordinator" else 4, "global_sha256": sha,
                "status": status}

    healed = {"coordinator": [line(0, "coordinator", "C"), line(1, "coordinator", "D")],
              "node-6": [line(0, "node", "C"), line(1, "node", "D")],
              "node-0": [line(0, "node", "X"), line(0, "node", "C", "resynced"), line(1, "node", "D")],
              "node-3": [line(0, "node", "Y"), line(0, "node", "C", "resynced"), line(1, "node", "D")]}
    rows = round_table(healed)
    assert [(r["round"], r["sha_agree"], r["healed"]) for r in rows] == [(0, True, ["node-0", "node-3"]),
                                                                        (1, True, [])]
    assert rows[0]["samples"] == 4 * 5  # the dropped inner phase's episodes were played: they stay counted

    unhealed = {**healed, "node-3": [line(0, "node", "Y"), line(1, "node", "E")]}  # never took the theta
    assert [(r["sha_agree"], r["healed"]) for r in round_table(unhealed)] == [(False, ["node-0"]), (False, [])]
    stuck = {**healed, "node-3": [line(0, "node", "C"), line(0, "node", "Y", "unsettled")]}  # ended on another
    assert round_table(stuck)[0]["sha_agree"] is False


def test_the_benches_strict_agreement_counts_a_healed_split_and_nothing_recorded_as_disagreement():
    """`replicas_agree` (bench/churn.py, kill_in_allreduce.py, compression.py, gpu.py) counts every record, a healed
    peer's superseded one too: a split that healed a round later is still reported; no round at all is not agreement."""
    from composer_diloco.metrics import replicas_agree, thetas_by_round

    one = {"coordinator": [{"round": 0, "global_sha256": "C"}, {"round": 1, "global_sha256": "D"}],
           "node-0": [{"round": 0, "global_sha256": "C"}, {"round": 1, "global_sha256": "D"}]}
    assert replicas_agree(one) and thetas_by_round(one) == {0: {"C"}, 1: {"D"}}
    healed = {**one, "node-1": [{"round": 0, "global_sha256": "X"}, {"round": 0, "global_sha256": "C"}]}
    assert not replicas_agree(healed) and thetas_by_round(healed)[0] == {"C", "X"}
    assert not replicas_agree({}) and not replicas_agree({"node-0": []})


# -------------------------------------------------------------------------- a coordinator with no node alive


class FakeSwarm:
    def __init__(self):
        self.peers = [PeerRecord("coordinator", "coordinator", 3, 0.0)]

    def live_peers(self):
        return list(self.peers)


def test_idle_watch_logs_what_it_waits_for_then_gives_up(caplog):
    from coordinator.coordinator import IdleWatch

    swarm, stop = FakeSwarm(), threading.Event()
    swarm.peers.append(PeerRecord("node-1", "node", 3, 0.0))
    with caplog.at_level(logging.WARNING):
        watch = IdleWatch(swarm, lambda: 3, stop, max_idle_s=0.6, idle_log_s=0.2, poll_s=0.02).start()
        try:
            time.sleep(0.3)
            assert not stop.is_set() and not caplog.records  # a node is alive: silent
            swarm.peers.pop()  # the node died
            assert stop.wait(5), "the watch did not give up"
        finally:
            watch.close()
    assert watch.error.startswith("no node alive for 0.6 s since round 3: live peers coordinator; last seen: "
                                  "node-1 at round 3; restart the nodes")
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for nodes")]
    assert waiting and waiting[0].startswith("waiting for nodes at round 3: no node alive for "), waiting
    assert waiting[0].endswith("s (live peers: coordinator; last seen: node-1 at round 3); giving up after 0.6 s")


def test_idle_watch_without_max_idle_waits_forever():
    from coordinator.coordinator import IdleWatch

    stop = threading.Event()
    watch = IdleWatch(FakeSwarm(), lambda: 0, stop, max_idle_s=None, idle_log_s=0.05, poll_s=0.02).start()
    time.sleep(0.3)
    watch.close()
    assert not stop.is_set() and watch.error is None


IDLE_CONFIG = """
rounds = 2
inner_steps = 2
[warmstart]
steps = 0
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_coordinator_with_max_idle_and_no_node_exits_with_one_line(tmp_path):
    """``--max-idle 5`` with no node at all: the waiting line, then exit 1 with the reason, ~5 s after the peer
    line (no warm start: the test needs no trained policy)."""
    run = LocalRun(tmp_path / "run", write_config(tmp_path / "idle.toml", IDLE_CONFIG))
    try:
        run.start_coordinator("--max-idle", "5", "--idle-log", "2")
        started = time.monotonic()
        code = run.wait_exit("coordinator", timeout_s=60)
        took_s = time.monotonic() - started
    finally:
        run.stop()
    log = run.log("coordinator")
    print(f"\nthe coordinator exited {took_s:.1f} s after its peer line")
    assert code == 1, log[-2000:]
    assert "waiting for nodes at round 0: no node alive for" in log, log[-2000:]
    assert ("composer-coordinator: error: no node alive for 5 s since round 0: live peers coordinator; no node was "
            "seen yet; restart the nodes") in log, log[-2000:]
    assert took_s < 15, took_s
    assert "Traceback" not in log
