"""The recovery rules (`composer_diloco.outer.recovery`) as plain functions of the heartbeats: tables of cases, no DHT,
no peer, no tensor. The rules import no hivemind, no torch and no peer (the last test). The multi-process fault tests (test_faults, test_split_heal, test_group_split, test_run_end)
check that `DiLoCoPeer` carries the decisions out."""

from __future__ import annotations

import pytest

from composer_diloco.outer import recovery
from composer_diloco.outer.recovery import Proceed, Resync, StepAlone, Wait
from composer_diloco.outer.peer_records import PeerRecord

R = 4  # the round that failed in these cases


def rec(name: str, round_: int, *, sha: str = "", settled: bool = True, lineage: dict | None = None) -> PeerRecord:
    return PeerRecord(name, "coordinator" if name == "coordinator" else "node", round_, 0.0, sha=sha,
                      settled=settled, lineage=dict(lineage or {}))


def names(decision) -> tuple[str, ...]:
    return tuple(p.name for p in decision.candidates)


# -- after_failed_round ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("me, others, late, expected", [
    ("node-0", [], False, StepAlone()),                                                    # the whole swarm
    ("node-0", [rec("node-1", R - 1)], False, StepAlone()),                                # only peers behind
    ("coordinator", [rec("node-0", R)], False, StepAlone()),                               # first of those left in R
    ("node-0", [rec("node-1", R)], False, StepAlone()),
    ("node-1", [rec("node-0", R)], False, Wait("node-0")),                                 # node-0 steps first
    ("node-1", [rec("coordinator", R), rec("node-0", R)], False, Wait("coordinator")),
    ("node-1", [rec("node-0", R + 1, sha="a")], False, ("node-0",)),                       # a peer ahead: its state
    ("node-1", [rec("node-0", R + 1, sha="a"), rec("node-2", R + 2, sha="b")], False, ("node-2",)),  # the newest
    ("node-1", [rec("node-2", R + 1, sha="a"), rec("coordinator", R + 1, sha="b")], False, ("coordinator", "node-2")),
    ("node-1", [rec("coordinator", R + 1, sha="b", settled=False), rec("node-2", R + 1, sha="a")], False,
     ("node-2", "coordinator")),                                                           # settled ones first
    ("node-1", [rec("node-0", R + 1, sha="a", settled=False)], False, Wait("node-0")),     # still settling
    ("node-1", [rec("node-0", R + 1, sha="a", settled=False)], True, ("node-0",)),         # late: take it anyway
])
def test_after_failed_round(me, others, late, expected):
    role = "coordinator" if me == "coordinator" else "node"
    decision = recovery.after_failed_round(role, me, R, others, late=late)
    if isinstance(expected, tuple):
        assert isinstance(decision, Resync) and decision.min_round == R + 1 and names(decision) == expected, decision
    else:
        assert decision == expected


# -- split_check ----------------------------------------------------------------------------------------------------
OURS = {2: "aa", 3: "bb"}


@pytest.mark.parametrize("me, others, expected", [
    ("node-1", [], Proceed()),
    ("node-1", [rec("coordinator", 4, sha="cc", lineage={2: "aa", 3: "bb"})], Proceed()),        # one lineage
    ("node-1", [rec("coordinator", 9, sha="cc", lineage={7: "x", 8: "y"})], Proceed()),         # nothing in common
    ("node-1", [rec("coordinator", 4, sha="cc", lineage={2: "aa", 3: "zz"})], ("coordinator",)),  # parted at 3
    ("node-1", [rec("coordinator", 3, sha="zz", lineage={2: "aa"})], ("coordinator",)),          # its settled round
    ("node-1", [rec("coordinator", 3, sha="zz", settled=False, lineage={2: "aa"})], Proceed()),  # not yet settled
    ("node-1", [rec("node-0", 4, lineage={3: "zz"}), rec("node-2", 4, lineage={3: "bb"})], ("node-0",)),  # lowest name
    ("node-2", [rec("node-0", 4, lineage={3: "bb"}), rec("node-1", 4, lineage={3: "zz"})], Proceed()),  # node-1 is no
    # authority: a peer only follows the first live peer
    ("coordinator", [rec("node-0", 4, lineage={3: "zz"}), rec("node-1", 4, lineage={3: "bb"})],
     Proceed(diverged=(("node-0", 3, "zz", "bb"),))),                                            # the authority logs
])
def test_split_check(me, others, expected):
    role = "coordinator" if me == "coordinator" else "node"
    decision = recovery.split_check(role, me, OURS, others)
    if isinstance(expected, tuple):
        assert isinstance(decision, Resync) and decision.min_round == 0 and names(decision) == expected, decision
    else:
        assert decision == expected


# -- after_group_split ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("me, members, others, expected", [
    ("node-1", ["node-1", "node-2"], [], Proceed()),
    ("node-1", ["coordinator", "node-1"], [rec("coordinator", R + 1, sha="xx")], Proceed()),  # authority in our group
    ("coordinator", ["coordinator"], [rec("node-0", R + 1, sha="xx")], Proceed()),           # we are the authority
    ("node-1", ["node-1", "node-2"], [rec("coordinator", R + 2, sha="xx")], Proceed()),       # it moved on
    ("node-1", ["node-1", "node-2"], [rec("coordinator", R + 1, sha="ours")], Proceed()),     # the same theta
    ("node-1", ["node-1", "node-2"], [rec("coordinator", R + 1, sha="xx")], ("coordinator",)),  # forked: take it
    ("node-1", ["node-1", "node-2"], [rec("coordinator", R)], Wait("coordinator")),            # still averaging
    ("node-1", ["node-1", "node-2"], [rec("coordinator", R + 1, sha="xx", settled=False)], Wait("coordinator")),
    ("node-2", ["node-1", "node-2"], [rec("node-0", R + 1, sha="xx"), rec("node-1", R + 1, sha="ours")], ("node-0",)),
])
def test_after_group_split(me, members, others, expected):
    role = "coordinator" if me == "coordinator" else "node"
    decision = recovery.after_group_split(role, me, R, members, "ours", others)
    if isinstance(expected, tuple):
        assert isinstance(decision, Resync) and decision.min_round == R + 1 and names(decision) == expected, decision
    else:
        assert decision == expected


# -- after_theta_rejected -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("others, expected", [
    ([], Proceed()),                                                                         # the authority is gone
    ([rec("coordinator", R + 2, sha="xx")], Proceed()),                                      # it moved on: split_check
    ([rec("coordinator", R + 1, sha="ours")], Proceed()),                                    # the same theta after all
    ([rec("coordinator", R + 1, sha="xx")], ("coordinator",)),                               # take its theta
    ([rec("node-0", R + 1, sha="yy"), rec("coordinator", R + 1, sha="xx")], ("coordinator",)),  # the group's, by name
    ([rec("coordinator", R)], Wait("coordinator")),                                          # still stepping
    ([rec("coordinator", R + 1, sha="xx", settled=False)], Wait("coordinator")),             # settling its own
])
def test_after_theta_rejected(others, expected):
    decision = recovery.after_theta_rejected(R, "coordinator", "ours", others)
    if isinstance(expected, tuple):
        assert isinstance(decision, Resync) and decision.min_round == R + 1 and names(decision) == expected, decision
    else:
        assert decision == expected


# -- settle_pick ----------------------------------------------------------------------------------------------------
MEMBERS = {"coordinator", "node-0", "node-1"}


@pytest.mark.parametrize("me, live, timed_out, expected", [
    # a member still in the all-reduce (settled at round R): wait for it, unless the wait is over
    ("node-1", [rec("node-0", R)], False, Wait("node-0")),
    ("node-1", [rec("node-0", R)], True, ()),                                                 # nobody done: keep ours
    # a settled member done: the first by precedence whose theta differs
    ("node-1", [rec("node-0", R + 1, sha="full")], False, ("node-0",)),
    ("node-0", [rec("node-1", R + 1, sha="full")], False, ("node-1",)),                       # settled beats names
    ("node-0", [rec("coordinator", R + 1, sha="ours", settled=False), rec("node-1", R)], False, Wait("node-1")),
    # every member done, none settled: the coordinator first, then by name; one with our theta ends the search
    ("node-1", [rec("coordinator", R + 1, sha="c", settled=False), rec("node-0", R + 1, sha="z", settled=False)],
     False, ("coordinator", "node-0")),
    ("node-1", [rec("coordinator", R + 1, sha="ours", settled=False), rec("node-0", R + 1, sha="z", settled=False)],
     False, ()),
    ("coordinator", [rec("node-0", R + 1, sha="z", settled=False)], False, ()),              # we come first
    ("node-1", [rec("node-2", R + 1, sha="full")], False, ()),                                # not of our group
    ("node-1", [rec("node-0", R, settled=False)], False, ()),                                 # it waits for us
])
def test_settle_pick(me, live, timed_out, expected):
    role = "coordinator" if me == "coordinator" else "node"
    decision = recovery.settle_pick(role, me, MEMBERS, R, "ours", [rec(me, R + 1, sha="ours", settled=False), *live],
                                    timed_out=timed_out)
    if isinstance(expected, tuple):
        assert isinstance(decision, Resync) and decision.min_round == R + 1 and names(decision) == expected, decision
    else:
        assert decision == expected


def test_settle_pick_does_not_wait_for_a_new_life_of_a_member():
    """node-0 died in the all-reduce that began at DHT time 100 and its standby (or a restart) is back under its name,
    in round R since 101: that life took no part, so it is not waited for; a node-0 in round R since before the
    all-reduce (the one that took part, still in it) is."""
    me = [rec("node-1", R + 1, sha="ours", settled=False)]
    back = PeerRecord("node-0", "node", R, 0.0, since=101.0)
    assert recovery.settle_pick("node", "node-1", MEMBERS, R, "ours", [*me, back], timed_out=False,
                                began=100.0) == Resync((), R + 1)
    there = PeerRecord("node-0", "node", R, 0.0, since=90.0)
    assert recovery.settle_pick("node", "node-1", MEMBERS, R, "ours", [*me, there], timed_out=False,
                                began=100.0) == Wait("node-0")


# -- the run's end and joining --------------------------------------------------------------------------------------
def test_waiting_at_run_end():
    live = [rec("coordinator", 10), rec("node-0", 9), rec("node-1", 10, settled=False), rec("node-2", 10)]
    assert recovery.waiting_at_run_end("coordinator", 10, live) == ["node-0", "node-1"]
    assert recovery.waiting_at_run_end("node-0", 10, live) == ["node-1"]  # never itself
    assert recovery.waiting_at_run_end("node-2", 10, [rec("coordinator", 10)]) == []


@pytest.mark.parametrize("live, over", [
    ([rec("coordinator", 3), rec("node-0", 3)], False),    # a node still trains round 3
    ([rec("coordinator", 3), rec("node-0", 4)], True),     # a peer is past it
    ([rec("coordinator", 3)], True),                       # no node left in it: nothing to wait for
    ([rec("node-0", 2)], True),
    ([], True),
])
def test_round_over(live, over):
    assert recovery.round_over(3, live) is over


def test_recovery_imports_no_peer_and_no_hivemind():
    """The rules are functions of records: the module imports neither the peer (no circle) nor hivemind nor torch."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(recovery.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "itertools", "dataclasses", "composer_diloco.outer.peer_records"}, imported
