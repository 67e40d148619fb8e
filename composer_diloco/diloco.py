"""A DiLoCo round, from the end of one inner phase to the start of the next, in one place (DiLoCo, arXiv 2311.08105).

A node's round (`DiLoCoRounds`; `composer_diloco.inner.trainer.RoundCallback` calls it after each of TRL's steps):

    H inner steps: rollouts -> collator -> composite loss -> AdamW      (TRL GRPOTrainer: `ComposerGRPOTrainer`)
    1. close the inner phase: its stats, steps and seconds               `DiLoCoRounds._close_inner_phase`
    2. sync with the swarm
       blocking:   heal check -> pseudo-gradient Delta_i = theta - theta_i -> barrier -> weighted all-reduce
                   -> outer step theta <- OuterOpt(theta, Delta) -> theta loaded into the policy     `DiLoCoPeer.sync`
       overlapped: the round in flight settles and its theta is folded into the policy, this round's Delta_i is
                   handed to a background thread that runs the rest                   `OverlappedSync.end_round`
    3. the channels learn that the policy moved (DPO's reference policy)  `InnerTrainer.refresh_reference`
    4. one record per round that ended                                    `RoundHost.round_ended`
       (overlapped: at the first inner step after its background sync landed, `OverlappedSync.landed`)
    5. the next inner phase starts                                        `DiLoCoRounds.start_inner_phase`

The coordinator's round is step 2 alone, with no policy (`follow_rounds`): it contributes a zero pseudo-gradient of
weight 0 and applies the same outer step, so it holds the canonical theta.

Failure behaviour, call by call:
- `DiLoCoPeer.sync` does not raise on a failed round: it ends it "resynced" (a peer's state downloaded) or "alone"
  (its own pseudo-gradient), by `composer_diloco.outer.recovery`'s rules; a stop at the barrier returns None, and
  the round then ends with no record and no new inner phase (the trainer stops at this step). It raises
  `ArchitectureMismatch` when the state it must take belongs to another model: that ends the node.
- `OverlappedSync.end_round` fails closed: a background round that did not end "averaged" into the next round drops
  the overlapped phase's progress and loads theta (the settled round's record says ``fold: "dropped"``; the dropped
  phase was never handed off and has no record); the background thread's exception is raised here, at the next fold.
- An error of the host's record (a full disk) propagates out of the trainer's step, as any error of the trainer's
  loop does: a round is not reported done that was not written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from composer_diloco import faults
from composer_diloco.outer.overlap import OverlappedSync
from composer_diloco.outer.peer import DiLoCoPeer, SyncResult
from composer_diloco.timing import INNER_PHASES, PhaseClock

if TYPE_CHECKING:  # the coordinator imports this module, and none of the inner loop's
    from composer_diloco.inner.journal import PhaseJournal, Resumed
    from composer_diloco.inner.step import RoundStats

__all__ = ["DiLoCoRounds", "InnerPhase", "InnerTrainer", "RoundHost", "follow_rounds"]

log = logging.getLogger(__name__)

_PHASE_ORDER = {name: i for i, name in enumerate(INNER_PHASES)}  # a round's order; a phase not listed goes last


@dataclass
class InnerPhase:
    """One inner phase of a node, closed at its round's end.

    Attributes:
        round: the round it trained (the peer's round when it ended).
        stats: its episodes, per-step losses and channel counts (`RoundStats`).
        steps: inner steps taken (``inner_steps`` H, or fewer when ``network.round_budget_s`` ended it, or when it
            caught up with the round's first ready node, ``caught_up``).
        seconds: wall seconds from its start to its end.
        parts: ``seconds`` by part (`INNER_PHASES`), seconds.
        ended: `time.monotonic` at its end, seconds.
        blocked_seconds: wall seconds the inner loop stood still from ``ended`` on (blocking: the whole sync;
            overlapped: waiting for the previous round's theta, the fold and the hand-off; for the run's last round
            also its own sync).
        caught_up: ended at the first inner step after another node of its round was ready: a late joiner's first
            phase (`DiLoCoRounds.catch_up`), or any phase with ``network.round_ends_at_first_ready``.
        resumed: what this phase took over from the last life's journal (`composer_diloco.inner.journal`): the cut
            phase it went on from and the handed-off phase it re-sent, or None; their steps are in ``steps`` (the cut
            phase's), their episodes in `weight`, their seconds apart (``resumed_inner_seconds``,
            ``resent_inner_seconds``); or only the record of a handed-off phase a group counted whose line was lost
            with the last life (``landed_*``: in neither the weight nor the progress).
    """

    round: int
    stats: RoundStats
    steps: int
    seconds: float
    parts: dict[str, float]
    ended: float = 0.0
    blocked_seconds: float = 0.0
    caught_up: bool = False
    resumed: Resumed | None = None

    @property
    def weight(self) -> float:
        """The phase's all-reduce weight: its episodes, a resumed journal's included (`Resumed.total_samples`)."""
        return float(self.stats.samples + (self.resumed.total_samples if self.resumed is not None else 0))

    @property
    def worked_seconds(self) -> float:
        """The phase's inner-loop seconds, a resumed journal's included (`Resumed.total_seconds`)."""
        return self.seconds + (self.resumed.total_seconds if self.resumed is not None else 0.0)

    def record(self, inner_steps: int) -> dict:
        """The phase's keys of a round's metrics line (`SyncResult.record` gives the sync's): the stats'
        (`RoundStats.record`), ``inner_steps``, ``inner_seconds`` and ``blocked_seconds`` (seconds, 3 decimals),
        ``deadline_hit`` (fewer steps than ``inner_steps``, the run's H, and not ``caught_up``: the round budget or a
        stop ended it), ``caught_up``, ``inner_phase_seconds`` (by part, 4 decimals, in `INNER_PHASES` order),
        ``generated_tokens_per_s`` (per second of the ``generation`` part; 0.0 when there was none) and, for a resumed
        phase, `Resumed.record`'s keys."""
        generation = self.parts.get("generation", 0.0)
        tokens = self.stats.generated_tokens
        return {
            **self.stats.record(), "inner_steps": self.steps, "inner_seconds": round(self.seconds, 3),
            "blocked_seconds": round(self.blocked_seconds, 3),
            "deadline_hit": self.steps < inner_steps and not self.caught_up,
            "caught_up": self.caught_up,
            "inner_phase_seconds": {k: round(self.parts[k], 4)
                                    for k in sorted(self.parts, key=lambda k: _PHASE_ORDER.get(k, 99))},
            "generated_tokens_per_s": round(tokens / generation, 1) if generation > 0 else 0.0,
            **(self.resumed.record() if self.resumed is not None else {}),
        }


class InnerTrainer(Protocol):
    """What a round asks of the inner loop's trainer (`ComposerGRPOTrainer`): its round's stats so far
    (``round_stats``, a `RoundStats`), its inner optimizer (``optimizer``, None before ``train()`` set it up)."""

    round_stats: RoundStats
    optimizer: Any

    def take_round_stats(self) -> RoundStats:
        """The round's stats since the previous call."""

    def refresh_reference(self) -> None:
        """The policy moved (theta loaded, or a rebase): channels that keep a reference policy follow it."""


class RoundHost(Protocol):
    """What a round tells the process it runs in (`nodes.node.Node`): where it is, and each round's outcome."""

    def round_phase(self, phase: str) -> None:
        """The node entered ``"inner"`` (rollouts and training) or ``"sync"`` (`composer-coordinator status`)."""

    def inner_phase_ended(self, phase: InnerPhase) -> None:
        """An inner phase closed, before its sync (the node's tool-call tally, its env-failure warning)."""

    def round_ended(self, result: SyncResult, phase: InnerPhase, fold: str | None) -> None:
        """Round ``result.round`` ended after ``phase``; ``fold`` is how an overlapped round reached the policy
        (`composer_diloco.outer.overlap.Fold`), None in blocking mode. The node writes its metrics line."""


class DiLoCoRounds:
    """A node's rounds (module docstring): counts inner steps, ends a round after H of them or at the round's time
    budget (``network.round_budget_s``, checked after each step), syncs, and says when the trainer must stop (the
    run's end, a stop request).

    A node that joined a swarm already past its first round (a restart, a standby's takeover, a node added: ``catch_up``)
    ends its first inner phase at the first inner step after another node announced that round ready
    (`Swarm.ready_peers`), with the steps it has: its pseudo-gradient weighs its samples like any other. Without
    this the round's barrier held every other node for the joiner's set-up and then its H whole steps (12-15 s a kill
    at the embedded default under churn, `bench/churn.py`). The run's first round is never caught up
    (`Swarm.announce_joining`): the nodes launched together all train its H steps. With
    ``network.round_ends_at_first_ready`` every phase of every node ends so: a round lasts the fastest node's H steps
    and a straggler's pseudo-gradient weighs the samples of the steps it had. The trainer's callback (`composer_diloco.inner.trainer.RoundCallback`) calls
    `after_inner_step` and `finish`; a loop without TRL calls them the same way (`bench/blocked_link.py`).

    Args:
        peer: the node's `DiLoCoPeer` (global model, outer optimizer, averager; its run config gives ``rounds``,
            ``inner_steps`` and ``network.round_budget_s``).
        stop: the node's stop event (a barrier wait gives up when it is set).
        host: the node (`RoundHost`).
        clock: the inner phase's `PhaseClock` (its parts are taken at each phase's end).
        overlap: the background sync with ``[outer] overlap``, None for blocking rounds.
        catch_up: this node joined a swarm already past its first round (`Swarm.joined_late`).
        journal: the inner phase's journal (`composer_diloco.inner.journal.PhaseJournal`), written after each inner
            step and removed at each phase's end; None: none.

    Attributes:
        trainer: the `InnerTrainer`, set by `attach` (the trainer is built with this callback in it).
        steps: inner steps taken in the current phase.
        started: `time.monotonic` at the current inner phase's start, seconds.
    """

    def __init__(self, peer: DiLoCoPeer, stop: threading.Event, host: RoundHost, clock: PhaseClock,
                 overlap: OverlappedSync | None = None, catch_up: bool = False, journal: PhaseJournal | None = None):
        self.peer, self.config, self.stop, self.host = peer, peer.config, stop, host
        self.catch_up = catch_up  # the current phase ends once another node of its round is ready (first phase only)
        self.clock, self.overlap, self.journal = clock, overlap, journal
        self.resumed: Resumed | None = None  # the current phase went on from the last life's journal
        self.trainer: InnerTrainer | None = None
        self.steps = 0
        self.started = time.monotonic()
        self._handed_off: dict[int, InnerPhase] = {}  # overlap: each handed-off round's inner phase, by round

    def attach(self, trainer: InnerTrainer) -> None:
        """Set the trainer whose inner phases these rounds close."""
        self.trainer = trainer

    # -- the round -------------------------------------------------------------------------------------------------
    def after_inner_step(self, model: nn.Module) -> bool:
        """After each inner step: count it, record the round in flight if its background sync landed (``[outer]
        overlap``), end the round at H steps or the time budget (`end_round`). Returns True when training must stop:
        the run's last round is done, or a stop was requested."""
        self.steps += 1
        faults.point("inner_step_end")
        if self.stop.is_set():
            return True
        if self.overlap is not None:  # the round in flight is recorded as soon as its sync landed (`landed`)
            landed = self.overlap.landed()
            if landed is not None:
                self._record_settled([landed])
        full = self.steps >= self.config.inner_steps or self.out_of_time()
        if full or self.caught_up():
            self.end_round(model, caught_up=not full)
        else:
            self._journal_step(model)
        return self.peer.round >= self.config.rounds or self.stop.is_set()

    def start_inner_phase(self, model: nn.Module | None = None) -> None:
        """Step 5 (and the first phase's start): ``seconds`` and the clock's parts count from now; the journal keeps
        ``model``'s weights as the phase's start."""
        self.clock.take()
        self.steps = 0
        self.resumed = None
        self.started = time.monotonic()
        if self.journal is not None and model is not None:
            self.journal.begin_phase(model)
        self.host.round_phase("inner")

    def resume(self, model: nn.Module) -> Resumed | None:
        """At a life's first inner phase (after `start_inner_phase`): go on from the phase its last life was cut in,
        and re-send the phase it handed off whose round the swarm averaged without it, if its journal is there to take
        (`PhaseJournal.resume`): their progress on this theta, the inner optimizer's state, the cut phase's steps
        counted in this phase and both phases' episodes in this phase's weight."""
        if self.journal is None or self.trainer is None or self.trainer.optimizer is None:
            return None
        self.resumed = self.journal.resume(model, self.trainer.optimizer, self.training_round(),
                                           averaged_with_me=self._averaged_with_me)
        if self.resumed is not None:
            self.steps = self.resumed.steps
        return self.resumed

    def _averaged_with_me(self, round_: int) -> bool:
        """Whether a group that averaged ``round_`` counted this node (`Swarm.averaged_with`). A read that finds no
        record is tried twice more (a read under load can miss one: re-sending a phase that reached the model would
        count it twice); a failed read answers True (not re-sent: a phase lost, never one counted twice)."""
        swarm = self.peer.swarm
        for attempt in range(3):
            try:
                names = swarm.averaged_with(round_)
            except Exception as e:
                log.info("%s: reading who averaged round %d failed (%r): its handed-off phase is not re-sent",
                         swarm.name, round_, e)
                return True
            if names is not None:
                return swarm.name in names
            if attempt < 2:
                self.stop.wait(0.3)
        return False

    def _journal_step(self, model: nn.Module) -> None:
        """After an inner step that did not end the phase: its journal entry (a failed write: a WARNING, once)."""
        if self.journal is None or not self.journal.active:
            return
        r, round_ = self.resumed, self.training_round()
        try:
            self.journal.record_step(model, self.trainer.optimizer, round_, self.steps,
                                     self.trainer.round_stats.samples + (r.total_samples if r else 0),
                                     time.monotonic() - self.started + (r.total_seconds if r else 0.0))
        except OSError as e:
            log.warning("%s: the inner phase journal could not be written (%s): it is off for this life",
                        self.peer.swarm.name, e)
            self.journal.active = False
            return
        if faults.installed().faults:  # a fault that kills the node here finds the step written
            self.journal.flush()
            faults.point("inner_step_journaled", round_, steps=self.steps)

    def out_of_time(self) -> bool:
        """True once this inner phase has used ``network.round_budget_s`` (never when it is unset)."""
        budget = self.config.network.round_budget_s
        return budget is not None and time.monotonic() - self.started >= budget

    def caught_up(self) -> bool:
        """True when this phase catches up (``catch_up``, or every phase with ``network.round_ends_at_first_ready``)
        and another node announced its round ready: the phase ends now rather than hold that node at the barrier. One
        DHT read per inner step, in such phases only."""
        if not (self.catch_up or self.config.network.round_ends_at_first_ready):
            return False
        me, round_ = self.peer.swarm.name, self.training_round()
        try:
            ready = self.peer.swarm.ready_peers(round_)
        except Exception as e:  # a failed read: train on, the next step reads again
            log.debug("%s: reading round %d's ready records failed: %r", me, round_, e)
            return False
        early = sorted(n for n, v in ready.items() if n != me and v.get("role") == "node")
        if early:  # every round with round_ends_at_first_ready: not news then
            log.log(logging.INFO if self.catch_up else logging.DEBUG, "%s: caught up with round %d after %d of %d "
                    "inner steps (%s ready)", me, round_, self.steps, self.config.inner_steps, ", ".join(early))
        return bool(early)

    def training_round(self) -> int:
        """The round the current inner phase trains: the peer's round, or with ``[outer] overlap`` and a round in
        flight the one after it (the peer's round moves on only when the background outer step lands, so until then
        the others' ready records of the round in flight are not this phase's)."""
        flight = self.overlap.in_flight if self.overlap is not None else None
        return self.peer.round if flight is None else flight + 1

    def end_round(self, model: nn.Module, caught_up: bool = False) -> None:
        """Steps 1 to 5 of the module docstring, blocking or overlapped; ``caught_up``: a late joiner's first phase
        ended early (`caught_up`), recorded in its metrics line.

        Raises:
            ArchitectureMismatch: from the sync (a peer's state of another model).
        """
        progress = None
        if self.journal is not None:  # the phase's progress, before any fold moves x; its last step's entry goes
            progress = self.journal.progress(model)
            self.journal.end_phase()
        phase = self._close_inner_phase(caught_up)                              # 1.
        if self.overlap is None:
            self._journal_hand_off(phase.round, progress, phase)  # in the journal until its sync settles
            result = self.peer.sync(model, phase.weight, stop=self.stop)        # 2. ... theta loaded
            if result is None:
                return  # stopped at the barrier: no record, no new phase (the journal keeps the phase)
            if self.journal is not None:
                self.journal.settled(phase.round)
            self.trainer.refresh_reference()                                    # 3.
            phase.blocked_seconds = time.monotonic() - phase.ended
            self.host.round_ended(result, phase, None)                          # 4.
        else:
            out = self.overlap.end_round(model, phase.weight)                   # 2. fold round r-1, hand round r off
            if out.handed_off is not None:
                self._handed_off[out.handed_off] = phase
                self._journal_hand_off(out.handed_off, progress, phase)
            else:
                if self.journal is not None:  # dropped: theta loaded, nothing of the phase is to be re-sent
                    self.journal.discard()
                if out.settled:
                    log.warning("%s: the inner phase of %d steps was dropped (theta of round %d loaded)",
                                self.peer.swarm.name, phase.steps, self.peer.round)
            phase.blocked_seconds = time.monotonic() - phase.ended
            self._record_settled(out.settled)                                   # 4. the rounds that ended here
            self.trainer.refresh_reference()                                    # 3. the rebase, or theta
        self.start_inner_phase(model)                                           # 5.

    def finish(self, model: nn.Module | None) -> None:
        """The trainer stopped (the run's end, a stop, steps run out): with ``[outer] overlap``, wait for the round in
        flight and load theta into the policy, as the blocking path leaves it, and record that round. At the run's
        end the journal goes (a stop keeps it: the next life resumes it)."""
        if self.journal is not None and self.peer.round >= self.config.rounds:
            self.journal.discard()
        if self.overlap is None:
            return
        entered = time.monotonic()
        done = self.overlap.drain(model)
        if done is not None:
            phase = self._handed_off.get(done.round)
            if phase is not None:  # the trainer stood still for this wait too
                phase.blocked_seconds += time.monotonic() - entered
            self._record_settled([done])

    def _journal_hand_off(self, round_: int, progress: list | None, phase: InnerPhase) -> None:
        """Keep the phase handed off for ``round_`` in the journal until its sync settles (`PhaseJournal.hand_off`)."""
        if self.journal is None:
            return
        try:
            self.journal.hand_off(round_, progress, self.trainer.optimizer, int(phase.weight), phase.worked_seconds)
        except OSError as e:
            log.warning("%s: the inner phase journal could not be written (%s): it is off for this life",
                        self.peer.swarm.name, e)
            self.journal.discard()
            self.journal.active = False
            return
        if faults.installed().faults:  # a fault that kills the node in the sync finds the hand-off written
            self.journal.flush()

    def _close_inner_phase(self, caught_up: bool) -> InnerPhase:
        self.catch_up = False  # a joiner's first phase only: from the next round on it starts with the others
        parts = self.clock.take()
        ended = time.monotonic()  # what follows is the round's end: the inner loop stands still from here
        self.host.round_phase("sync")
        phase = InnerPhase(round=self.peer.round, stats=self.trainer.take_round_stats(), steps=self.steps,
                           seconds=ended - self.started, parts=parts, ended=ended, caught_up=caught_up,
                           resumed=self.resumed)
        self.host.inner_phase_ended(phase)
        return phase

    def _record_settled(self, settled: list) -> None:
        """Record each background round that ended (`composer_diloco.outer.overlap.Settled`), once: a round recorded
        when its sync landed (`after_inner_step`) is not recorded again at its fold; a dropped phase was never handed
        off and has no record of its own."""
        for done in settled:
            if self.journal is not None:  # before its line: a phase is re-sent or recorded, never both
                self.journal.settled(done.round)
            phase = self._handed_off.pop(done.round, None)
            if done.result is not None and phase is not None:
                self.host.round_ended(done.result, phase, done.fold)


def follow_rounds(peer: DiLoCoPeer, rounds: int, stop: threading.Event,
                  round_ended: Callable[[SyncResult], Any]) -> None:
    """The coordinator's rounds, until ``rounds`` or ``stop``: step 2 with no policy (a zero pseudo-gradient of weight
    0, the same mean and outer step as every node), then ``round_ended(result)`` (its metrics line, checkpoints).

    Raises:
        ArchitectureMismatch: from `DiLoCoPeer.sync`.
    """
    while peer.round < rounds and not stop.is_set():
        result = peer.sync(None, 0.0, stop=stop)
        if result is None:
            return  # stopped at the barrier
        round_ended(result)
