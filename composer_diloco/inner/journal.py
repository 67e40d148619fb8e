"""The inner phase's journal: a node's progress in the inner phase under way, kept in its folder after every inner step,
so that its next life (a standby's fork, a restart) goes on from the last step instead of losing the phase.

A node killed in the middle of an inner phase loses every step of it: the pseudo-gradient is only handed to the swarm
at the phase's end. At the embedded default that is half a phase of ~4 s; at real size, with H in the tens or
hundreds of steps of seconds each, minutes of accelerator time per crash. After each inner step the node writes
(`PhaseJournal.record_step`, ``<run-dir>/<name>/inner_phase.pt``, whole or not at all):

    progress p = x - x0        the phase's own update so far (fp32, CPU; x0: the trainable parameters at the phase's
                               start, `PhaseJournal.begin_phase`)
    the inner optimizer's state (AdamW's moments and step counts: DiLoCo keeps it on the node across rounds)
    the round the phase trains, its steps, its samples (episodes: the pseudo-gradient's weight) and its seconds

At the phase's end its progress stays in the journal as the phase *handed off* (`PhaseJournal.hand_off`: its round,
progress, samples and seconds) until its sync settles in this life (`PhaseJournal.settled`: the round's average
landed, or this life dropped the phase, failing closed). A kill in between (in the barrier, in the all-reduce, or
with ``[outer] overlap`` anywhere in the next phase before the background sync landed) would otherwise lose the whole
handed-off phase: the swarm averages that round without it.

The next life, once it holds theta_R of the round it joins (`PhaseJournal.resume`, at its first inner phase's start),
takes a journal of the same run config and the same trainable layout:

    the cut phase (round J), when ``R - S <= J <= R``, S being ``[inner] journal_max_stale_rounds`` (2: INTELLECT-2's
    bound on the policy staleness of its rollouts):
        x <- theta_R + p        its progress on the newer theta (as the rebase of `composer_diloco.outer.overlap`,
                                one or two outer steps stale: a delayed local update, as in asynchronous local SGD);
                                AdamW's state restored, the phase goes on with the journal's steps counted
    the handed-off phase (round T), when ``R - S <= T < R`` (the swarm has settled round T) and no group that averaged
    round T counted this node (`Swarm.averaged_with`: every member of a group that averaged a round records the
    group's names in the DHT; a node that died before its sync ended finds out there whether it made it):
        x <- x + p_T            re-sent: the lost round's pseudo-gradient reaches the model one or two rounds late,
                                in this phase's (a straggler's two phases in one, as in asynchronous local SGD)

A handed-off phase that a group did count (its sync landed, or its part of the all-reduce was sent, and the life
died before its round's metrics line) is not re-sent: the next life only records it (``landed_*`` keys of its first
line), since no other line holds those seconds and episodes that reached the model.

The resumed phase's pseudo-gradient, theta_R - x at its end, weighs the journal's samples (both phases') plus its
own. A journal of another config or layout, or too stale, is set aside with one INFO line and the life starts as
before. A phase is either in the journal or reached the model, never both: a handed-off phase that a group averaged
with this node in it is not re-sent, and a phase's last step's entry is removed before the phase is handed off
(`PhaseJournal.end_phase`; the hand-off's entry is written a moment later: a kill in between loses it, never counts it
twice).

The journal costs, per phase, one copy of the trainable parameters (x0) and, while a sync is under way, one of the
handed-off progress; per step, the progress and the optimizer state copied to the CPU and written: 16 bytes a
trainable parameter (fp32 progress of the phase under way and of the phase handed off, AdamW's two moments). It is
kept only while that is at most ``[inner] journal_max_bytes`` (1 GiB: the embedded default's 15 MB, a LoRA adapter
of an 8B model; a full fine-tuning of 0.6B parameters, 9.5 GB a step, is not journaled unless asked for).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["JOURNAL_FILE", "PhaseJournal", "Resumed", "journal_bytes"]

log = logging.getLogger(__name__)

JOURNAL_FILE = "inner_phase.pt"
"""In ``<run-dir>/<name>/``: the journal of the node's inner phase under way."""


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def journal_bytes(model: nn.Module) -> int:
    """Bytes one journal entry of ``model`` takes at most: 16 a trainable parameter (fp32 progress of the phase under
    way and of the phase handed off, AdamW's two moments)."""
    return 16 * sum(p.numel() for p in _trainable(model))


@dataclass(frozen=True)
class Resumed:
    """What a life took over from its last life's journal (`PhaseJournal.resume`).

    Attributes:
        round: the round the cut phase trained (J); None when only a handed-off phase was re-sent.
        steps: the cut phase's inner steps (counted in this life's phase).
        samples: its episodes (part of the resumed phase's all-reduce weight).
        seconds: its inner-loop seconds, spent by the last life.
        resent_round: the round of the handed-off phase whose sync the last life did not see settle and which no
            group averaged with this node in it (T), re-sent in this phase; None: none.
        resent_samples: that phase's episodes (part of the weight too).
        resent_seconds: its inner-loop seconds, spent by the last life.
        landed_round: the round of the handed-off phase that a group averaged with this node in it, though the last
            life died before recording it (no metrics line of that round holds it); None: none. Only recorded: its
            update is in theta already, so it is neither applied nor in this phase's weight.
        landed_samples: that phase's episodes (already in round ``landed_round``'s average).
        landed_seconds: its inner-loop seconds, spent by the last life.
    """

    round: int | None
    steps: int
    samples: int
    seconds: float
    resent_round: int | None = None
    resent_samples: int = 0
    resent_seconds: float = 0.0
    landed_round: int | None = None
    landed_samples: int = 0
    landed_seconds: float = 0.0

    @property
    def total_samples(self) -> int:
        """Episodes of both phases: what the resumed phase's weight adds (`composer_diloco.diloco.InnerPhase.weight`)."""
        return self.samples + self.resent_samples

    @property
    def total_seconds(self) -> float:
        """Inner-loop seconds of both phases, spent by the last life (or lives)."""
        return self.seconds + self.resent_seconds

    def record(self) -> dict:
        """Its keys of the resumed phase's metrics line: ``resumed_round``, ``resumed_steps``, ``resumed_samples``,
        ``resumed_inner_seconds`` (seconds, 3 decimals) for a cut phase; ``resent_round``, ``resent_samples``,
        ``resent_inner_seconds`` for a re-sent one; ``landed_round``, ``landed_samples``, ``landed_inner_seconds``
        for a handed-off phase a group counted whose line was lost with its life."""
        out: dict = {}
        if self.round is not None:
            out.update(resumed_round=self.round, resumed_steps=self.steps, resumed_samples=self.samples,
                       resumed_inner_seconds=round(self.seconds, 3))
        if self.resent_round is not None:
            out.update(resent_round=self.resent_round, resent_samples=self.resent_samples,
                       resent_inner_seconds=round(self.resent_seconds, 3))
        if self.landed_round is not None:
            out.update(landed_round=self.landed_round, landed_samples=self.landed_samples,
                       landed_inner_seconds=round(self.landed_seconds, 3))
        return out


class PhaseJournal:
    """The journal of one node's inner phases (module docstring).

    Args:
        own_dir: ``<run-dir>/<name>``, where ``JOURNAL_FILE`` is kept.
        config_digest: the run config's digest (`RunConfig.digest`): a journal of another config is not resumed.
        max_bytes: ``[inner] journal_max_bytes``; the journal is off (`active` False) for a model whose entry is
            larger (`journal_bytes`), or when it is 0.
        model: the policy (its trainable parameters' count and layout).
        max_stale_rounds: ``[inner] journal_max_stale_rounds``: how far behind the joined round a journal may be.
    """

    def __init__(self, own_dir: Path, config_digest: str, max_bytes: int, model: nn.Module,
                 max_stale_rounds: int = 2):
        self.path = Path(own_dir) / JOURNAL_FILE
        self.digest, self.max_stale_rounds = config_digest, max_stale_rounds
        need = journal_bytes(model)
        self.active = 0 < need <= max_bytes
        if not self.active and max_bytes > 0:
            log.info("inner phase journal off: %.1f MB a step is over [inner] journal_max_bytes (%.1f MB)",
                     need / 1e6, max_bytes / 1e6)
        self._start: list[torch.Tensor] | None = None  # x0, fp32 CPU
        # the phase handed off whose sync has not settled in this life: {"round", "progress", "samples", "seconds"}
        self._handed: dict | None = None
        # the writer thread: the newest entry not yet written, the generation it belongs to (`_invalidate` moves it on)
        self._cond = threading.Condition()
        self._pending: dict | None = None
        self._error: OSError | None = None  # the writer's last failure, raised at the next record_step
        self._phase = 0
        self._writing = False
        self._writer: threading.Thread | None = None
        for tmp in self.path.parent.glob(f".{self.path.name}.tmp-*"):  # a write a kill cut short
            tmp.unlink(missing_ok=True)

    def begin_phase(self, model: nn.Module) -> None:
        """An inner phase starts from ``model``'s weights now: keep them (x0) for the progress of its steps."""
        if self.active:
            self._start = [p.detach().to("cpu", torch.float32, copy=True) for p in _trainable(model)]

    def progress(self, model: nn.Module) -> list[torch.Tensor] | None:
        """The phase's progress p = x - x0 now (fp32, CPU, one tensor per trainable parameter), or None when the
        journal is off or no phase began. Taken at the phase's end before anything moves the weights (the overlapped
        fold), for `hand_off`."""
        if not self.active or self._start is None:
            return None
        with torch.no_grad():
            return [p.detach().to("cpu", torch.float32) - s for p, s in zip(_trainable(model), self._start,
                                                                             strict=True)]

    def record_step(self, model: nn.Module, optimizer: Any, round_: int, steps: int, samples: int,
                    seconds: float) -> None:
        """After an inner step: write the phase's progress and the optimizer's state (module docstring), with the
        phase handed off whose sync has not settled yet.

        Args:
            model: the policy after the step; optimizer: the inner optimizer (its ``state_dict``).
            round_: the round the phase trains; steps, samples: its steps and episodes so far (a resumed phase's
                included); seconds: its inner-loop seconds so far (a resumed phase's included).
        The copies to the CPU are made here; the file is written by a thread of its own (the newest entry replaces
        one not yet written), so the next step does not wait for the disk: 31 ms a step at the embedded default on
        an idle core, of a ~1 s step, when it was written in line.

        Raises:
            OSError: the last write failed (the caller logs it and turns the journal off: it is worth a step, not the
                run).
        """
        progress = self.progress(model)
        if progress is None or optimizer is None:
            return
        self._queue({"round": round_, "steps": steps, "samples": samples, "seconds": seconds, "progress": progress,
                     "optimizer": _to_cpu(optimizer.state_dict())})

    def end_phase(self) -> None:
        """The phase under way ended: its last step's entry goes now, before its pseudo-gradient is handed off (a
        phase is never both cut and handed off in the journal); `hand_off` writes its entry once it is. A kill in
        between loses the phase, never counts it twice."""
        self._start = None
        self._invalidate(remove=True)

    def hand_off(self, round_: int, progress: list[torch.Tensor] | None, optimizer: Any, samples: int,
                 seconds: float) -> None:
        """The phase of ``round_`` was handed to its sync (after `end_phase`): keep its ``progress`` (`progress`,
        taken at its end) in the journal until `settled`, written by the thread. ``samples``/``seconds``: the phase's
        weight and inner-loop seconds, a resumed journal's included. No ``progress`` (the journal off, or no phase
        began): nothing is kept."""
        if progress is None or optimizer is None:
            self._handed = None
            return
        self._handed = {"round": round_, "progress": progress, "samples": samples, "seconds": seconds}
        self._queue({"round": None, "steps": 0, "samples": 0, "seconds": 0.0, "progress": None,
                     "optimizer": _to_cpu(optimizer.state_dict())})

    def settled(self, round_: int) -> None:
        """The sync of ``round_`` settled in this life (averaged, alone, resynced, dropped: this life decided what
        reached the policy): the handed-off phase of that round leaves the journal, now (its file too, when it holds
        nothing else: the next step's entry is written without it)."""
        if self._handed is None or self._handed["round"] != round_:
            return
        self._handed = None
        self._invalidate(remove=True)

    def discard(self) -> None:
        """Remove the journal, the phase handed off included (the run's end, or a phase dropped when its sync failed:
        nothing of it is to be resumed). An entry not yet written is dropped, and one being written is waited for,
        then removed. Idempotent."""
        self._start = None
        self._handed = None
        self._invalidate(remove=True)

    def _queue(self, entry: dict) -> None:
        """Give ``entry`` (with the phase handed off, if any) to the writer thread; raise its last write's error."""
        entry = {"digest": self.digest, **entry, "handed_off": self._handed}
        shapes = entry["progress"] if entry["progress"] is not None else (self._handed or {}).get("progress")
        entry["shapes"] = [tuple(t.shape) for t in shapes or []]
        with self._cond:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._pending = {"phase": self._phase, "entry": entry}
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="inner-phase-journal", daemon=True)
                self._writer.start()
            self._cond.notify_all()

    def _invalidate(self, *, remove: bool) -> None:
        """Entries queued or being written so far are never kept (their generation ends); ``remove``: the file too."""
        with self._cond:
            self._phase += 1
            self._pending = None
            while self._writing:
                self._cond.wait()
            if remove:
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass

    def _write_loop(self) -> None:
        """The writer thread: write the newest entry, whole (a temporary file renamed), unless its generation ended."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                job, self._pending, self._writing = self._pending, None, True
            try:
                torch.save(job["entry"], tmp)
                with self._cond:
                    if job["phase"] == self._phase:  # else it was invalidated while it was written: never resumed
                        os.replace(tmp, self.path)
            except OSError as e:
                self._error = e
            finally:
                tmp.unlink(missing_ok=True)
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def flush(self) -> None:
        """Wait until the newest entry is written (or its write failed)."""
        with self._cond:
            while self._pending is not None or self._writing:
                self._cond.wait()

    def resume(self, model: nn.Module, optimizer: Any, round_: int,
               averaged_with_me: Callable[[int], bool] = lambda r: False) -> Resumed | None:
        """At a life's first inner phase, on theta of round ``round_`` in ``model``: take the last life's journal if
        there is one to take (module docstring): x <- x + p of the cut phase and of the re-sent handed-off phase, the
        optimizer's state loaded. Call after `begin_phase` (x0 stays theta: the next steps' progress includes the
        journal's). The journal file is left for the next `record_step` to replace.

        Args:
            averaged_with_me: round T -> whether a group that averaged round T counted this node
                (`composer_diloco.outer.swarm.Swarm.averaged_with`); asked only for a handed-off phase the swarm has
                settled. The default (False: never) suits a caller with no swarm.
        Returns:
            What was resumed or recorded as landed (`Resumed`), or None (no journal, or one set aside or with
            nothing to take: logged at INFO). A Resumed with only ``landed_round`` changes neither ``model`` nor
            ``optimizer``.
        """
        if not self.active or not self.path.exists():
            return None
        try:
            entry = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as e:  # a file of another version, a cut write of an older code: the life starts anew
            log.info("inner phase journal %s not resumed: it does not load (%s: %s)", self.path, type(e).__name__, e)
            return None
        local = _trainable(model)
        handed = entry.get("handed_off")
        oldest = round_ - self.max_stale_rounds
        why = None
        if entry.get("digest") != self.digest:
            why = "it is of another run config"
        elif entry.get("shapes") != [tuple(p.shape) for p in local]:
            why = "its parameters' layout differs"
        elif entry.get("progress") is not None and not oldest <= entry["round"] <= round_:
            why = (f"it trained round {entry['round']}, this life joins round {round_} (at most "
                   f"{self.max_stale_rounds} apart: [inner] journal_max_stale_rounds)")
        cut = entry.get("progress") is not None and why is None
        resend = landed = False
        if why is None and handed is not None:
            t = int(handed["round"])
            if not oldest <= t < round_:
                log.info("inner phase journal %s: the phase of round %d handed off is not re-sent (this life joins "
                         "round %d: %s)", self.path, t, round_,
                         "its round is not settled yet" if t >= round_ else "too stale")
            elif averaged_with_me(t):
                log.info("inner phase journal %s: round %d's average counted this node's phase (%d episodes, %.1f s "
                         "of work its last life did not record): not re-sent", self.path, t, int(handed["samples"]),
                         float(handed["seconds"]))
                landed = True
            else:
                resend = True
        if why is not None or not (cut or resend or landed):
            if why is not None:
                log.info("inner phase journal %s not resumed: %s", self.path, why)
            return None
        if cut or resend:
            with torch.no_grad():
                for i, p in enumerate(local):
                    add = (entry["progress"][i] if cut else 0) + (handed["progress"][i] if resend else 0)
                    p.add_(add.to(device=p.device, dtype=p.dtype))
            optimizer.load_state_dict(entry["optimizer"])
        resumed = Resumed(int(entry["round"]) if cut else None, int(entry["steps"]) if cut else 0,
                          int(entry["samples"]) if cut else 0, float(entry["seconds"]) if cut else 0.0)
        if resend or landed:  # the handed-off phase: re-sent in this phase, or only recorded
            t, n, seconds = int(handed["round"]), int(handed["samples"]), float(handed["seconds"])
            resumed = (dataclasses.replace(resumed, resent_round=t, resent_samples=n, resent_seconds=seconds) if resend
                       else dataclasses.replace(resumed, landed_round=t, landed_samples=n, landed_seconds=seconds))
        if cut:
            log.info("resumed the inner phase of round %d its last life was cut in: %d steps, %d episodes, %.1f s of "
                     "work kept (%s)", resumed.round, resumed.steps, resumed.samples, resumed.seconds, self.path)
        if resend:
            log.info("re-sent the inner phase of round %d whose sync its last life did not see end (no group averaged "
                     "it): %d episodes, %.1f s of work kept (%s)", resumed.resent_round, resumed.resent_samples,
                     resumed.resent_seconds, self.path)
        return resumed


def _to_cpu(obj: Any) -> Any:
    """``obj`` (an optimizer's state dict) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
