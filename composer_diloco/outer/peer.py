"""One DiLoCo peer: pseudo-gradient -> weighted all-reduce through hivemind -> outer Nesterov step.

A node calls `DiLoCoPeer.sync(model, weight)` after its H inner steps; the coordinator calls
`sync(None, 0.0)` for every round, so it receives the same mean pseudo-gradient without moving it and applies the
same outer step: it always holds the canonical theta (DiLoCo, arXiv 2311.08105; OpenDiLoCo's layout on hivemind).

Failure behaviour of `sync`:
- the all-reduce fails (no group within ``averaging_timeout_s``, a peer lost mid-way beyond repair), or the
  swarm finished the round without this peer (a late joiner): no outer step of its own; it takes the newest state
  of a live peer past its round (``load_state_from_peers``, the coordinator first). Of the peers stuck in the
  same round only the first (the coordinator, else the lowest name) steps alone; the rest take its state
  (`DiLoCoPeer._after_failure`). A peer with nobody in or past its round is the whole swarm and steps alone;
- a contribution with NaN/Inf or an outlier norm: dropped by every peer of the group alike
  (`composer_diloco.outer.screening`); the round goes on with the rest, the drop is logged with the peer's name, and
  if nothing is left to average theta stays as it is for that round ("skipped");
- a peer lost in the middle of the all-reduce can leave the survivors with different averages (a reducer that
  returned its part to some peers and not to others). Peers that received every part hold identical bytes
  (`composer_diloco.outer.averaging`); a peer that missed a part publishes its theta as unsettled, and takes the
  state of the first settled member of its group (`DiLoCoPeer._settle`), so all replicas leave the round
  identical, whoever was lost, the coordinator included;
- a NaN/Inf mean pseudo-gradient all the same: the outer step is refused (ValueError from
  `GlobalModel.outer_step`), the round is marked failed and the peer resynchronises as above.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from composer_diloco import faults
from composer_diloco.outer.averaging import ExactAverager
from composer_diloco.outer.compression import make_compression
from composer_diloco.config import RunConfig
from composer_diloco.lifecycle import keep_signal_handlers
from composer_diloco.outer.global_model import GlobalModel
from composer_diloco.outer.screening import pseudo_gradient_norm, screen
from composer_diloco.outer.swarm import PeerRecord, Swarm

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """What one round's communication did.

    Attributes:
        round: the round whose outcome theta now holds (theta is theta_{round+1}): the round that ended, or,
            when the peer found the swarm further ahead and downloaded its state, the round before its new one.
        peers: group size of the all-reduce, coordinator included (1 = averaged alone).
        weight_total: sum of the weights (samples) in the group.
        sync_seconds: wall seconds from ready to the new theta loaded (barrier wait included).
        wait_seconds: the part of ``sync_seconds`` spent waiting at the barrier for other peers.
        bytes_sent: payload bytes this peer sent in the all-reduce.
        global_sha256: SHA-256 of theta after the outer step (`GlobalModel.sha256`).
        status: "averaged", "alone", "resynced" (state downloaded from a peer after a failure) or "skipped"
            (every contribution was dropped: theta unchanged).
        rejected: names of the peers whose pseudo-gradient was dropped this round (`screening.screen`).
    """

    round: int
    peers: int
    weight_total: float
    sync_seconds: float
    wait_seconds: float
    bytes_sent: int
    global_sha256: str
    status: str
    rejected: list[str] = field(default_factory=list)


class ArchitectureMismatch(ValueError):
    """A peer's global model has other parameters (names or shapes) than this peer's model."""


@dataclass
class _RoundClock:
    """When this peer's sync of a round started, how long it waited at the barrier, bytes sent before it."""

    start: float
    bytes_before: int
    waited: float = 0.0


def _check_layout(theirs: list, ours: list) -> None:
    """Raise ArchitectureMismatch naming the first parameter whose name or shape differs."""
    theirs = [[str(n), list(shape)] for n, shape in theirs]
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            raise ArchitectureMismatch(
                f"model architecture differs from the run's: parameter {i} is {a[0]!r} {a[1]} in the run, "
                f"{b[0]!r} {b[1]} here (does --model / the installed version match the coordinator's?)")
    if len(theirs) != len(ours):
        raise ArchitectureMismatch(f"model architecture differs from the run's: {len(theirs)} parameter tensors in "
                                   f"the run, {len(ours)} here")


def _step_order(role: str, name: str) -> tuple[int, str]:
    """Which peer of a failed round steps alone first (the smallest): the coordinator, then by name."""
    return (0 if role == "coordinator" else 1, name)


def _by_precedence(peers: list[PeerRecord]) -> list[PeerRecord]:
    """Whose theta the others of a round take, best first: settled peers first, then by `_step_order`. The
    first that answers is taken (a peer that just died may still have a heartbeat)."""
    return sorted(peers, key=lambda p: (not p.settled, *_step_order(p.role, p.name)))


def round_group_bits(round_: int) -> str:
    """hivemind group-key bits for a round: peers of different rounds can never be matched together."""
    return format(round_, "032b")


class DiLoCoPeer:
    """Global model + outer optimizer + hivemind averager of one peer.

    Args:
        model: the policy (any device/dtype); defines the parameter layout.
        config: the run config (outer optimizer, network timeouts, compression).
        swarm: this peer's DHT records (its ``dht`` is used for the averager).
        start_round: the round this peer starts in (0, or the round of the state it loaded).
    """

    def __init__(self, model: nn.Module, config: RunConfig, swarm: Swarm, *, start_round: int = 0):
        self.config, self.swarm = config, swarm
        self.round = start_round
        self._lock = threading.Lock()  # guards theta while a peer downloads our state
        self._built = threading.Event()  # set once theta exists: a state request waits for it
        self.delta = [torch.zeros(p.shape, dtype=torch.float32) for p in model.parameters() if p.requires_grad]
        # hivemind forks its averager process here: before theta and the outer momentum exist, so that the child
        # does not keep copy-on-write pages of them (twice their memory, and a slow first outer step, on big models)
        with keep_signal_handlers():
            self.averager = self._make_averager(swarm, config)
        self.global_model = GlobalModel(
            model, lr=config.outer.lr, momentum=config.outer.momentum, nesterov=config.outer.nesterov
        )
        self._built.set()
        self._update_priority()

    def _make_averager(self, swarm: Swarm, config: RunConfig) -> ExactAverager:
        from composer_diloco.outer.auth import MembersOnlyAverager, averaging_prefix

        net = config.network
        # a closed run's averager has its own prefix and serves only peers that hold the run secret (auth.py)
        averager_type = ExactAverager if swarm.secret is None else MembersOnlyAverager
        return averager_type(
            self.delta,
            swarm.dht,
            state_provider=self._state,
            prefix=averaging_prefix(config.run_name, swarm.secret),
            start=True,
            min_group_size=2,
            min_matchmaking_time=net.matchmaking_time_s,
            request_timeout=min(5.0, net.matchmaking_time_s),
            allreduce_timeout=net.averaging_timeout_s,
            next_chunk_timeout=min(10.0, net.averaging_timeout_s / 3),
            compression=make_compression(config.compression),
            max_norm_ratio=config.outer.max_norm_ratio,
            declare_state_period=5.0,
            shutdown_timeout=5.0,
        )

    # -- state sharing (late joiners, resync) -------------------------------------------------------
    def _state(self) -> tuple[dict, list[torch.Tensor]]:
        self._built.wait()
        with self._lock:
            meta = {"round": self.round, "sha256": self.global_model.sha256(), "run": self.config.run_name,
                    "layout": self.layout()}
            return meta, [t.clone() for t in self.global_model.state_tensors()]

    def _update_priority(self) -> None:
        # load_state_from_peers picks the highest priority: the newest round, the coordinator among equals.
        self.averager.state_sharing_priority = self.round + (0.5 if self.swarm.role == "coordinator" else 0.0)

    def layout(self) -> list[list]:
        """``[[name, shape], ...]`` of the global params: what two peers of one run must share."""
        return [[n, list(p.shape)] for n, p in zip(self.global_model.names, self.global_model.params)]

    def load_state_from_peers(self, timeout_s: float, *, min_round: int | None = None,
                              peer: PeerRecord | None = None) -> bool:
        """Adopt theta, outer momentum and round from the best live peer, or from ``peer``.

        Args:
            timeout_s: seconds to wait for a peer's state.
            min_round: ignore (do not load) a state older than this round.
            peer: download from this peer only (None: hivemind's choice, the newest round and the coordinator
                first among equals).
        Returns:
            False if no peer answered, its state was older than ``min_round``, or every download within
            ``timeout_s`` came back incomplete (a stream cut early: hivemind returns what it got).
        Raises:
            ArchitectureMismatch: the peer's parameters differ from this model's (names the first difference).
        """
        expected = len(self.global_model.state_tensors())
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(1.0, deadline - time.monotonic())
            loaded = self.averager.load_state_from_peers(timeout=remaining, peer=peer.peer_id if peer else None)
            if loaded is None:
                return False
            if isinstance(loaded[0], dict) and "layout" in loaded[0]:
                _check_layout(loaded[0]["layout"], self.layout())  # another model: no retry can help
            # hivemind ends a download whose stream was cut early as if it were complete: count the tensors
            if len(loaded[1]) == expected or time.monotonic() >= deadline:
                break
            log.warning("%s: incomplete state download (%d of %d tensors): retrying", self.swarm.name,
                        len(loaded[1]), expected)
            time.sleep(0.5)
        meta, tensors = loaded
        if len(tensors) != expected:
            log.warning("%s: incomplete state download (%d of %d tensors): not loaded", self.swarm.name,
                        len(tensors), expected)
            return False
        if not isinstance(meta, dict) or "round" not in meta:
            log.warning("peer state without a round: %r", meta)
            return False
        if min_round is not None and int(meta["round"]) < min_round:
            log.info("%s: the peers' state is at round %s, older than round %d: not loaded", self.swarm.name,
                     meta["round"], min_round)
            return False
        with self._lock:
            self.global_model.load_state_tensors(tensors)
            self.round = int(meta["round"])
        self._update_priority()
        log.info("%s loaded round %d state from a peer (sha256 %s)", self.swarm.name, self.round,
                 self.global_model.sha256()[:12])
        return True

    def join_at_round_boundary(self, *, join_grace_s: float, timeout_s: float, stop: threading.Event) -> int:
        """Bring a joining peer to the round the swarm is in, right before its first inner phase.

        First the newest state of any live peer past ours (a joiner whose set-up outlasted a round). Then, if that
        round has been underway for more than ``join_grace_s`` seconds, wait for the swarm to finish it and take
        the next round's state, so that a late joiner never holds the others up for long. Had the others already
        passed the barrier when it arrives anyway, `sync` takes their state (`_after_failure`).

        Args:
            join_grace_s: seconds a round may have been underway for this peer to still join it.
            timeout_s: seconds to wait for a peer's state per download.
            stop: set to give up waiting (shutdown).
        Returns:
            The newest round a live peer was in: ``>= config.rounds`` means the run ended while this peer joined.
        Raises:
            ArchitectureMismatch: from `load_state_from_peers`.
        """
        me = self.swarm.name
        newest = max((p.round for p in self.swarm.live_peers() if p.name != me), default=self.round)
        if newest >= self.config.rounds:
            return newest  # the others are leaving: nothing to join
        if newest > self.round:
            log.info("%s: the swarm is at round %d, past our round %d: downloading its state", me, newest, self.round)
            self.load_state_from_peers(timeout_s, min_round=newest)
        r = self.round
        training = [p for p in self.swarm.live_peers() if p.role == "node" and p.name != me and p.round == r]
        if not training:
            return newest
        age = get_dht_time() - min(p.since for p in training)
        if age <= join_grace_s:
            return newest  # the others wait for us at the barrier
        log.info("round %d has been underway for %.0f s: joining at the next round boundary", r, age)
        while not stop.is_set():
            live = [p for p in self.swarm.live_peers() if p.name != me]
            if any(p.round > r for p in live) or not any(p.role == "node" and p.round == r for p in live):
                break  # the round is over, or the nodes of that round are gone: nothing to wait for
            time.sleep(0.5)
        deadline = time.monotonic() + self.config.network.averaging_timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            if self.load_state_from_peers(timeout_s, min_round=r + 1):
                break
            time.sleep(0.5)
        return max(newest, self.round)

    # -- one round ------------------------------------------------------------------------------------
    def sync(self, model: nn.Module | None, weight: float, stop: threading.Event | None = None) -> SyncResult | None:
        """End the current round: average pseudo-gradients, take the outer step, load theta into ``model``.

        Args:
            model: the locally trained policy (None on the coordinator: it contributes zeros).
            weight: samples this peer trained this round (0 on the coordinator).
            stop: set to abandon the barrier wait (shutdown); returns None then.
        Returns:
            A `SyncResult`, or None when stopped.
        """
        r, net = self.round, self.config.network
        clock = _RoundClock(start=time.monotonic(), bytes_before=self.averager.bytes_sent.value)
        with self.averager.get_tensors() as delta:
            if model is None:
                for d in delta:
                    d.zero_()
            else:
                self.global_model.pseudo_gradient(model, delta)
                faults.point("pseudo_gradient", r, tensors=delta)
            norm = pseudo_gradient_norm(delta)
        if self.swarm.role == "node":
            self.swarm.announce_ready(r, weight)
        barrier = self.swarm.wait_for_round(r, slack_s=net.round_slack_s, matchmaking_s=net.matchmaking_time_s,
                                            stop=stop)
        if barrier is None:
            return None
        scheduled_time, ready_nodes = barrier
        clock.waited = time.monotonic() - clock.start
        others = [p for p in self.swarm.live_peers() if p.name != self.swarm.name and p.round <= r]
        others = [p for p in others if p.role == "coordinator" or p.name in ready_nodes]
        if not others:
            if any(p.round > r for p in self.swarm.live_peers()):  # the swarm finished this round without us
                return self._after_failure(model, r, clock)
            return self._step_alone(model, r, clock)  # we are the whole swarm: theta moves by our own delta

        self.averager.set_group_bits(round_group_bits(r))
        try:
            gathered = self.averager.step(
                weight=float(weight),
                gather={"name": self.swarm.name, "role": self.swarm.role, "round": r, "weight": float(weight),
                        "norm": norm},
                scheduled_time=scheduled_time,
                timeout=net.averaging_timeout_s,
                allow_retries=False,
            )
        except Exception as e:
            log.warning("%s round %d: all-reduce failed: %r", self.swarm.name, r, e)
            gathered = None
        if not gathered or len(gathered) == 1:
            return self._after_failure(model, r, clock)
        group = [g if isinstance(g, dict) else {} for g in gathered.values()]
        if {g.get("round") for g in group} != {r}:
            log.error("%s round %d: group mixed rounds %s", self.swarm.name, r, {g.get("round") for g in group})
        verdicts = screen(group, self.config.outer.max_norm_ratio)
        rejected = [v.name for v in verdicts if v is not None]
        for v in verdicts:
            if v is not None:
                log.warning("%s round %d: dropped the pseudo-gradient of %s: %s", self.swarm.name, r, v.name, v.reason)
        weight_total = sum(float(g.get("weight", 0.0)) for g, v in zip(group, verdicts) if v is None)
        if weight_total <= 0 and rejected:
            log.warning("%s round %d: no contribution left after screening: theta unchanged", self.swarm.name, r)
            with self._lock:
                self.round = r + 1
            return self._finish(model, clock, peers=len(group), status="skipped", rejected=rejected)
        if weight_total <= 0:
            return self._after_failure(model, r, clock)

        with self.averager.get_tensors() as delta:
            mean = [d.clone() for d in delta]
        missed = int(self.averager.failed_size.value)  # elements no reducer returned to us (zeros in `mean`)
        try:
            with self._lock:
                self.global_model.outer_step(mean)
                self.round = r + 1
        except ValueError as e:
            log.error("%s round %d: %s", self.swarm.name, r, e)
            return self._after_failure(model, r, clock)
        status = "averaged"
        if missed:
            status = self._settle({str(g.get("name")) for g in group}, r, missed)
        return self._finish(model, clock, peers=len(group), weight_total=weight_total, status=status,
                            rejected=rejected)

    def _settle(self, members: set[str], r: int, missed: int) -> str:
        """After an all-reduce of round ``r`` that missed ``missed`` elements: take one group member's theta.

        A reducer lost mid-way may have returned its part to some members and not to others, so theta can differ
        between them. This peer publishes its theta as unsettled and waits (at most ``averaging_timeout_s``) for
        a settled member, one that received every part, or for every live member to be done with round ``r``.
        Then all adopt the theta of the same member, the first by `_by_precedence` that answers (settled ones
        first, then the coordinator, then by name); a peer that comes first keeps its own.

        Returns:
            "averaged" (this peer's theta was kept or already equal) or "resynced" (the pick's state was
            downloaded).
        """
        me, next_round = self.swarm.name, r + 1
        ours = self.global_model.sha256()
        log.warning("%s round %d: the all-reduce returned no average for %d elements (a peer was lost mid-way): "
                    "settling theta with the group", me, r, missed)
        self._update_priority()
        self.swarm.set_round(next_round, sha=ours, settled=False)
        deadline = time.monotonic() + self.config.network.averaging_timeout_s
        while True:
            group = [p for p in self.swarm.live_peers() if p.name in members and p.name != me]
            done = [p for p in group if p.round == next_round and p.sha]
            # still in the all-reduce (a member that lost it waits in `_after_failure`, unsettled, for us)
            pending = [p for p in group if p.round < next_round and p.settled]
            if any(p.settled for p in done) or not pending or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        candidates = _by_precedence([*done, PeerRecord(me, self.swarm.role, next_round, 0.0, sha=ours,
                                                       settled=False)])
        ahead_of_us = list(itertools.takewhile(lambda p: p.name != me and p.sha != ours, candidates))
        return "resynced" if self._load_from_first(ahead_of_us, min_round=next_round) else "averaged"

    def _load_from_first(self, candidates: list[PeerRecord], *, min_round: int) -> bool:
        """Load the state of the first of ``candidates`` that sends one (a peer that just died may still have a
        heartbeat); False if none did."""
        for pick in candidates:
            log.warning("%s: taking the theta of %s (round %d, sha256 %s)", self.swarm.name, pick.name, pick.round,
                        pick.sha[:12])
            if self.load_state_from_peers(self.config.network.averaging_timeout_s, min_round=min_round, peer=pick):
                return True
            log.warning("%s: %s did not send its state", self.swarm.name, pick.name)
        return False

    def _after_failure(self, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult:
        """Round ``r`` ended without an average for this peer: take the state of a peer past round ``r``.

        One rule on every peer, so that replicas never fork: while a live peer is past round ``r``, download the
        newest state from the peers of the newest round, in `_by_precedence` order (a settled one, the
        coordinator first among equals). While others are still in round ``r``, wait for them, at most
        ``averaging_timeout_s``; only the first of the peers left in round ``r`` (the coordinator, else the lowest
        name) applies its own pseudo-gradient at once, so the others have a state to take. A peer with nobody in or
        past its round is the whole swarm and steps alone.
        """
        timeout_s = self.config.network.averaging_timeout_s
        deadline = time.monotonic() + timeout_s
        # unsettled while waiting for a state, so that a member settling its own theta (`_settle`) does not wait for us
        self.swarm.set_round(r, sha=self.swarm.sha, settled=False)
        while time.monotonic() < deadline:
            others = [p for p in self.swarm.live_peers() if p.name != self.swarm.name]
            ahead = [p for p in others if p.round > r]
            if ahead:
                newest = _by_precedence([p for p in ahead if p.round == max(q.round for q in ahead)])
                # a peer still settling its theta may replace it: wait for a settled one, unless time runs out
                if (newest[0].settled or time.monotonic() > deadline - timeout_s / 3) and self._load_from_first(
                        newest, min_round=r + 1):
                    return self._finish(model, clock, peers=0, status="resynced")
            else:
                in_round = [p for p in others if p.round == r]
                if not in_round or _step_order(self.swarm.role, self.swarm.name) < min(
                        _step_order(p.role, p.name) for p in in_round):
                    break
            time.sleep(0.25)
        log.warning("%s round %d: no peer ahead of us; applying our own pseudo-gradient", self.swarm.name, r)
        return self._step_alone(model, r, clock)

    def _step_alone(self, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult:
        with self.averager.get_tensors() as delta:
            own = [d.clone() for d in delta]
        status = "alone"
        with self._lock:
            try:
                self.global_model.outer_step(own)
            except ValueError as e:  # our own pseudo-gradient is non-finite: keep theta
                log.error("%s round %d: %s; theta unchanged", self.swarm.name, r, e)
                status = "skipped"
            self.round = r + 1
        return self._finish(model, clock, peers=1, status=status)

    def _finish(self, model: nn.Module | None, clock: _RoundClock, *, peers: int, status: str,
                weight_total: float = 0.0, rejected: list[str] | None = None) -> SyncResult:
        if model is not None:
            self.global_model.load_into(model)
        self._update_priority()
        sha = self.global_model.sha256()
        self.swarm.set_round(self.round, sha=sha)
        return SyncResult(
            round=self.round - 1, peers=peers, weight_total=weight_total, sync_seconds=time.monotonic() - clock.start,
            wait_seconds=clock.waited, bytes_sent=int(self.averager.bytes_sent.value - clock.bytes_before),
            global_sha256=sha, status=status, rejected=list(rejected or []),
        )

    def shutdown(self) -> None:
        """Stop the averager process (idempotent)."""
        try:
            self.averager.shutdown()
        except Exception as e:  # already stopped
            log.debug("averager shutdown: %r", e)
