"""What a peer does when a round fails it, and how a peer joins a swarm already underway.

`DiLoCoPeer.sync` raises `RoundFailed` from any of its steps and handles it in one place: `recover`. The rules
here are the same on every peer, so that replicas never fork.

Failure behaviour of `DiLoCoPeer.sync`:
- the all-reduce fails (no group within ``averaging_timeout_s``, a peer lost mid-way beyond repair), or the
  swarm finished the round without this peer (a late joiner): no outer step of its own; it takes the newest state
  of a live peer past its round (``load_state_from_peers``, the coordinator first). Of the peers stuck in the
  same round only the first (the coordinator, else the lowest name) steps alone; the rest take its state
  (`recover`). A peer with nobody in or past its round is the whole swarm and steps alone (`step_alone`);
- a contribution with NaN/Inf or an outlier norm: dropped by every peer of the group alike
  (`composer_diloco.outer.screening`, applied in the all-reduce, whose verdicts `sync` reads back); the round
  goes on with the rest, the drop is logged with the peer's name, and if nothing is left to average theta stays
  as it is for that round ("skipped");
- a peer lost in the middle of the all-reduce can leave the survivors with different averages (a reducer that
  returned its part to some peers and not to others). Peers that received every part hold identical bytes
  (`composer_diloco.outer.averaging`); a peer that missed a part publishes its theta as unsettled, and takes the
  state of the first settled member of its group (`settle`), so all replicas leave the round identical, whoever
  was lost, the coordinator included. Should no member with another theta send it (gone), the peer keeps its
  own, logs that the replicas disagree, and records the round "unsettled";
- a NaN/Inf mean pseudo-gradient all the same: the outer step is refused (ValueError from
  `GlobalModel.outer_step`), the round fails and the peer resynchronises as above.

- replicas that disagree (a partition of the DHT that let both halves go on, or two peers that stepped alone
  after timeouts): every peer publishes theta's hash at the start of each of its last rounds in its heartbeat
  (`Swarm.history`, `PeerRecord.lineage`) and, at the start of each sync, compares them with those of the run's
  authority: the coordinator, else the live node with the lowest name (`step_order`). A peer whose theta differs
  at a round both hold takes the authority's state before it averages again (`heal_split`); the authority logs
  each peer it finds diverged, and any state taken from a peer of another lineage is logged as a split.
- a round that matchmaking split into several all-reduce groups (each averaged apart, so theta forks at once): a
  peer whose group was smaller than the peers its barrier found, and lacked the authority, compares its new theta
  with the authority's as soon as that is published, and takes it before the next inner phase
  (`join_authority_after_split`), so no inner phase is trained on a forked theta.

The run's end: a peer that finished the last round keeps serving its state while a live peer may still need it
(`serve_until_settled`): behind the last round, or at its end with an unsettled theta.

Joining: `join_at_round_boundary` brings a new peer to the round the swarm is in before its first inner phase.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING

from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from composer_diloco.outer.swarm import PeerRecord, first_divergence, joins_round

if TYPE_CHECKING:
    from composer_diloco.outer.peer import DiLoCoPeer, SyncResult, SyncStatus, _RoundClock

log = logging.getLogger(__name__)


class RoundFailed(Exception):
    """This peer's round ended without an average it can apply; ``reason`` says why, in one line.

    Raised by the steps of `DiLoCoPeer.sync` (barrier, all-reduce, outer step) and handled only by `recover`.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def step_order(role: str, name: str) -> tuple[int, str]:
    """Which peer of a failed round steps alone first (the smallest): the coordinator, then by name."""
    return (0 if role == "coordinator" else 1, name)


def by_precedence(peers: list[PeerRecord]) -> list[PeerRecord]:
    """Whose theta the others of a round take, best first: settled peers first, then by `step_order`. The
    first that answers is taken (a peer that just died may still have a heartbeat)."""
    return sorted(peers, key=lambda p: (not p.settled, *step_order(p.role, p.name)))


def recover(peer: DiLoCoPeer, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult:
    """Round ``r`` ended without an average for this peer: take the state of a peer past round ``r``.

    One rule on every peer, so that replicas never fork: while a live peer is past round ``r``, download the
    newest state from the peers of the newest round, in `by_precedence` order (a settled one, the coordinator
    first among equals). While others are still in round ``r``, wait for them, at most ``peer.allreduce_timeout_s``;
    only the first of the peers left in round ``r`` (the coordinator, else the lowest name) applies its own
    pseudo-gradient at once, so the others have a state to take. A peer with nobody in or past its round is the
    whole swarm and steps alone.

    Returns:
        The round's `SyncResult`: status "resynced" (a peer's state was loaded, ``peers`` 0), else as `step_alone`.
    Raises:
        ArchitectureMismatch: from `DiLoCoPeer.load_state_from_peers`.
    """
    me = peer.swarm.name
    timeout_s = peer.allreduce_timeout_s  # the others may be in a long all-reduce
    deadline = time.monotonic() + timeout_s
    # unsettled while waiting for a state, so that a member settling its own theta (`settle`) does not wait for us
    peer.swarm.set_round(r, sha=peer.swarm.sha, settled=False)
    while time.monotonic() < deadline:
        others = [p for p in peer.swarm.live_peers() if p.name != me]
        ahead = [p for p in others if p.round > r]
        if ahead:
            newest = by_precedence([p for p in ahead if p.round == max(q.round for q in ahead)])
            # a peer still settling its theta may replace it: wait for a settled one, unless time runs out
            if (newest[0].settled or time.monotonic() > deadline - timeout_s / 3) and load_from_first(
                    peer, newest, min_round=r + 1):
                return peer._finish(model, clock, peers=0, status="resynced")
        else:
            in_round = [p for p in others if p.round == r]
            if not in_round or step_order(peer.swarm.role, me) < min(step_order(p.role, p.name) for p in in_round):
                break
        time.sleep(0.25)
    log.warning("%s round %d: no peer ahead of us; applying our own pseudo-gradient", me, r)
    return step_alone(peer, model, r, clock)


def step_alone(peer: DiLoCoPeer, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult:
    """Apply this peer's own pseudo-gradient (what the averager's buffers hold) and end round ``r``.

    Returns:
        A `SyncResult` with ``peers`` 1 and status "alone", or "skipped" when that pseudo-gradient is non-finite
        (theta unchanged; the round ends all the same).
    """
    status: SyncStatus = "alone"
    with peer._lock, peer.averager.get_tensors() as own:  # the buffers are the step's gradient (no copy)
        try:
            peer.global_model.outer_step(own)
        except ValueError as e:  # our own pseudo-gradient is non-finite: keep theta
            log.error("%s round %d: %s; theta unchanged", peer.swarm.name, r, e)
            status = "skipped"
        peer.round = r + 1
    return peer._finish(model, clock, peers=1, status=status)


def heal_split(peer: DiLoCoPeer, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult | None:
    """Before round ``r``'s sync: take the authority's state if this peer's theta left the run's lineage.

    The authority is the first live peer by `step_order` (the coordinator, else the lowest name); it keeps the
    canonical theta, so a run split in two heals toward the half that holds it. Its heartbeat carries theta's hash
    at the start of each of its last rounds (`PeerRecord.lineage`, its current round too when settled); this peer
    compares them with its own (`Swarm.history`) on the rounds both hold (`first_divergence`). None in common, or
    all equal: nothing to do (a peer merely behind is brought forward by `recover`). One differs: the replicas
    parted; this peer downloads the authority's state, whatever its round (the rounds trained since the split are
    dropped), and its history restarts there. The authority itself only logs the peers it finds diverged, once per
    peer and round.

    Returns:
        None when nothing was healed (the sync goes on), else the round's `SyncResult` with status "resynced".
    Raises:
        ArchitectureMismatch: from `DiLoCoPeer.load_state_from_peers`.
    """
    me, history = peer.swarm.name, peer.swarm.history
    others = [p for p in peer.swarm.live_peers() if p.name != me]
    if not others:
        return None
    authority = min(others, key=lambda p: step_order(p.role, p.name))
    if step_order(peer.swarm.role, me) < step_order(authority.role, authority.name):
        for p in others:  # we are the authority: the others take our theta; say whom we found diverged
            at = first_divergence(history, _lineage(p))
            if at is not None and (p.name, at) not in peer.diverged_seen:
                peer.diverged_seen.add((p.name, at))
                log.warning("%s round %d: replicas disagree: %s's theta at round %d is %s, ours was %s (a partition, "
                            "or peers that stepped alone); it takes our state at its next sync", me, r, p.name, at,
                            _lineage(p)[at][:12], history[at][:12])
        return None
    if first_divergence(history, _lineage(authority)) is None:
        return None
    if not load_from_first(peer, [authority], min_round=0):
        return None  # it did not answer: try again at the next sync
    return peer._finish(model, clock, peers=0, status="resynced")


def join_authority_after_split(peer: DiLoCoPeer, r: int, members: list[str]) -> bool:
    """Right after round ``r``'s outer step in an all-reduce group smaller than the barrier's peers: take the
    authority's theta if matchmaking split the round into groups that averaged apart.

    hivemind's matchmaking may form several groups out of one round's peers (seen with 9 peers on 2 busy cores: three
    groups), each stepping theta by its own mean, so the replicas part. `heal_split` would bring them back at the next
    sync, after a whole inner phase trained on a theta that is then dropped; here a peer whose group lacks the
    authority (the first live peer by `step_order`) waits for the authority to publish its theta of round ``r + 1``
    (at most ``peer.allreduce_timeout_s``) and, when it differs from ours, downloads it before training on. The
    pseudo-gradients of this peer's group are then lost for round ``r``, as in `heal_split`: the rule is the same on
    every peer, so the replicas agree again without a second all-reduce. This peer's own theta of round ``r + 1`` is
    published first (settled), so an authority that found no group at all takes it (`recover`) instead of stepping
    alone, and then holds the same theta.

    Args:
        r: the round whose outer step this peer just took and published (its theta is at round ``r + 1``).
        members: the names of this peer's all-reduce group, this peer included.
    Returns:
        True when the authority's state was loaded (the caller ends the round "resynced"); False when nothing was to
        heal (the authority is this peer or was in its group, holds the same theta, or moved on) or it did not
        answer in time (`heal_split` tries again at the next sync).
    Raises:
        ArchitectureMismatch: from `DiLoCoPeer.load_state_from_peers`.
    """
    me, ours, waited_for = peer.swarm.name, peer.global_model.sha256(), "the authority"
    deadline = time.monotonic() + peer.allreduce_timeout_s
    while time.monotonic() < deadline:
        others = [p for p in peer.swarm.live_peers() if p.name != me]
        if not others:
            return False
        authority = min(others, key=lambda p: step_order(p.role, p.name))
        waited_for = authority.name
        if authority.name in members or step_order(peer.swarm.role, me) < step_order(authority.role, authority.name):
            return False
        if authority.round > r + 1:
            return False  # it finished round r + 1 without us: `recover` takes its state at our barrier
        if authority.round == r + 1 and authority.settled and authority.sha:
            if authority.sha == ours:
                return False
            log.warning("%s round %d: matchmaking split the round: this peer averaged with %s only, and %s (the "
                        "run's authority) with others, so their thetas differ; taking its state (the pseudo-gradients "
                        "of this peer's group are dropped for this round)", me, r, ", ".join(sorted(members)),
                        authority.name)
            return load_from_first(peer, [authority], min_round=r + 1)
        time.sleep(0.25)
    log.warning("%s round %d: averaged in a group of %d, and %s did not publish its theta in %.0f s: checking again "
                "at the next sync", me, r, len(members), waited_for, peer.allreduce_timeout_s)
    return False


def _lineage(p: PeerRecord) -> dict[int, str]:
    """A peer's published hashes by round, its current round's included once settled."""
    return {**p.lineage, p.round: p.sha} if p.settled and p.sha else dict(p.lineage)


def settle(peer: DiLoCoPeer, members: set[str], r: int, missed: int) -> SyncStatus:
    """After an all-reduce of round ``r`` that missed ``missed`` elements: take one group member's theta.

    A reducer lost mid-way may have returned its part to some members and not to others, so theta can differ
    between them. This peer publishes its theta as unsettled and waits (at most ``peer.allreduce_timeout_s``) for
    a settled member, one that received every part, or for every live member to be done with round ``r``.
    Then all adopt the theta of the same member, the first by `by_precedence` that answers (settled ones
    first, then the coordinator, then by name); a peer that comes first keeps its own.

    Returns:
        "averaged" (this peer's theta was kept or already equal), "resynced" (the pick's state was downloaded), or
        "unsettled" (members hold another theta and none of them sent it: this peer keeps its own, which differs;
        logged as an ERROR. Before a later round `heal_split` brings it back; after the run's last it stays).
    Raises:
        ArchitectureMismatch: from `DiLoCoPeer.load_state_from_peers`.
    """
    me, next_round = peer.swarm.name, r + 1
    ours = peer.global_model.sha256()
    log.warning("%s round %d: the all-reduce returned no average for %d elements (a peer was lost mid-way): "
                "settling theta with the group", me, r, missed)
    peer._update_priority()
    peer.swarm.set_round(next_round, sha=ours, settled=False)
    deadline = time.monotonic() + peer.allreduce_timeout_s
    while True:
        group = [p for p in peer.swarm.live_peers() if p.name in members and p.name != me]
        done = [p for p in group if p.round == next_round and p.sha]
        # still in the all-reduce (a member that lost it waits in `recover`, unsettled, for us)
        pending = [p for p in group if p.round < next_round and p.settled]
        if any(p.settled for p in done) or not pending or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    candidates = by_precedence([*done, PeerRecord(me, peer.swarm.role, next_round, 0.0, sha=ours, settled=False)])
    ahead_of_us = list(itertools.takewhile(lambda p: p.name != me and p.sha != ours, candidates))
    if load_from_first(peer, ahead_of_us, min_round=next_round):
        return "resynced"
    if ahead_of_us:  # members hold another theta and none of them sent it (gone): ours stays different
        log.error("%s round %d: replicas disagree: none of %s sent its theta (gone?), so this peer keeps its own "
                  "(sha256 %s), in which %d elements missed the group's average; the round is recorded as "
                  "\"unsettled\"", me, r, ", ".join(f"{p.name} (sha256 {p.sha[:12]})" for p in ahead_of_us),
                  ours[:12], missed)
        return "unsettled"
    return "averaged"


def waiting_at_run_end(peer: DiLoCoPeer) -> list[str]:
    """Names of the live peers that may still need this peer at the run's end: behind the last round (in its
    all-reduce, or recovering with a peer's state: `recover`), or at its end with theta unsettled (`settle` takes a
    member's state). Empty when none (or when the DHT cannot be read: it is shutting down)."""
    last = peer.config.rounds
    try:
        others = [p for p in peer.swarm.live_peers() if p.name != peer.swarm.name]
    except Exception as e:
        log.debug("%s: reading heartbeats failed at the run's end: %r", peer.swarm.name, e)
        return []
    return sorted(p.name for p in others if p.round < last or not p.settled)


def serve_until_settled(peer: DiLoCoPeer, stop: threading.Event, timeout_s: float) -> list[str]:
    """At the run's end, keep this peer up, its averager serving state downloads, while a live peer may still need
    it (`waiting_at_run_end`), at most ``timeout_s`` seconds or until ``stop`` is set.

    A peer that exited at once could leave a peer still finishing the last round with no state to take: it would keep
    an incomplete theta (`settle`) or step alone (`recover`), and the run would end with two thetas. Its own
    all-reduce returns only once its parts are out (`composer_diloco.outer.averaging`), but a peer that missed a
    part for another reason (a third peer lost mid-way) still takes a member's state after it.

    Returns:
        The names of the peers still waited for when it stopped (logged as a WARNING), empty when none was left.
    """
    me = peer.swarm.name
    deadline = time.monotonic() + timeout_s
    waiting = waiting_at_run_end(peer)
    while waiting and not stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.2)
        waiting = waiting_at_run_end(peer)
    if waiting and not stop.is_set():
        log.warning("%s at the run's end: %s had not finished round %d when this peer stopped waiting (%.0f s)", me,
                    ", ".join(waiting), peer.config.rounds - 1, timeout_s)
    return waiting


def load_from_first(peer: DiLoCoPeer, candidates: list[PeerRecord], *, min_round: int) -> bool:
    """Load the state of the first of ``candidates`` that sends one (a peer that just died may still have a
    heartbeat); False if none did. A candidate whose published hashes differ from ours at a common round is another
    lineage (a split): that is logged, and once its state is loaded our history restarts from it. Raises
    ArchitectureMismatch (`DiLoCoPeer.load_state_from_peers`)."""
    for pick in candidates:
        at = first_divergence(peer.swarm.history, _lineage(pick))
        if at is not None:
            log.error("%s: split detected: %s's theta at round %d is %s, this peer's was %s (the run was partitioned, "
                      "or peers stepped alone): replicas must not disagree", peer.swarm.name, pick.name, at,
                      _lineage(pick)[at][:12], peer.swarm.history[at][:12])
        log.warning("%s: taking the theta of %s (round %d, sha256 %s)", peer.swarm.name, pick.name, pick.round,
                    pick.sha[:12])
        if peer.load_state_from_peers(peer.config.network.averaging_timeout_s, min_round=min_round, peer=pick):
            if at is not None:
                peer.swarm.history.clear()  # the rounds trained since the split are not the run's
            return True
        log.warning("%s: %s did not send its state", peer.swarm.name, pick.name)
    return False


def join_at_round_boundary(peer: DiLoCoPeer, *, join_grace_s: float, timeout_s: float,
                           stop: threading.Event, intended: int | None = None) -> int:
    """Bring a joining peer to the round the swarm is in, right before its first inner phase.

    First the newest state of any live peer past ours (a joiner whose set-up outlasted a round). Then, if that
    round has been underway for more than ``join_grace_s`` seconds, wait for the swarm to finish it and take
    the next round's state, so that a late joiner never holds the others up for long. Had the others already
    passed the barrier when it arrives anyway, `DiLoCoPeer.sync` takes their state (`recover`).

    Whether the round is still joinable is `swarm.joins_round`. A peer that announced at the start of its set-up
    which round it joins (`Swarm.announce_joining`, by the same rule) joins that round however long its set-up took: the others wait for it at that round's barrier.

    Args:
        join_grace_s: seconds a round may have been underway for this peer to still join it.
        intended: the round `Swarm.announce_joining` returned (None: decide by the round's age now).
        timeout_s: seconds to wait for a peer's state per download.
        stop: set to give up waiting (shutdown).
    Returns:
        The newest round a live peer was in: ``>= config.rounds`` means the run ended while this peer joined.
    Raises:
        ArchitectureMismatch: from `DiLoCoPeer.load_state_from_peers`.
    """
    me = peer.swarm.name
    newest = max((p.round for p in peer.swarm.live_peers() if p.name != me), default=peer.round)
    if newest >= peer.config.rounds:
        return newest  # the others are leaving: nothing to join
    if newest > peer.round:
        log.info("%s: the swarm is at round %d, past our round %d: downloading its state", me, newest, peer.round)
        peer.load_state_from_peers(timeout_s, min_round=newest)
    r = peer.round
    if r == intended:
        return newest  # the barrier of round r waits for us: we said so when our set-up began
    if joins_round([p for p in peer.swarm.live_peers() if p.name != me], r, join_grace_s, get_dht_time()):
        return newest  # the others wait for us at the barrier
    log.info("round %d has been underway for more than %.0f s: joining at the next round boundary", r, join_grace_s)
    while not stop.is_set():
        live = [p for p in peer.swarm.live_peers() if p.name != me]
        if any(p.round > r for p in live) or not any(p.role == "node" and p.round == r for p in live):
            break  # the round is over, or the nodes of that round are gone: nothing to wait for
        time.sleep(0.5)
    deadline = time.monotonic() + peer.config.network.averaging_timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        if peer.load_state_from_peers(timeout_s, min_round=r + 1):
            break
        time.sleep(0.5)
    return max(newest, peer.round)


__all__ = ["RoundFailed", "by_precedence", "heal_split", "join_at_round_boundary", "join_authority_after_split",
           "load_from_first", "recover", "serve_until_settled", "settle", "step_alone", "step_order",
           "waiting_at_run_end"]
