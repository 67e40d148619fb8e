"""Fault injection for the fault-tolerance tests: real signals and real corruption at chosen points of a run.

Off unless the environment variable ``COMPOSER_DILOCO_FAULTS`` is set (the tests set it on one process). It is
a comma-separated list of faults, each ``kind`` or ``kind:round`` or ``kind:round:value``:

    kill_in_allreduce:R        SIGKILL this peer (its whole process group) after it sent the first part of its
                               pseudo-gradient in round R's all-reduce
    kill_in_reply:R            as a reducer in round R's all-reduce, return the averaged parts to one peer only,
                               then SIGKILL this peer: the survivors hold different averages
    kill_in_checkpoint:R       SIGKILL the coordinator after it wrote checkpoint R's files, before the rename
    step_delay:*:S             sleep S seconds after every inner step (a slow node)
    scale_pseudo_gradient:R:F  multiply this node's pseudo-gradient of round R by F (a norm outlier)
    nan_pseudo_gradient:R      put a NaN into this node's pseudo-gradient of round R
    hold:*:PATH                after every inner step, wait while the file PATH exists (a test pauses a node
                               until something else has happened, whatever the machine's load)

``R`` may be ``*`` (every round). Everything here is a no-op when the variable is unset; the variable is parsed
once per distinct value.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

ENV_VAR = "COMPOSER_DILOCO_FAULTS"
KINDS = ("kill_in_allreduce", "kill_in_reply", "kill_in_checkpoint", "step_delay", "scale_pseudo_gradient",
         "nan_pseudo_gradient", "hold")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` at ``round`` (None = every round) with an optional ``value`` (a number, or
    the file path of ``hold``)."""

    kind: str
    round: int | None
    value: float | str | None


@lru_cache(maxsize=8)
def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse ``COMPOSER_DILOCO_FAULTS``. Raises ValueError naming the bad entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        kind, _, rest = entry.partition(":")
        round_text, _, value_text = rest.partition(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV_VAR}: unknown fault {kind!r} in {entry!r} (expected one of {', '.join(KINDS)})")
        try:
            round_ = None if round_text in ("", "*") else int(round_text)
            value = value_text if kind == "hold" else float(value_text) if value_text else None
        except ValueError:
            raise ValueError(f"{ENV_VAR}: bad entry {entry!r} (expected kind:round[:value])") from None
        faults.append(Fault(kind, round_, value))
    return tuple(faults)


def active(kind: str, round_: int | None = None) -> Fault | None:
    """The fault of this kind set for ``round_`` in this process's environment, or None."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return None
    for fault in parse_faults(text):
        if fault.kind == kind and (fault.round is None or round_ is None or fault.round == round_):
            return fault
    return None


def kill_this_peer(reason: str, *, from_child: bool = False) -> None:
    """SIGKILL this peer: its process group when the peer leads one (node, DHT, averager, p2pd die at once).

    Args:
        from_child: called in a child process of the peer (hivemind's averager): the parent is killed too.
    """
    log.warning("fault injection: SIGKILL (%s)", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    leader = os.getppid() if from_child else os.getpid()
    if os.getpgid(0) == leader:
        os.killpg(leader, signal.SIGKILL)
    if from_child:
        os.kill(leader, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def after_inner_step() -> None:
    """Sleep ``step_delay`` seconds (a slow node); wait while the ``hold`` file exists."""
    fault = active("step_delay")
    if fault is not None and fault.value:
        time.sleep(float(fault.value))
    hold = active("hold")
    if hold is not None and hold.value:
        while os.path.exists(str(hold.value)):
            time.sleep(0.2)


def corrupt_pseudo_gradient(round_: int, delta: Sequence[torch.Tensor]) -> None:
    """Apply ``scale_pseudo_gradient`` / ``nan_pseudo_gradient`` of this round to ``delta`` in place."""
    scale = active("scale_pseudo_gradient", round_)
    if scale is not None:
        log.warning("fault injection: pseudo-gradient of round %d scaled by %g", round_, scale.value)
        for d in delta:
            d.mul_(float(scale.value) if scale.value is not None else 1000.0)
    if active("nan_pseudo_gradient", round_) is not None:
        log.warning("fault injection: NaN in the pseudo-gradient of round %d", round_)
        delta[0].view(-1)[0] = float("nan")
