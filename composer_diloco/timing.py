"""Where a round's seconds go: `PhaseClock` counts every wall second of a phase of work in exactly one named phase.

A node keeps one clock for its inner phase (`nodes.node.Node`): the trainer, the rollout and the loss channels open
phases on it (``with clock.phase("env"): ...``); a phase opened inside another one takes its seconds from the outer
one (exclusive time), and the seconds outside every opened phase go to the clock's base phase. So the phases of a
round add up to the round's wall time by construction, and the metrics line's ``inner_phase_seconds`` checks itself
against ``inner_seconds``, which the node measures on its own clock.

On a CUDA device the clock synchronizes the device at every phase boundary (``torch.cuda.synchronize``), so that work
queued by one phase is not counted in the next; the boundaries are a few per micro-batch and one per env call, and
most of them already wait on the device (a sampled turn is copied to the host, a loss is read with ``.item()``), so
the cost is the few boundaries that would otherwise overlap host and device work. Units: seconds, float.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["INNER_PHASES", "JOIN_PHASES", "PhaseClock", "cuda_sync_for"]

INNER_PHASES = {
    "generation": "the policy decoding the episodes' turns (with tokenizing the contexts and parsing the calls)",
    "env": "env resets and tool calls of the rollout (continuous batching: only while no turn is decoding)",
    "scoring": "TRL scoring the step's episodes: rewards, advantages, its own log-prob passes (the KL reference's "
               "when [grpo] beta > 0)",
    "sdpo": "the SDPO channel's build: error sites, hinted teacher rows, verification replays",
    "dpo": "the DPO channel's build: candidate samples, env replays, pairs, reference log-probs",
    "forward_backward": "forward and backward of every micro-batch: TRL's GRPO loss plus the channels' terms",
    "optimizer": "AdamW's step",
    "trainer": "transformers' Trainer between these: data loading, gradient clipping, logging, callbacks",
}
"""The parts of a node's inner phase (`PhaseClock` phases; the metrics line's ``inner_phase_seconds``)."""

JOIN_PHASES = {
    "imports": "the process's start to the join: Python, torch, transformers, TRL, hivemind (absent for a standby's "
               "takeover, whose process imported them while it waited)",
    "dht": "the DHT peer's start (its p2pd, the bootstrap, re-dials while no --peer answers) and the run config's read",
    "plan": "the memory plan (its tokenizer and the env package's demonstrations)",
    "env": "this node's env servers up and their sessions open (a reset each)",
    "model": "the policy's skeleton: the architecture, and the base weights of a --model or [lora] run, on the CPU",
    "averager": "the DiLoCo peer: hivemind's averager process and the outer optimizer's state",
    "state": "the global model's download, the wait for the round boundary, theta into the placed policy",
    "trainer": "TRL's trainer built and its train() set up (the optimizer, accelerate's wrapping, the dataloader)",
    "join": "the rest: option checks, the task file, the swarm's records",
}
"""The parts of a node's join, from its process's start (or a standby's takeover) to its first inner phase: a
`PhaseClock` with base ``"join"``, logged once and written in the life's first metrics line (``join_seconds``)."""


def cuda_sync_for(device: str | object) -> Callable[[], None] | None:
    """``torch.cuda.synchronize`` bound to ``device`` when it is a CUDA device, else None (a CPU's work is done when
    its call returns)."""
    name = str(device)
    if not name.startswith("cuda"):
        return None
    import torch

    return lambda: torch.cuda.synchronize(name)


class PhaseClock:
    """Exclusive wall seconds by phase name, for one thread of work.

    Args:
        base: the phase that gets every second outside an opened phase (the node's: ``"trainer"``, TRL's and
            transformers' own work between ours: data loading, gradient clipping, logging, callbacks).
        sync: called at every phase boundary before reading the time (`cuda_sync_for`); None: no call.
        clock: the time source, seconds (``time.perf_counter``).

    Phases are opened from one thread only (the first that opens one): work that overlaps in other threads (env calls in
    a thread pool while the model decodes) is counted by what the owning thread waits on (`composer_diloco.rollout.
    continuous`: ``env`` only while no turn is decoding).
    """

    def __init__(self, base: str = "trainer", *, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.base, self._sync, self._clock = base, sync, clock
        self._stack: list[str] = [base]
        self._seconds: dict[str, float] = {}
        self._last = clock()
        self._owner: int | None = None  # the thread that opens phases: the first one that does

    def _charge(self) -> None:
        """Give the seconds since the last boundary to the innermost open phase."""
        if self._sync is not None:
            self._sync()
        now = self._clock()
        top = self._stack[-1]
        self._seconds[top] = self._seconds.get(top, 0.0) + now - self._last
        self._last = now

    def enter(self, name: str) -> None:
        """Open phase ``name``: the seconds from now go to it until `exit` (or a phase opened inside it).

        Raises:
            RuntimeError: called from another thread than the one that opened the clock's first phase.
        """
        if self._owner is None:
            self._owner = threading.get_ident()
        elif threading.get_ident() != self._owner:
            raise RuntimeError(f"phase {name!r} opened from another thread than the clock's")
        self._charge()
        self._stack.append(name)

    def exit(self, name: str) -> None:
        """Close phase ``name``, the innermost open one.

        Raises:
            RuntimeError: ``name`` is not the innermost open phase (names both), or no phase is open.
        """
        if len(self._stack) < 2 or self._stack[-1] != name:
            raise RuntimeError(f"closing phase {name!r}, but the innermost open phase is {self._stack[-1]!r}")
        self._charge()
        self._stack.pop()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the seconds of the ``with`` body under ``name`` (less the phases opened inside it): `enter` and
        `exit`.

        Raises:
            RuntimeError: called from another thread than the clock's.
        """
        self.enter(name)
        try:
            yield
        finally:
            self.exit(name)

    def take(self) -> dict[str, float]:
        """The seconds by phase since the last `take` (or since the clock was made), and start counting again from
        now. Phases still open keep counting into the next `take`."""
        self._charge()
        out, self._seconds = self._seconds, {}
        return out

    @property
    def current(self) -> str:
        """The innermost open phase (the base when none is open)."""
        return self._stack[-1]
