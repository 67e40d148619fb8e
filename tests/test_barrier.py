"""The round barrier (`Swarm.wait_for_round`) stops waiting for a peer that died, without waiting out its heartbeat's
TTL, still waits for a live peer whose heartbeats are late, and waits for a node that announced it is setting up to
join the round (`Swarm.announce_joining`) before its first heartbeat, and for a live peer whose heartbeat a DHT read
missed.

Two real DHT peers on 127.0.0.1 with their heartbeats (1 s period, a 60 s TTL, the barrier's slack 60 s). node-a is
ready for round 0; node-b, live at round 0, is not. Killed (its DHT and p2pd shut down: the dial is refused), node-b
is pinged once its heartbeat is late and given up at once. Silent but alive (its heartbeat thread stopped, its DHT
answering), it is waited for: the barrier ends only when its record expires.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from composer_diloco.diloco import DiLoCoRounds
from composer_diloco.outer.swarm import PeerRecord, Swarm, joins_round, start_dht, visible_multiaddr

PERIOD_S, TTL_S, SLACK_S = 1.0, 60.0, 60.0


def _pair(ttl_s: float) -> tuple[Swarm, Swarm]:
    a_dht = start_dht(initial_peers=[])
    b_dht = start_dht(initial_peers=[visible_multiaddr(a_dht)])
    swarms = tuple(Swarm(d, run_name="barrier", peer_name=n, role="node") for d, n in ((a_dht, "node-a"),
                                                                                       (b_dht, "node-b")))
    for s in swarms:
        s.set_round(0)
        s.start_heartbeat(PERIOD_S, ttl_s)
    a = swarms[0]
    deadline = time.monotonic() + 30
    while {p.name for p in a.live_peers()} != {"node-a", "node-b"}:  # each sees the other's heartbeat
        assert time.monotonic() < deadline, a.live_peers()
        time.sleep(0.2)
    return swarms


def _close(*swarms: Swarm) -> None:
    for s in swarms:
        s.close()
        s.dht.shutdown()


def _wait_after(ttl_s: float, *, kill: bool) -> tuple[tuple[float, list[str]] | None, float]:
    """node-b stops its heartbeats (and, ``kill``, its DHT); node-a, ready for round 0, waits at the barrier.
    Returns the barrier's result and the seconds node-a waited."""
    a, b = _pair(ttl_s)
    try:
        b.close()
        if kill:
            b.dht.shutdown()
        a.announce_ready(0, 1.0)
        started = time.monotonic()
        result = a.wait_for_round(0, slack_s=SLACK_S, matchmaking_s=0.0)
        return result, time.monotonic() - started
    finally:
        _close(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_barrier_gives_up_a_dead_peer_at_once_and_waits_for_a_silent_live_one(caplog):
    caplog.set_level(logging.INFO, logger="composer_diloco.outer.swarm")
    result, waited = _wait_after(TTL_S, kill=True)  # killed: no more heartbeats, and its p2pd is gone
    assert result is not None and result[1] == ["node-a"], result
    assert waited < TTL_S / 2, waited  # without the ping it waits for node-b's record to expire (60 s)
    assert "not waiting for node-b: its heartbeat is" in caplog.text, caplog.text

    caplog.clear()
    result, waited = _wait_after(6.0, kill=False)  # alive (its DHT answers pings) but silent
    assert result is not None and result[1] == ["node-a"], result
    assert "not waiting for node-b" not in caplog.text, caplog.text
    assert waited > 6.0 - 2 * PERIOD_S, waited  # its last heartbeat's TTL ran out first


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_barrier_waits_for_a_live_peer_whose_heartbeat_a_read_missed(monkeypatch):
    """node-a read node-b's heartbeat once; from then on its DHT reads miss it (as reads under load did in a churn
    run: the barrier went on without a live node in its inner phase and the round split into two groups). node-b's
    record is still within its TTL and node-b answers a dial: node-a waits for it, and both average."""
    a, b = _pair(TTL_S)
    try:
        reads = a._records

        def missing_b(key: str, required: set[str]) -> dict[str, dict]:
            found = reads(key, required)
            return {n: v for n, v in found.items() if not (key == "peers" and n == "node-b")}

        monkeypatch.setattr(a, "_records", missing_b)
        assert {p.name for p in a.live_peers()} == {"node-a"}
        a.announce_ready(0, 1.0)
        done: list = []
        waiter = threading.Thread(target=lambda: done.append(a.wait_for_round(0, slack_s=SLACK_S, matchmaking_s=0.0)))
        waiter.start()
        time.sleep(3 * PERIOD_S)  # node-b's record read before is late by now: pinged, and it answers
        assert not done, done  # before: node-a went on alone at once
        b.announce_ready(0, 1.0)
        waiter.join(timeout=30)
        assert done and done[0] is not None and done[0][1] == ["node-a", "node-b"], done
    finally:
        _close(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_barrier_waits_for_a_node_still_setting_up_to_join_its_round():
    a_dht = start_dht(initial_peers=[])
    b_dht = start_dht(initial_peers=[visible_multiaddr(a_dht)])
    a = Swarm(a_dht, run_name="barrier", peer_name="node-a", role="node")
    b = Swarm(b_dht, run_name="barrier", peer_name="node-b", role="node")
    c = Swarm(b_dht, run_name="barrier", peer_name="node-c", role="node")
    try:
        a.set_round(0)
        a.start_heartbeat(PERIOD_S, TTL_S)
        # node-a trains round 0 since a moment; with no grace node-b would join at round 1 and not hold round 0 up
        assert c.announce_joining(PERIOD_S, 3 * PERIOD_S, join_grace_s=0.0) == 1
        assert b.announce_joining(PERIOD_S, 3 * PERIOD_S, join_grace_s=30.0) == 0
        a.announce_ready(0, 1.0)
        done: list = []
        waiter = threading.Thread(target=lambda: done.append(a.wait_for_round(0, slack_s=SLACK_S, matchmaking_s=0.0)))
        waiter.start()
        time.sleep(4 * PERIOD_S)  # node-b's joining record outlives its 3 s TTL only by being renewed
        assert not done, done  # without the joining record, node-a went on alone at once (CI's lost round 0)
        b.set_round(0)
        b.start_heartbeat(PERIOD_S, TTL_S)
        b.announce_ready(0, 1.0)
        waiter.join(timeout=30)
        assert done and done[0] is not None and done[0][1] == ["node-a", "node-b"], done
    finally:
        c.close()
        _close(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_late_joiner_ends_its_first_inner_phase_once_another_node_of_its_round_is_ready():
    """A node that announces its join while other nodes train a round past the run's first (a restart, a standby's
    takeover) is `joined_late`, and its first inner phase catches up: it ends at the first step after another node
    announced the round ready (not the coordinator, not itself), instead of holding that node at the barrier for H
    whole steps. A node that announced before any node's heartbeat, or while they trained round 0 (nodes launched
    together), is not late: its rounds keep H steps, unless ``[network] round_ends_at_first_ready`` ends every phase so."""
    a_dht = start_dht(initial_peers=[])
    b_dht = start_dht(initial_peers=[visible_multiaddr(a_dht)])
    a = Swarm(a_dht, run_name="catchup", peer_name="node-a", role="node")
    together = Swarm(b_dht, run_name="catchup", peer_name="node-together", role="node")
    late = Swarm(b_dht, run_name="catchup", peer_name="node-late", role="node")
    coordinator = Swarm(a_dht, run_name="catchup", peer_name="coordinator", role="coordinator")
    stop = threading.Event()
    try:
        together.announce_joining(PERIOD_S, 3 * PERIOD_S, join_grace_s=30.0)
        assert not together.joined_late
        a.set_round(0)
        a.start_heartbeat(PERIOD_S, TTL_S)
        deadline = time.monotonic() + 30
        while "node-a" not in {p.name for p in late.live_peers()}:
            assert time.monotonic() < deadline, late.live_peers()
            time.sleep(0.2)
        assert late.announce_joining(PERIOD_S, 3 * PERIOD_S, join_grace_s=30.0) == 0 and not late.joined_late
        a.set_round(1)  # node-a trains round 1 now: a node announcing itself is late
        deadline = time.monotonic() + 30
        while {p.round for p in late.live_peers() if p.name == "node-a"} != {1}:
            assert time.monotonic() < deadline, late.live_peers()
            time.sleep(0.2)
        assert late.announce_joining(PERIOD_S, 3 * PERIOD_S, join_grace_s=30.0) == 1 and late.joined_late

        def rounds(swarm: Swarm, catch_up: bool, at_first_ready: bool = False,
                   in_flight: int | None = None) -> DiLoCoRounds:
            net = type("Net", (), {"round_budget_s": None, "round_ends_at_first_ready": at_first_ready})()
            config = type("Config", (), {"inner_steps": 4, "rounds": 3, "network": net})()
            peer = type("Peer", (), {"swarm": swarm, "round": 1, "config": config})()
            # [outer] overlap with round `in_flight` syncing in the background (the peer's round moves on when it lands)
            overlap = None if in_flight is None else type("Overlap", (), {"in_flight": in_flight})()
            return DiLoCoRounds(peer, stop, host=None, clock=None, overlap=overlap, catch_up=catch_up)

        catching, keeping = rounds(late, late.joined_late), rounds(together, together.joined_late)
        # [network] round_ends_at_first_ready: a phase that is no catch-up ends so too (node-late's swarm, so that
        # its own ready record below is not another node's)
        first_ready = rounds(late, False, at_first_ready=True)
        # ... with round 1 in flight, the phase trains round 2: round 1's ready records are not its round's
        overlapped = rounds(late, False, at_first_ready=True, in_flight=1)
        assert overlapped.training_round() == 2 and first_ready.training_round() == 1
        coordinator.announce_ready(1, 0.0)
        late.announce_ready(1, 1.0)  # its own record does not end its phase
        a.announce_ready(0, 1.0)  # nor another round's
        time.sleep(1.0)
        assert not catching.caught_up() and not keeping.caught_up() and not first_ready.caught_up()
        a.announce_ready(1, 1.0)
        deadline = time.monotonic() + 30
        while not catching.caught_up():
            assert time.monotonic() < deadline, late.ready_peers(1)
            time.sleep(0.2)
        assert not keeping.caught_up()  # node-together trains its H steps
        assert first_ready.caught_up()  # unless every round ends at its first ready node
        assert not overlapped.caught_up()  # node-a's record of round 1, the round in flight: this phase trains on
    finally:
        for s in (together, late, coordinator):
            s.close()
        _close(a)
        b_dht.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_barrier_does_not_wait_for_a_late_joiners_set_up_only_for_its_inner_phase():
    """A node that joins a swarm past its first round (a standby's takeover) is not waited for while it sets up, by
    its joining record or by its heartbeat (its ``info`` says ``phase: "joining"``, ``joined_late``): under churn that
    wait held every other peer for the takeover's seconds (BENCHMARKS 3m). From its first inner phase
    (`Swarm.set_info` with ``phase="inner"``, stored at once) the barrier waits for it as for any node."""
    a, b = _pair(TTL_S)
    late = Swarm(b.dht, run_name="barrier", peer_name="node-late", role="node")
    try:
        for s in (a, b):
            s.set_round(2)  # the swarm trains round 2: a node announcing itself now is late
        deadline = time.monotonic() + 30
        while {p.round for p in late.live_peers() if p.name in ("node-a", "node-b")} != {2}:
            assert time.monotonic() < deadline, late.live_peers()
            time.sleep(0.2)
        late.set_info(phase="joining")  # as `Node` does before it announces itself
        assert late.announce_joining(PERIOD_S, 3 * PERIOD_S, join_grace_s=30.0) == 2 and late.joined_late
        a.announce_ready(2, 1.0)
        b.announce_ready(2, 1.0)
        started = time.monotonic()
        result = a.wait_for_round(2, slack_s=SLACK_S, matchmaking_s=0.0)
        assert result is not None and result[1] == ["node-a", "node-b"], result
        late.set_round(2)
        late.start_heartbeat(PERIOD_S, TTL_S)  # its state is loaded: it beats, still setting up
        deadline = time.monotonic() + 30
        while not any(p.name == "node-late" for p in a.live_peers()):
            assert time.monotonic() < deadline, a.live_peers()
            time.sleep(0.2)
        result = a.wait_for_round(2, slack_s=SLACK_S, matchmaking_s=0.0)
        assert result is not None and result[1] == ["node-a", "node-b"], result
        assert time.monotonic() - started < 10, "the barrier waited for a late joiner's set-up"
        late.set_info(phase="inner")  # its first inner phase: from now on it is waited for
        deadline = time.monotonic() + 30
        while not any(p.name == "node-late" and p.info.get("phase") == "inner" for p in a.live_peers()):
            assert time.monotonic() < deadline, a.live_peers()
            time.sleep(0.2)
        done: list = []
        waiter = threading.Thread(target=lambda: done.append(a.wait_for_round(2, slack_s=SLACK_S, matchmaking_s=0.0)))
        waiter.start()
        time.sleep(3 * PERIOD_S)
        assert not done, done
        late.announce_ready(2, 1.0)
        waiter.join(timeout=30)
        assert done and done[0] is not None and done[0][1] == ["node-a", "node-b", "node-late"], done
    finally:
        late.close()
        _close(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_dead_lifes_heartbeat_is_not_waited_for_once_its_name_set_up_again():
    """A standby takes a killed node over under its name and peer ID: the dead life's last heartbeat still looks live
    until its TTL, and a dial of its multiaddr reaches the new life (here: node-b's heartbeats stop, its DHT answers).
    Once the name announced itself again (`Swarm.announce_joining`, newer than that heartbeat) the barrier does not
    wait for it (`superseded`); under churn it waited the TTL, 10-12 s, at every kill (BENCHMARKS 3m)."""
    a, b = _pair(TTL_S)
    again = Swarm(b.dht, run_name="barrier", peer_name="node-b", role="node")
    try:
        for s in (a, b):
            s.set_round(2)
        deadline = time.monotonic() + 30
        while {p.round for p in a.live_peers()} != {2}:
            assert time.monotonic() < deadline, a.live_peers()
            time.sleep(0.2)
        b.close()  # node-b's life ends: no more heartbeats; its peer ID still answers (the new life's p2pd)
        again.set_info(phase="joining")
        assert again.announce_joining(PERIOD_S, 3 * PERIOD_S, join_grace_s=30.0) == 2 and again.joined_late
        a.announce_ready(2, 1.0)
        started = time.monotonic()
        result = a.wait_for_round(2, slack_s=SLACK_S, matchmaking_s=0.0)
        assert result is not None and result[1] == ["node-a"], result
        assert time.monotonic() - started < 15, "the barrier waited for a dead life's heartbeat"
    finally:
        again.close()
        _close(a, b)


def test_a_late_joiner_is_setting_up_until_its_first_inner_phase():
    """`setting_up_late`: a node record whose ``info`` says ``phase: "joining"`` and ``joined_late``; not a node
    launched with the run (no ``joined_late``), not one in its inner phase, not the coordinator."""
    from composer_diloco.outer.peer_records import setting_up_late

    def record(role: str = "node", **info) -> PeerRecord:
        return PeerRecord("x", role, 3, 0.0, info=info)

    assert setting_up_late(record(phase="joining", joined_late=True))
    assert not setting_up_late(record(phase="joining"))
    assert not setting_up_late(record(phase="inner", joined_late=True))
    assert not setting_up_late(record("coordinator", phase="joining", joined_late=True))


def test_a_heartbeat_older_than_its_names_joining_record_is_superseded():
    """`superseded`: a node's heartbeat older than the joining record of its name is a life that ended; a newer one
    (the life's first heartbeat came after its joining record) is not, nor is a name with no joining record."""
    from composer_diloco.outer.peer_records import superseded

    beat = PeerRecord("node-b", "node", 2, 10.0)
    assert superseded(beat, {"node-b": PeerRecord("node-b", "node", 2, 12.0)})
    assert not superseded(beat, {"node-b": PeerRecord("node-b", "node", 2, 9.0)})
    assert not superseded(beat, {"node-c": PeerRecord("node-c", "node", 2, 12.0)})


def test_a_caught_up_phase_is_not_a_deadline_hit():
    """`InnerPhase.record`: ``deadline_hit`` keeps meaning "the round budget (or a stop) cut the phase"; a late
    joiner's short first phase says ``caught_up`` instead, and a phase of H steps says neither."""
    from composer_diloco.diloco import InnerPhase
    from composer_diloco.inner.step import RoundStats

    def record(steps: int, caught_up: bool) -> dict:
        phase = InnerPhase(round=3, stats=RoundStats((), 8), steps=steps, seconds=1.0, parts={}, caught_up=caught_up)
        return phase.record(inner_steps=4)

    assert (record(2, caught_up=True)["deadline_hit"], record(2, caught_up=True)["caught_up"]) == (False, True)
    assert (record(2, caught_up=False)["deadline_hit"], record(2, caught_up=False)["caught_up"]) == (True, False)
    assert (record(4, caught_up=False)["deadline_hit"], record(4, caught_up=False)["caught_up"]) == (False, False)


def test_a_round_is_joinable_for_its_grace_after_its_first_node_entered_it():
    """`joins_round`, the one rule of `Swarm.announce_joining` and `DiLoCoPeer.join_at_round_boundary`: the age of a
    round is that of its first node in it; the coordinator's record and other rounds' nodes do not count."""
    peers = [PeerRecord("coordinator", "coordinator", 3, t=100.0, since=10.0),
             PeerRecord("a", "node", 3, t=100.0, since=95.0), PeerRecord("b", "node", 3, t=100.0, since=97.0),
             PeerRecord("c", "node", 2, t=100.0, since=50.0)]
    assert joins_round(peers, 3, join_grace_s=5.0, now=100.0)  # a entered 5 s ago: within the grace
    assert not joins_round(peers, 3, join_grace_s=4.9, now=100.0)
    assert joins_round(peers, 4, join_grace_s=0.0, now=100.0)  # no node in round 4 yet
    assert not joins_round(peers, 2, join_grace_s=10.0, now=100.0)
    assert joins_round([], 0, join_grace_s=0.0, now=0.0)


def test_a_round_whose_all_reduce_began_is_not_joined():
    """A group whose all-reduce began cannot take a member: a joiner (a standby taking over a node killed in that
    all-reduce) takes the next round however young the round is, once any peer, the coordinator included, published
    that it began averaging it (``info["averaging_round"]``); an older round's all-reduce, or a value that is not a
    round number, does not count."""
    def peer(name: str, role: str, round_: int, **info) -> PeerRecord:
        return PeerRecord(name, role, round_, t=100.0, since=99.0, info=info)

    assert joins_round([peer("a", "node", 3), peer("b", "node", 3)], 3, join_grace_s=30.0, now=100.0)
    assert not joins_round([peer("a", "node", 3, averaging_round=3), peer("b", "node", 3)], 3, join_grace_s=30.0,
                           now=100.0)
    assert not joins_round([peer("coordinator", "coordinator", 3, averaging_round=3), peer("a", "node", 3)], 3,
                           join_grace_s=30.0, now=100.0)
    assert joins_round([peer("a", "node", 3, averaging_round=2)], 3, join_grace_s=30.0, now=100.0)
    assert joins_round([peer("a", "node", 3, averaging_round="3")], 3, join_grace_s=30.0, now=100.0)
    assert joins_round([peer("a", "node", 3, averaging_round=3)], 4, join_grace_s=0.0, now=100.0)  # the next one
