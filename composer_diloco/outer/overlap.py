"""Overlapped sync (``[outer] overlap = true``): a round's barrier, all-reduce and outer step run in a background
thread while the node plays and trains the next round; the new theta is folded in one round late.

The rule (one outer step of delay; Streaming DiLoCo's overlap, arXiv 2501.18512 section 2.3, and the delayed
outer gradients of Kale et al., "Eager Updates For Overlapped Communication and Computation in DiLoCo", arXiv
2502.12996), per node, with theta_t the global model at the start of round t and x the node's local weights:

    end of round t's inner phase, local weights x_t:
        Delta_t = theta_t - x_t                       (a copy, into the averager's buffers: `DiLoCoPeer.hand_off`)
        background: barrier -> all-reduce -> theta_{t+1} = OuterOpt(theta_t, mean Delta_t)   (`DiLoCoPeer.complete`)
        foreground: train round t+1 on from x_t
        background, first: the anchor a = theta_t - Delta_t = x_t (fp32 CPU, up to rounding; from the averager's
                    buffers, not the policy: `DiLoCoPeer.handed_off_weights`); once theta_{t+1} is there, the
                    correction c = theta_{t+1} - a
    end of round t+1's inner phase, local weights x':
        wait for theta_{t+1} (the only seconds the inner loop is blocked, plus the hand-off)
        x <- x' + c = theta_{t+1} + (x' - a)           (rebase: the overlapped round's progress on the new theta)
        Delta_{t+1} = theta_{t+1} - x = a - x'         (exactly the overlapped inner phase's own update)

So each round's pseudo-gradient is still the local update of one inner phase of H steps, as in DiLoCo
(arXiv 2311.08105); only its starting point is one outer step stale, corrected by the rebase as soon as the late
theta arrives. Why this rule and not the others:
- Streaming DiLoCo merges with a mixing factor, x <- alpha * x' + (1 - alpha) * theta_{t+1}: that keeps only part
  of the overlapped phase's progress and pulls the replicas toward theta by the rest; the rebase keeps all of it and
  makes the next pseudo-gradient exactly that phase's update, so theta's trajectory is DiLoCo's with a one-round
  stale starting point, nothing else.
- Eager updates apply the node's own fresh Delta_t (scaled by 1/M) as a proxy before the average arrives: that
  needs an outer-optimizer step on non-averaged data on each node (its momentum would then differ per node) and
  a correction later; more state for a gain the learning bench has not shown here yet.
- theta itself stays a pure function of all-reduced data, the outer step and recovery's rules
  (`composer_diloco.outer.peer`, `composer_diloco.outer.recovery`): only the node's local replica gets the delayed
  fold-in, so peers agree on theta bit for bit every round, as in blocking mode.

Failure behaviour (fail closed): a background round that ends in any way but "averaged" into the round after the
one handed off (recovery's "resynced", "alone", "skipped", a heal, a stop, an exception) drops the overlapped
local progress: the policy loads theta as the blocking path does, and no pseudo-gradient is handed off for the
dropped phase (a zero one weighted by its samples would dilute the average). The node's next inner phase then
trains the round the peer is in. An exception of the background thread (`ArchitectureMismatch`) is raised in the
foreground at the next fold. At the end of training (the run's end, a stop) the in-flight round is waited for (at
most ``DiLoCoPeer.allreduce_timeout_s`` x 2 + 10 s; on a stop (SIGTERM) at most ``STOP_JOIN_S``, then given up as failed) and
theta is loaded, so the final policy is theta, as in blocking mode; `OverlappedSync.close` (a cleanup, run before the
averager is shut down) joins the thread the same way.
The coordinator has no inner phase: it always syncs blocking.

Threads: the policy is touched only in the foreground (the trainer's thread): `hand_off` reads it, the fold writes
it; the background reads and writes only the averager's buffers, theta, the outer optimizer state and the DHT
records, and the foreground touches none of them while a round is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from composer_diloco.outer.peer import DiLoCoPeer, SyncResult

log = logging.getLogger(__name__)

STOP_JOIN_S = 3.0  # seconds a stopping node waits for its background round (the hard exit comes at 8 s)

Fold = Literal["rebased", "dropped", "final"]
"""How a settled background round reached the policy: "rebased" (x <- theta + (x' - a)), "dropped" (the overlapped
progress dropped, theta loaded: fail closed) or "final" (theta loaded at the end of training)."""


@dataclass
class Settled:
    """A background round that ended.

    Attributes:
        round: the round handed off.
        result: its `SyncResult` (None: stopped at the barrier, or the thread raised).
        fold: how theta reached the policy (`Fold`).
    """

    round: int
    result: SyncResult | None
    fold: Fold


@dataclass
class RoundEnd:
    """What `OverlappedSync.end_round` did at the end of an inner phase.

    Attributes:
        settled: background rounds that ended here, oldest first (0, 1, or 2 when the last round was waited for too).
        handed_off: the round whose sync now runs (or ran, for the run's last round); None when the phase's
            progress was dropped (fail closed) and nothing was handed off.
    """

    settled: list[Settled] = field(default_factory=list)
    handed_off: int | None = None


@dataclass
class _InFlight:
    round: int
    anchor: list[torch.Tensor]  # a = the policy's trainable params at the hand-off (fp32 CPU), then theta_{t+1} - a
    thread: threading.Thread
    result: SyncResult | None = None
    error: BaseException | None = None
    reported: bool = False  # `OverlappedSync.landed` gave it out


class OverlappedSync:
    """A node's overlapped sync pipeline (module docstring): at most one round in flight.

    Args:
        peer: the node's `DiLoCoPeer`.
        stop: the node's stop event (a background barrier gives up when it is set).
    """

    def __init__(self, peer: DiLoCoPeer, stop: threading.Event):
        self.peer, self.stop = peer, stop
        self._inflight: _InFlight | None = None
        self.join_timeout_s = 2 * peer.allreduce_timeout_s + 10.0

    @property
    def in_flight(self) -> int | None:
        """The round whose sync runs in the background, or None."""
        return None if self._inflight is None else self._inflight.round

    def landed(self) -> Settled | None:
        """The round in flight once its background sync has ended, reported once: a `Settled` with the fold
        `end_round` will apply to it at the end of this inner phase (``"rebased"``, or ``"dropped"`` when it did not
        end "averaged" into the next round), so the node can record the round now instead of one phase later, where a
        kill in between would leave a pseudo-gradient that reached theta with no record. Never blocks; the fold itself
        still happens in `end_round` (a stop before it loads theta instead, as `drain` does).

        Returns:
            None while the sync runs, when nothing is in flight, when this round was reported already, and when the
            background thread raised (the error is raised at the fold).
        """
        flight = self._inflight
        if flight is None or flight.reported or flight.thread.is_alive() or flight.result is None \
                or flight.error is not None:
            return None
        flight.reported = True
        return Settled(flight.round, flight.result, self._fold(flight))

    def end_round(self, model: nn.Module, weight: float) -> RoundEnd:
        """At the end of an inner phase: fold in the round in flight, then hand this phase's round off.

        Args:
            model: the policy (any device/dtype); read, and rebased or reloaded in place.
            weight: samples it trained on in the phase that just ended.
        Returns:
            A `RoundEnd`. The run's last round is waited for here and theta loaded (fold "final").
        Raises:
            ArchitectureMismatch: raised by the background round (a peer's state of another model).
        """
        out = RoundEnd()
        if self._inflight is not None:
            done = self._wait()
            if self._fold(done) == "dropped":
                if done.result is not None:
                    log.warning("%s: the overlapped round %d ended %s (round %d now): dropping this phase's local "
                                "progress and loading theta", self.peer.swarm.name, done.round, done.result.status,
                                self.peer.round)
                self.peer.load_theta_into(model)
                out.settled.append(Settled(done.round, done.result, "dropped"))
                return out
            _apply_correction(model, done.anchor)  # the background turned a into theta_{t+1} - a
            out.settled.append(Settled(done.round, done.result, "rebased"))
        if self.peer.round >= self.peer.config.rounds or self.stop.is_set():
            self.peer.load_theta_into(model)
            return out
        self._start(model, weight)
        out.handed_off = self._inflight.round
        if self.peer.round + 1 >= self.peer.config.rounds:  # the run's last round: nothing left to overlap with
            out.settled.append(self.drain(model))
        return out

    def drain(self, model: nn.Module | None) -> Settled | None:
        """Wait for the round in flight (if any) and load theta into ``model`` (fold "final"); None when nothing was in
        flight. Called at the end of training (the run's end, a stop) and for the run's last round.

        Raises:
            ArchitectureMismatch: raised by the background round.
        """
        done = self._wait() if self._inflight is not None else None
        if model is not None:
            self.peer.load_theta_into(model)
        return None if done is None else Settled(done.round, done.result, "final")

    def close(self) -> None:
        """Join the background thread (at most ``join_timeout_s``); idempotent, never raises (a cleanup)."""
        flight, self._inflight = self._inflight, None
        if flight is not None:
            flight.thread.join(STOP_JOIN_S if self.stop.is_set() else self.join_timeout_s)
            if flight.thread.is_alive():
                log.warning("%s: the background sync of round %d did not end within %.0f s", self.peer.swarm.name,
                            flight.round, self.join_timeout_s)

    # -- internals ------------------------------------------------------------------------------------------
    def _fold(self, done: _InFlight) -> Fold:
        """How a round whose background sync ended reaches the policy: "rebased" when theta is the outer step of
        exactly the round handed off, else "dropped" (fail closed; also when it has no result). The one rule of
        `end_round` and `landed`."""
        r = done.result
        normal = r is not None and r.status == "averaged" and r.round == done.round \
            and self.peer.round == done.round + 1
        return "rebased" if normal else "dropped"

    def _start(self, model: nn.Module, weight: float) -> None:
        handoff = self.peer.hand_off(model, weight)
        flight = _InFlight(round=handoff.round, anchor=[], thread=None)  # type: ignore[arg-type]

        def run() -> None:
            try:
                # the anchor off the trainer's critical path too: one theta-sized pass less in the foreground
                flight.anchor = self.peer.handed_off_weights()
                flight.result = self.peer.complete(handoff, stop=self.stop)
                if flight.result is not None and flight.result.status == "averaged":
                    with self.peer.theta_lock:  # off the trainer's critical path: the fold is then one add per element
                        _correction(self.peer.global_model.params, flight.anchor)
            except BaseException as e:  # raised in the foreground at the next fold
                flight.error = e

        flight.thread = threading.Thread(target=run, name=f"overlap-sync-{handoff.round}", daemon=True)
        self._inflight = flight
        flight.thread.start()

    def _wait(self) -> _InFlight:
        flight, self._inflight = self._inflight, None
        started = time.monotonic()
        # on a stop the barrier gives up at once; an all-reduce under way is not waited out (the hard exit would come
        # first): its round is failed closed
        flight.thread.join(STOP_JOIN_S if self.stop.is_set() else self.join_timeout_s)
        if flight.thread.is_alive():
            log.error("%s: the background sync of round %d is still running after %.0f s: treating it as failed",
                      self.peer.swarm.name, flight.round, time.monotonic() - started)
            return flight  # result None: the caller fails closed
        if flight.error is not None:
            raise flight.error
        return flight


@torch.no_grad()
def _correction(theta: list[torch.Tensor], anchor: list[torch.Tensor]) -> None:
    """anchor <- theta - anchor, in place (fp32 CPU tensors of one layout): the rebase's correction c = theta_{t+1} - a,
    computed in the background thread."""
    for g, a in zip(theta, anchor, strict=True):
        torch.sub(g, a, out=a)


@torch.no_grad()
def _apply_correction(model: nn.Module, correction: list[torch.Tensor]) -> None:
    """x <- x + c for each trainable parameter x of ``model`` (c cast to x's dtype and device): with
    c = theta_{t+1} - a (`_correction`) this is the rebase x <- theta_{t+1} + (x - a), up to fp32 rounding (bf16: the
    parameter's)."""
    local = [p for p in model.parameters() if p.requires_grad]
    for p, c in zip(local, correction, strict=True):
        p.add_(c.to(device=p.device, dtype=p.dtype))


__all__ = ["Fold", "OverlappedSync", "RoundEnd", "Settled"]
