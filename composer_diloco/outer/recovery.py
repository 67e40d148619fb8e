"""What a peer does when a round fails it, and how a peer joins a swarm already underway: the rules, as decisions.

Each rule is a plain function of the swarm's heartbeats (`PeerRecord`s: round, theta's hash, settled, lineage) and of
this peer's own facts, and returns a decision: `Proceed`, `Wait` (poll the heartbeats again), `StepAlone` (apply this
peer's own pseudo-gradient) or `Resync` (take the state of the first of these peers that sends one). `DiLoCoPeer`
(`composer_diloco.outer.peer`, its section "carrying out recovery's decisions") polls, downloads and steps; nothing
here touches a peer, a DHT or a tensor, so the rules are tested as tables of cases (``tests/test_recovery.py``). The
rules are the same on every peer, so that replicas never fork. `DiLoCoPeer.sync` raises `RoundFailed` from any of its
steps and handles it in one place (`after_failed_round`).

Failure behaviour of `DiLoCoPeer.sync`:
- the all-reduce fails (no group within ``averaging_timeout_s``, a peer lost mid-way beyond repair), or the
  swarm finished the round without this peer (a late joiner): no outer step of its own; it takes the newest state
  of a live peer past its round (``load_state_from_peers``, the coordinator first). Of the peers stuck in the
  same round only the first (the coordinator, else the lowest name) steps alone; the rest take its state
  (`after_failed_round`). A peer with nobody in or past its round is the whole swarm and steps alone;
- a contribution with NaN/Inf or an outlier norm: dropped by every peer of the group alike
  (`composer_diloco.outer.screening`, applied in the all-reduce, whose verdicts `sync` reads back); the round
  goes on with the rest, the drop is logged with the peer's name, and if nothing is left to average theta stays
  as it is for that round ("skipped");
- a peer lost in the middle of the all-reduce can leave the survivors with different averages (a reducer that
  returned its part to some peers and not to others). Peers that received every part hold identical bytes
  (`composer_diloco.outer.averaging`); a peer that missed a part publishes its theta as unsettled, and takes the
  state of the first settled member of its group (`settle_pick`), so all replicas leave the round identical, whoever
  was lost, the coordinator included. Should no member with another theta send it (gone), the peer keeps its
  own, logs that the replicas disagree, and records the round "unsettled";
- a NaN/Inf mean pseudo-gradient all the same: the outer step is refused (ValueError from
  `GlobalModel.outer_step`), the round fails and the peer resynchronises as above.

- replicas that disagree (a partition of the DHT that let both halves go on, or two peers that stepped alone
  after timeouts): every peer publishes theta's hash at the start of each of its last rounds in its heartbeat
  (`Swarm.history`, `PeerRecord.lineage`) and, at the start of each sync, compares them with those of the run's
  authority: the coordinator, else the live node with the lowest name (`step_order`). A peer whose theta differs
  at a round both hold takes the authority's state before it averages again (`split_check`); the authority logs
  each peer it finds diverged, and any state taken from a peer of another lineage is logged as a split.
- a round that matchmaking split into several all-reduce groups (each averaged apart, so theta forks at once): a
  peer whose group was smaller than the peers its barrier found, and lacked the authority, compares its new theta
  with the authority's as soon as that is published, and takes it before the next inner phase
  (`after_group_split`), so no inner phase is trained on a forked theta.

The run's end: a peer that finished the last round keeps serving its state while a live peer may still need it
(`waiting_at_run_end`): behind the last round, or at its end with an unsettled theta.

Joining: `DiLoCoPeer.join_at_round_boundary` brings a new peer to the round the swarm is in before its first inner
phase (`swarm.joins_round` decides whether it still joins the current round, `round_over` when it may take the next).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from composer_diloco.outer.peer_records import PeerRecord, first_divergence

__all__ = ["Decision", "Proceed", "Resync", "RoundFailed", "StepAlone", "Wait", "after_failed_round",
           "after_group_split", "after_theta_rejected", "by_precedence", "lineage", "round_over", "settle_pick",
           "split_check", "step_order", "waiting_at_run_end"]


class RoundFailed(Exception):
    """This peer's round ended without an average it can apply; ``reason`` says why, in one line.

    Raised by the steps of `DiLoCoPeer.sync` (barrier, all-reduce, outer step) and handled only where it carries out
    `after_failed_round`.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# -- decisions ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proceed:
    """Nothing to recover: go on. ``diverged`` (only from `split_check` on the run's authority): the peers whose
    theta left the run's lineage, as ``(name, round, their sha, our sha)``, for the authority to log."""

    diverged: tuple[tuple[str, int, str, str], ...] = ()


@dataclass(frozen=True)
class Wait:
    """Not decidable yet: read the heartbeats again (``waiting_for``: whom, for the log)."""

    waiting_for: str = ""


@dataclass(frozen=True)
class StepAlone:
    """Apply this peer's own pseudo-gradient and end the round (it is the first of the peers left in it)."""


@dataclass(frozen=True)
class Resync:
    """Take the state of the first of ``candidates`` that sends one, at round ``min_round`` or later. An empty
    ``candidates`` (from `settle_pick`) means: this peer's own theta is the one to keep."""

    candidates: tuple[PeerRecord, ...]
    min_round: int


Decision = Proceed | Wait | StepAlone | Resync


# -- who comes first ----------------------------------------------------------------------------------------------
def step_order(role: str, name: str) -> tuple[int, str]:
    """Which peer of a failed round steps alone first (the smallest), and the run's authority (the first live peer):
    the coordinator, then by name."""
    return (0 if role == "coordinator" else 1, name)


def by_precedence(peers: list[PeerRecord]) -> list[PeerRecord]:
    """Whose theta the others of a round take, best first: settled peers first, then by `step_order`. The
    first that answers is taken (a peer that just died may still have a heartbeat)."""
    return sorted(peers, key=lambda p: (not p.settled, *step_order(p.role, p.name)))


def lineage(p: PeerRecord) -> dict[int, str]:
    """A peer's published hashes by round, its current round's included once settled."""
    return {**p.lineage, p.round: p.sha} if p.settled and p.sha else dict(p.lineage)


def _authority(others: list[PeerRecord]) -> PeerRecord:
    return min(others, key=lambda p: step_order(p.role, p.name))


# -- the rules ----------------------------------------------------------------------------------------------------
def after_failed_round(role: str, name: str, r: int, others: list[PeerRecord], *, late: bool) -> Decision:
    """Round ``r`` ended without an average for this peer (``role``, ``name``): whose state does it take?

    While a live peer is past round ``r``: the newest state, from the peers of the newest round in `by_precedence`
    order (a peer still settling its theta may replace it, so wait for a settled one until ``late``). While others
    are still in round ``r``: wait for them, unless this peer is the first of the peers left in round ``r`` (the
    coordinator, else the lowest name), which steps alone at once so that the others have a state to take. Nobody in
    or past round ``r``: this peer is the whole swarm and steps alone. The caller steps alone when its wait runs out
    (`DiLoCoPeer.allreduce_timeout_s`), and waits again when a `Resync` found nobody who sent a state.

    Args:
        others: the live peers' heartbeats, this peer's left out.
        late: the last third of the wait has begun (take an unsettled peer's state rather than none).
    Returns:
        `Resync` (min_round ``r + 1``), `StepAlone` or `Wait`.
    """
    ahead = [p for p in others if p.round > r]
    if ahead:
        newest = by_precedence([p for p in ahead if p.round == max(q.round for q in ahead)])
        return Resync(tuple(newest), r + 1) if newest[0].settled or late else Wait(newest[0].name)
    in_round = [p for p in others if p.round == r]
    if not in_round or step_order(role, name) < min(step_order(p.role, p.name) for p in in_round):
        return StepAlone()
    return Wait(min(in_round, key=lambda p: step_order(p.role, p.name)).name)


def split_check(role: str, name: str, history: dict[int, str], others: list[PeerRecord]) -> Proceed | Resync:
    """Before a round's sync: has this peer's theta left the run's lineage?

    The authority is the first live peer by `step_order` (the coordinator, else the lowest name); it keeps the
    canonical theta, so a run split in two heals toward the half that holds it. Its heartbeat carries theta's hash at
    the start of each of its last rounds (`lineage`); this peer compares them with its own ``history``
    (`Swarm.history`) on the rounds both hold (`first_divergence`). None in common, or all equal: `Proceed` (a peer
    merely behind is brought forward by `after_failed_round`). One differs: `Resync` from the authority, whatever its
    round (the rounds trained since the split are dropped). The authority itself proceeds, naming the peers it finds
    diverged.
    """
    if not others:
        return Proceed()
    authority = _authority(others)
    if step_order(role, name) < step_order(authority.role, authority.name):
        found = []
        for p in others:
            at = first_divergence(history, lineage(p))
            if at is not None:
                found.append((p.name, at, lineage(p)[at], history[at]))
        return Proceed(tuple(found))
    if first_divergence(history, lineage(authority)) is None:
        return Proceed()
    return Resync((authority,), 0)


def after_group_split(role: str, name: str, r: int, members: list[str], ours: str,
                      others: list[PeerRecord]) -> Decision:
    """Right after round ``r``'s outer step in an all-reduce group smaller than the barrier's peers: did
    matchmaking split the round into groups that averaged apart?

    hivemind's matchmaking may form several groups out of one round's peers (seen with 9 peers on 2 busy cores: three
    groups), each stepping theta by its own mean, so the replicas part. `split_check` would bring them back at the
    next sync, after a whole inner phase trained on a theta that is then dropped; here a peer whose group lacks the
    authority waits for the authority's theta of round ``r + 1`` and takes it when it differs from ``ours``. The
    pseudo-gradients of this peer's group are then lost for round ``r``: the rule is the same on every peer, so the
    replicas agree again without a second all-reduce.

    Args:
        members: the names of this peer's all-reduce group, this peer included.
        ours: this peer's theta's hash after the step.
        others: the live peers' heartbeats, this peer's left out.
    Returns:
        `Proceed` (nothing to heal: the authority is this peer or was in its group, holds the same theta, or moved on
        past round ``r + 1``, when the barrier's `after_failed_round` takes its state), `Resync` from the authority
        (min_round ``r + 1``), or `Wait` for it to publish its theta.
    """
    if not others:
        return Proceed()
    authority = _authority(others)
    if authority.name in members or step_order(role, name) < step_order(authority.role, authority.name):
        return Proceed()
    if authority.round > r + 1:
        return Proceed()
    if authority.round == r + 1 and authority.settled and authority.sha:
        return Proceed() if authority.sha == ours else Resync((authority,), r + 1)
    return Wait(authority.name)


def settle_pick(role: str, name: str, members: set[str], r: int, ours: str, live: list[PeerRecord], *,
                timed_out: bool, began: float = float("inf")) -> Wait | Resync:
    """After an all-reduce of round ``r`` that missed elements: which member's theta do the group's members keep?

    A reducer lost mid-way may have returned its part to some members and not to others, so theta can differ between
    them. Wait for a settled member (one that received every part) or for every live member to be done with round
    ``r``, unless ``timed_out``; then all adopt the theta of the same member, the first by `by_precedence` (settled
    ones first, then the coordinator, then by name), this peer (published unsettled, with ``ours``) among them.
    A member whose heartbeat entered round ``r`` after the all-reduce ``began`` (DHT time) is a new life under its
    name (restarted, or taken over by its standby: `nodes.standby`) that took no part in it: it is not waited for
    (it would never publish round ``r + 1`` from this all-reduce; the wait ran to ``timed_out``).

    Returns:
        `Wait`, or `Resync` with the members ahead of this peer whose theta differs from ``ours`` (the first that
        sends its state is taken; empty: this peer comes first or already holds the pick's theta, and keeps its own).
    """
    next_round = r + 1
    group = [p for p in live if p.name in members and p.name != name]
    done = [p for p in group if p.round == next_round and p.sha]
    # still in the all-reduce (a member that lost it waits in `after_failed_round`, unsettled, for us)
    pending = [p for p in group if p.round < next_round and p.settled and p.since <= began]
    if not (any(p.settled for p in done) or not pending or timed_out):
        return Wait(", ".join(sorted(p.name for p in pending)))
    candidates = by_precedence([*done, PeerRecord(name, role, next_round, 0.0, sha=ours, settled=False)])
    return Resync(tuple(itertools.takewhile(lambda p: p.name != name and p.sha != ours, candidates)), next_round)


def after_theta_rejected(r: int, authority: str, ours: str, others: list[PeerRecord]) -> Decision:
    """Right after round ``r``'s outer step, for a peer whose group dropped its pseudo-gradient because it trained
    from another theta than the group's authority (`composer_diloco.outer.screening.screen`): it stepped its own
    theta by the group's mean, so it must take the authority's theta of round ``r + 1``.

    Args:
        authority: the name of the group's authority (`Rejection.theta_authority`).
        ours: this peer's theta's hash after the step.
        others: the live peers' heartbeats, this peer's left out.
    Returns:
        `Resync` from the authority (min_round ``r + 1``) once it published a settled theta of round ``r + 1`` other
        than ``ours``; `Proceed` when it holds ``ours``, is gone, or moved past round ``r + 1`` (`split_check` brings
        this peer back at its next sync); else `Wait` for it.
    """
    record = next((p for p in others if p.name == authority), None)
    if record is None or record.round > r + 1:
        return Proceed()
    if record.round == r + 1 and record.settled and record.sha:
        return Proceed() if record.sha == ours else Resync((record,), r + 1)
    return Wait(record.name)


def waiting_at_run_end(name: str, last_round: int, live: list[PeerRecord]) -> list[str]:
    """Names of the live peers that may still need this peer's state at the run's end: behind the last round (in its
    all-reduce, or waiting for a state: `after_failed_round`), or at its end with theta unsettled (`settle_pick`).

    Args:
        last_round: the run's round count (``config.rounds``).
    """
    return sorted(p.name for p in live if p.name != name and (p.round < last_round or not p.settled))


def round_over(r: int, live: list[PeerRecord]) -> bool:
    """Whether a joiner waiting for round ``r`` to end may take the next round's state: a live peer is past ``r``, or
    no node is left in ``r`` (nothing to wait for)."""
    return any(p.round > r for p in live) or not any(p.role == "node" and p.round == r for p in live)
