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

At the phase's end the journal is removed *before* the phase's pseudo-gradient is handed to the sync
(`PhaseJournal.discard`), so a phase is either in the journal or handed off, never both: no work is counted twice.

The next life, once it holds theta_R of the round it joins (`PhaseJournal.resume`, at its first inner phase's start),
takes a journal of the same run config, the same trainable layout and a round J with ``R - S <= J <= R``, S being
``[inner] journal_max_stale_rounds`` (2: INTELLECT-2's bound on the policy staleness of its rollouts):

    x <- theta_R + p           the cut phase's progress on the newer theta (as the rebase of
                               `composer_diloco.outer.overlap`, one or two outer steps stale: a delayed local update,
                               as in asynchronous local SGD)
    AdamW's state restored; the phase goes on with the journal's steps counted, and its pseudo-gradient, theta_R - x at
    its end, weighs the journal's samples plus its own

A journal of another config or layout, or too stale, is set aside with one INFO line and the life starts as before. The
journal costs one copy of the trainable parameters per phase (x0) and, per step, the progress and the optimizer state
copied to the CPU and written: 12 bytes a trainable parameter (fp32 progress, AdamW's two moments). It is kept only
while that is at most ``[inner] journal_max_bytes`` (1 GiB: the embedded default's 11 MB, a LoRA adapter of an 8B model;
a full fine-tuning of 0.6B parameters, 7 GB a step, is not journaled unless asked for).
"""

from __future__ import annotations

import logging
import os
import threading
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
    """Bytes one journal entry of ``model`` takes: 12 a trainable parameter (fp32 progress, AdamW's two moments)."""
    return 12 * sum(p.numel() for p in _trainable(model))


@dataclass(frozen=True)
class Resumed:
    """What a life took over from its last life's journal (`PhaseJournal.resume`).

    Attributes:
        round: the round the journaled phase trained (J).
        steps: its inner steps.
        samples: its episodes (part of the resumed phase's all-reduce weight).
        seconds: its inner-loop seconds, spent by the last life.
    """

    round: int
    steps: int
    samples: int
    seconds: float

    def record(self) -> dict:
        """Its keys of the resumed phase's metrics line: ``resumed_round``, ``resumed_steps``, ``resumed_samples``,
        ``resumed_inner_seconds`` (seconds, 3 decimals)."""
        return {"resumed_round": self.round, "resumed_steps": self.steps, "resumed_samples": self.samples,
                "resumed_inner_seconds": round(self.seconds, 3)}


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
        # the writer thread: the newest entry not yet written, the phase it belongs to (`discard` moves it on)
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

    def record_step(self, model: nn.Module, optimizer: Any, round_: int, steps: int, samples: int,
                    seconds: float) -> None:
        """After an inner step: write the phase's progress and the optimizer's state (module docstring).

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
        if not self.active or self._start is None or optimizer is None:
            return
        with torch.no_grad():
            progress = [p.detach().to("cpu", torch.float32) - s for p, s in zip(_trainable(model), self._start,
                                                                                  strict=True)]
        state = _to_cpu(optimizer.state_dict())
        entry = {"digest": self.digest, "round": round_, "steps": steps, "samples": samples, "seconds": seconds,
                 "shapes": [tuple(t.shape) for t in progress], "progress": progress, "optimizer": state}
        with self._cond:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._pending = {"phase": self._phase, "entry": entry}
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="inner-phase-journal", daemon=True)
                self._writer.start()
            self._cond.notify_all()

    def discard(self) -> None:
        """The phase ends: remove the journal before its pseudo-gradient is handed off (never resumed twice). An
        entry not yet written is dropped, and one being written is waited for, then removed."""
        self._start = None
        with self._cond:
            self._phase += 1
            self._pending = None
            while self._writing:
                self._cond.wait()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _write_loop(self) -> None:
        """The writer thread: write the newest entry, whole (a temporary file renamed), unless its phase ended."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                job, self._pending, self._writing = self._pending, None, True
            try:
                torch.save(job["entry"], tmp)
                with self._cond:
                    if job["phase"] == self._phase:  # else its phase ended while it was written: never resumed
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

    def resume(self, model: nn.Module, optimizer: Any, round_: int) -> Resumed | None:
        """At a life's first inner phase, on theta of round ``round_`` in ``model``: take the last life's journal if
        there is one to take (module docstring): x <- x + p, the optimizer's state loaded. Call after `begin_phase`
        (x0 stays theta: the next steps' progress includes the journal's). The journal file is left for the next
        `record_step` to replace.

        Returns:
            What was resumed, or None (no journal, or one set aside: logged at INFO).
        """
        if not self.active or not self.path.exists():
            return None
        try:
            entry = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as e:  # a file of another version, a cut write of an older code: the life starts anew
            log.info("inner phase journal %s not resumed: it does not load (%s: %s)", self.path, type(e).__name__, e)
            return None
        local = _trainable(model)
        why = None
        if entry.get("digest") != self.digest:
            why = "it is of another run config"
        elif entry.get("shapes") != [tuple(p.shape) for p in local]:
            why = "its parameters' layout differs"
        elif not round_ - self.max_stale_rounds <= entry["round"] <= round_:
            why = (f"it trained round {entry['round']}, this life joins round {round_} (at most "
                   f"{self.max_stale_rounds} apart: [inner] journal_max_stale_rounds)")
        if why is not None:
            log.info("inner phase journal %s not resumed: %s", self.path, why)
            return None
        with torch.no_grad():
            for p, d in zip(local, entry["progress"], strict=True):
                p.add_(d.to(device=p.device, dtype=p.dtype))
        optimizer.load_state_dict(entry["optimizer"])
        resumed = Resumed(int(entry["round"]), int(entry["steps"]), int(entry["samples"]), float(entry["seconds"]))
        log.info("resumed the inner phase of round %d its last life was cut in: %d steps, %d episodes, %.1f s of work "
                 "kept (%s)", resumed.round, resumed.steps, resumed.samples, resumed.seconds, self.path)
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
