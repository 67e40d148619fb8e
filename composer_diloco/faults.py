"""Fault injection for the fault-tolerance tests: real signals and real corruption at named points of a run.

Production code marks the places where a fault may strike with `point` (``faults.point("allreduce_part_sent",
round_)``); each is a no-op unless a `FaultPlan` is installed in the process. A plan is installed once, at process
start: the console scripts call `install_from_environment` (`composer_diloco.lifecycle.run_cli`), which reads
``COMPOSER_DILOCO_FAULTS`` (the tests set it on one child process); a test in-process calls `install` directly
(torchft's ``fail_at`` style). Nothing here reads the environment after that.

A plan is a comma-separated list of faults, each ``kind`` or ``kind:round`` or ``kind:round:value``:

    kill_in_allreduce:R        SIGKILL this peer (its whole process group) after it sent the first part of its
                               pseudo-gradient in round R's all-reduce                  (point allreduce_part_sent)
    kill_in_reply:R            as a reducer in round R's all-reduce, return the averaged parts to one peer only,
                               then SIGKILL this peer: the survivors hold different averages
                                                                     (`withholds_replies`, point reducer_answered)
    slow_reply:R:S             as a reducer in round R's all-reduce, wait S seconds before returning the last
                               averaged part of its share to each sender: its own average is complete by then
                               (a late reply)                                             (`reply_delay_s`)
    stall_reducer:R            as a reducer in round R's all-reduce, never add this peer's own part to its share:
                               its reducer waits for it for ever, where no stream timer of hivemind's runs (a hung
                               reducer; the all-reduce's own watch ends it)                 (`stalls_reducer`)
    mute_sender:R              in round R's all-reduce, send each reducer one part and then nothing while keeping
                               the stream open, and refuse every sender as a reducer, 1 s on (a sender whose process is
                               gone but whose stream to us did not end; its reducer stream to us fails)
                                                                                            (`mutes_sender`)
    kill_in_checkpoint:R       SIGKILL the coordinator after it wrote checkpoint R's files, before the rename
                                                                                        (point checkpoint_written)
    step_delay:*:S             sleep S seconds after every inner step (a slow node)          (point inner_step_end)
    kill_after_step:R:K        SIGKILL this peer (its whole process group) once the K-th inner step of the phase that
                               trains round R is in its journal (the node's process crashes mid-phase)
                                                                                       (point inner_step_journaled)
    kill_in_barrier:R          SIGKILL this peer (its whole process group) as it enters round R's barrier: its
                               pseudo-gradient handed off, the round not yet announced ready (a crash in the sync;
                               the swarm averages round R without it)                     (point barrier_entered)
    scale_pseudo_gradient:R:F  multiply this node's pseudo-gradient of round R by F (a norm outlier)
                                                                                          (point pseudo_gradient)
    nan_pseudo_gradient:R      put a NaN into this node's pseudo-gradient of round R       (point pseudo_gradient)
    hold:*:PATH                after every inner step, wait while the file PATH exists (a test pauses a node
                               until something else has happened, whatever the machine's load) (point inner_step_end)
    slow_state:R:S             as the serving peer of a state download while at round R, wait S seconds before the
                               first chunk of each stream (a slow or far peer)               (`state_serve_delay_s`)
    kill_in_state_serve:R:N    as the serving peer of a state download while at round R, SIGKILL this peer once it
                               has sent N chunks (a server lost mid-download)                 (`state_chunk_sent`)

``R`` may be ``*`` (every round). The plan is inherited by the processes hivemind forks (its averager), since it
is installed before they start.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # tensors are only passed through: the command lines arm faults before they import torch
    import torch

ENV_VAR = "COMPOSER_DILOCO_FAULTS"
KINDS = ("kill_in_allreduce", "kill_in_reply", "slow_reply", "stall_reducer", "mute_sender", "kill_in_checkpoint",
         "step_delay", "kill_after_step", "kill_in_barrier", "scale_pseudo_gradient", "nan_pseudo_gradient", "hold",
         "slow_state", "kill_in_state_serve")
Point = Literal["allreduce_part_sent", "reducer_answered", "checkpoint_written", "inner_step_end",
                "inner_step_journaled", "barrier_entered", "pseudo_gradient"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` at ``round`` (None = every round) with an optional ``value`` (a number, or
    the file path of ``hold``)."""

    kind: str
    round: int | None
    value: float | str | None


@dataclass(frozen=True)
class FaultPlan:
    """The faults armed in this process (empty: every `point` is a no-op)."""

    faults: tuple[Fault, ...] = ()

    def armed(self, kind: str, round_: int | None = None) -> Fault | None:
        """The fault of this kind armed for ``round_`` (any round when ``round_`` is None), or None."""
        for fault in self.faults:
            if fault.kind == kind and (fault.round is None or round_ is None or fault.round == round_):
                return fault
        return None


_plan = FaultPlan()


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse a plan (the ``COMPOSER_DILOCO_FAULTS`` syntax above). Raises ValueError naming the bad entry."""
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


def install(plan: FaultPlan | str) -> FaultPlan:
    """Arm ``plan`` (a `FaultPlan` or its text) in this process, replacing any earlier one; returns it.

    Raises:
        ValueError: a bad entry in the text (`parse_faults`).
    """
    global _plan
    _plan = FaultPlan(parse_faults(plan)) if isinstance(plan, str) else plan
    if _plan.faults:
        log.warning("fault injection armed: %s", ", ".join(f.kind for f in _plan.faults))
    return _plan


def install_from_environment(environ: Mapping[str, str] | None = None) -> FaultPlan:
    """Install the plan of ``COMPOSER_DILOCO_FAULTS`` (unset or empty: no faults). Called once per process, at
    start, by the console scripts. Raises ValueError on a bad entry."""
    return install((os.environ if environ is None else environ).get(ENV_VAR, ""))


def installed() -> FaultPlan:
    """The plan armed in this process."""
    return _plan


def point(name: Point, round_: int | None = None, *, tensors: Sequence[torch.Tensor] = (), steps: int = 0) -> None:
    """A named place of the production code where an armed fault strikes; a no-op without a plan.

    Args:
        name: which place (see the module docstring for the faults each one fires).
        round_: the DiLoCo round the code is in (None where it does not know it: every-round faults only).
        tensors: ``pseudo_gradient`` only: the fp32 pseudo-gradient, corrupted in place.
        steps: ``inner_step_journaled`` only: the inner steps of the phase so far.
    """
    if not _plan.faults:
        return
    if name == "allreduce_part_sent" and _plan.armed("kill_in_allreduce", round_) is not None:
        kill_this_peer(f"in the all-reduce of round {round_}", from_child=True)
    elif name == "reducer_answered" and _plan.armed("kill_in_reply", round_) is not None:
        kill_this_peer(f"after answering one peer in the all-reduce of round {round_}", from_child=True)
    elif name == "checkpoint_written" and _plan.armed("kill_in_checkpoint", round_) is not None:
        kill_this_peer(f"while writing checkpoint round-{round_:06d}")
    elif name == "inner_step_end":
        _slow_down()
    elif name == "inner_step_journaled":
        fault = _plan.armed("kill_after_step", round_)
        if fault is not None and steps >= int(fault.value or 1):
            kill_this_peer(f"after inner step {steps} of round {round_}'s phase")
    elif name == "barrier_entered" and _plan.armed("kill_in_barrier", round_) is not None:
        kill_this_peer(f"entering the barrier of round {round_}")
    elif name == "pseudo_gradient":
        _corrupt(round_, tensors)


def withholds_replies(round_: int | None) -> bool:
    """True when this peer, as a reducer of round ``round_``, answers one sender only (``kill_in_reply``)."""
    return _plan.armed("kill_in_reply", round_) is not None


def stalls_reducer(round_: int | None) -> bool:
    """True when this peer, as a reducer of round ``round_``, never adds its own part to its share
    (``stall_reducer``)."""
    return _plan.armed("stall_reducer", round_) is not None


def mutes_sender(round_: int | None) -> bool:
    """True when this peer, in round ``round_``'s all-reduce, stops sending after one part to each reducer and refuses
    every sender as a reducer (``mute_sender``)."""
    return _plan.armed("mute_sender", round_) is not None


def reply_delay_s(round_: int | None) -> float:
    """Seconds this peer, as a reducer of round ``round_``, waits before returning its last averaged part (``slow_reply``;
    0.0 when none is armed). The caller awaits it (an asyncio sleep): the averager's other work goes on meanwhile."""
    fault = _plan.armed("slow_reply", round_) if _plan.faults else None
    return float(fault.value or 0.0) if fault is not None else 0.0


def state_serve_delay_s(round_: int | None) -> float:
    """Seconds this peer, serving a state download at round ``round_``, waits before the first chunk of a stream
    (``slow_state``; 0.0 when none is armed). The caller awaits it (an asyncio sleep)."""
    fault = _plan.armed("slow_state", round_) if _plan.faults else None
    return float(fault.value or 0.0) if fault is not None else 0.0


def state_chunk_sent(round_: int | None, sent: int) -> None:
    """This peer, serving a state download at round ``round_``, has sent ``sent`` chunks in all: SIGKILL it when
    ``kill_in_state_serve`` is armed for that round and ``sent`` reached its count (default 1)."""
    fault = _plan.armed("kill_in_state_serve", round_) if _plan.faults else None
    if fault is not None and sent >= int(fault.value or 1):
        kill_this_peer(f"while serving a state download, after {sent} chunks")


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


def _slow_down() -> None:
    """Sleep ``step_delay`` seconds (a slow node); wait while the ``hold`` file exists."""
    delay = _plan.armed("step_delay")
    if delay is not None and delay.value:
        time.sleep(float(delay.value))
    hold = _plan.armed("hold")
    if hold is not None and hold.value:
        while os.path.exists(str(hold.value)):
            time.sleep(0.2)


def _corrupt(round_: int | None, delta: Sequence[torch.Tensor]) -> None:
    """Apply ``scale_pseudo_gradient`` / ``nan_pseudo_gradient`` of this round to ``delta`` in place."""
    scale = _plan.armed("scale_pseudo_gradient", round_)
    if scale is not None:
        log.warning("fault injection: pseudo-gradient of round %s scaled by %g", round_, scale.value)
        for d in delta:
            d.mul_(float(scale.value) if scale.value is not None else 1000.0)
    if _plan.armed("nan_pseudo_gradient", round_) is not None:
        log.warning("fault injection: NaN in the pseudo-gradient of round %s", round_)
        delta[0].view(-1)[0] = float("nan")
