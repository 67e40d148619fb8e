"""What a node trains on and how: device and precision (`Placement`), micro-batch and accumulation (`NodeBatch`).

Both come from the node's own ``composer-node join`` options, so nodes of one run may differ (a CPU box next to an
H100): the run config fixes what must agree (the model, the loss, G = ``num_generations``), each node picks how it
fits its hardware, and `composer_diloco.diloco.DiLoCoRounds` weights its pseudo-gradient by the episodes it actually trained.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from composer_diloco.config import RunConfig
from nodes.options import DTYPES, BatchError, DeviceError, check_batch_options, check_device_choice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """The node's device and precision.

    Attributes:
        device: "cpu" or "cuda" (a ``cuda:N`` choice is made the current CUDA device).
        bf16: train under bf16 autocast (mixed precision: the master weights and AdamW state stay fp32, so the
            pseudo-gradient is fp32 too; frozen linear weights are stored in bf16, `place`); the global model stays
            fp32 on CPU.
        name: what the device is, for the log ("cpu" or the GPU's name with its index).
    """

    device: str
    bf16: bool
    name: str = "cpu"

    @property
    def use_cpu(self) -> bool:
        """True when training runs on the CPU (TRL/transformers' ``use_cpu``)."""
        return self.device == "cpu"

    @property
    def dtype(self) -> str:
        """"bf16" or "fp32": the training precision as ``--dtype`` spells it."""
        return "bf16" if self.bf16 else "fp32"

    @classmethod
    def resolve(cls, choice: str, dtype: str = "auto") -> Placement:
        """Pick the device from ``--device`` and the precision from ``--dtype``.

        Args:
            choice: ``auto`` (the first CUDA GPU if there is one, else CPU), ``cpu`` or ``cuda:N``.
            dtype: ``auto`` (bf16 on a CUDA GPU with native bf16, else fp32), ``fp32`` or ``bf16`` (on a CPU: CPU
                autocast, to rehearse a GPU run's precision; slower than fp32 where the CPU lacks native bf16).
        Returns:
            The placement; for ``cuda:N``, GPU N has been made torch's current CUDA device.
        Raises:
            DeviceError: an unknown ``--device`` or ``--dtype`` value, CUDA asked for where there is none or with a
                GPU index out of range, or bf16 asked on a GPU without native bf16.
        """
        index = check_device_choice(choice, dtype)  # the form, as the command line checked it before torch
        if choice == "auto":
            choice, index = ("cuda:0", "0") if torch.cuda.is_available() else ("cpu", "")
        if choice == "cpu":  # bf16 on a CPU only when asked for: CPU autocast rehearses a GPU run's precision
            return cls("cpu", dtype == "bf16")
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {choice!r}: CUDA is not available on this machine (use cpu or auto)")
        if int(index) >= torch.cuda.device_count():
            raise DeviceError(f"--device {choice!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(int(index))  # "cuda" (the Trainer's device) now means cuda:N
        name = f"cuda:{index} ({torch.cuda.get_device_name(int(index))})"
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if dtype == "bf16" and not native_bf16:
            raise DeviceError(f"--dtype bf16: {name} has no native bf16 support (use --dtype fp32 or auto)")
        return cls("cuda", dtype == "bf16" or (dtype == "auto" and native_bf16), name)

    def place(self, model: nn.Module) -> nn.Module:
        """Move the policy to the device. Under bf16 its frozen linear weights (a ``[lora]`` base) are stored in bf16
        and every forward runs under bf16 autocast (`composer_diloco.policy.precision`); the weights that train stay
        fp32 (master weights), and the outputs are bit-identical to fp32 storage under autocast."""
        model = model.to("cuda" if self.device == "cuda" else "cpu")
        if self.bf16:
            from composer_diloco.policy.precision import autocast_forward, frozen_linears_to_bf16

            freed = frozen_linears_to_bf16(model)
            autocast_forward(model, self.device)
            if freed:
                log.info("bf16: frozen linear weights stored in bf16 (%.1f MB freed on %s)", freed / 1e6, self.name)
        return model

    def describe(self) -> str:
        """One phrase for the log, e.g. ``cpu, fp32`` or ``cuda:0 (NVIDIA H100 80GB HBM3), bf16``."""
        return f"{self.name}, {self.dtype}"


@dataclass(frozen=True)
class NodeBatch:
    """How many episodes a node trains per inner (optimizer) step, and in how many pieces.

    One inner step generates ``episodes_per_step = micro_batch * grad_accum`` episodes at once (one TRL generation
    batch, GRPO advantages over all of them), then runs ``grad_accum`` forward/backward passes of ``micro_batch``
    episodes each and one AdamW step. Peak training memory follows ``micro_batch``; the round's samples (the
    node's all-reduce weight) follow ``episodes_per_step``.

    Without ``--batch-size`` (and ``--grad-accum``) the node picks the micro-batch itself from its memory plan
    (`composer_diloco.policy.memory_plan.choose_batch`, `nodes.node.Node.plan_memory`): the largest that divides the
    run's episodes per step and fits, turning gradient checkpointing on when no micro-batch fits without it.

    Attributes:
        micro_batch: episodes per forward/backward pass (``--batch-size``), >= 1.
        grad_accum: micro-batches per optimizer step (``--grad-accum``), >= 1.
        num_generations: the run's GRPO group size G; ``episodes_per_step`` is a multiple of it.
        gradient_checkpointing: train with gradient checkpointing (``--gradient-checkpointing``, or turned on by the
            memory plan's choice); `nodes.node.Node.train` reads it.
    """

    micro_batch: int
    grad_accum: int
    num_generations: int
    gradient_checkpointing: bool = False

    @property
    def episodes_per_step(self) -> int:
        """Episodes generated and trained per inner step: ``micro_batch * grad_accum``."""
        return self.micro_batch * self.grad_accum

    @property
    def tasks_per_step(self) -> int:
        """Distinct tasks (GRPO groups) per inner step: ``episodes_per_step / num_generations``."""
        return self.episodes_per_step // self.num_generations

    @staticmethod
    def picks_itself(batch_size: int | None, grad_accum: int) -> bool:
        """True when the user gave neither ``--batch-size`` nor a ``--grad-accum`` other than 1: the node picks its
        micro-batch from its memory plan. A ``--grad-accum`` alone keeps its meaning (that many micro-batches of the
        run's batch per step)."""
        return batch_size is None and grad_accum == 1

    @classmethod
    def resolve(cls, config: RunConfig, batch_size: int | None = None, grad_accum: int = 1,
                gradient_checkpointing: bool = False) -> NodeBatch:
        """The node's batch for ``config``.

        Args:
            config: the run config (``grpo.num_generations`` = G; ``batch_size`` = tasks_per_step * G is the default
                micro-batch).
            batch_size: episodes per micro-batch; None = ``config.batch_size``.
            grad_accum: micro-batches per optimizer step.
            gradient_checkpointing: train with gradient checkpointing.
        Raises:
            BatchError: a value below 1, or ``batch_size * grad_accum`` not a multiple of G (a GRPO group would be
                split across optimizer steps); the message names the three values.
        """
        check_batch_options(batch_size, grad_accum)
        micro = config.batch_size if batch_size is None else batch_size
        g = config.grpo.num_generations
        if (micro * grad_accum) % g:
            raise BatchError(
                f"--batch-size {micro} x --grad-accum {grad_accum} = {micro * grad_accum} episodes per step is not a "
                f"multiple of the run's num_generations {g} (GRPO groups must be whole)"
            )
        return cls(micro, grad_accum, g, gradient_checkpointing)

    def describe(self) -> str:
        """One phrase for the log, e.g. ``8 episodes per step (2 tasks x G=4) = 2 micro-batches of 4``."""
        return (f"{self.episodes_per_step} episodes per step ({self.tasks_per_step} tasks x G={self.num_generations})"
                f" = {self.grad_accum} micro-batch(es) of {self.micro_batch}"
                f"{', gradient checkpointing' if self.gradient_checkpointing else ''}")


def cpu_oversubscription(cores: int, threads: int, other_nodes: int, omp_env: str | None) -> str | None:
    """Why CPU nodes sharing one machine would slow each other down, or None when they do not.

    torch runs one intra-op thread per core by default, so N CPU nodes on C cores run N x C threads; measured here, a
    2-node run's inner phase took 25 s a round instead of 1.1 s (`tests/conftest.py`). `simulate`
    gives each of its nodes C / N threads; nodes started by hand get this warning instead.

    Args:
        cores: the cores this process may run on (``os.sched_getaffinity``).
        threads: this process's torch intra-op threads (``torch.get_num_threads()``).
        other_nodes: other ``composer-node`` processes running on this machine.
        omp_env: ``$OMP_NUM_THREADS`` (set: the user chose, no warning).
    Returns:
        One line for a WARNING, or None.
    """
    if omp_env is not None or other_nodes < 1 or threads * (other_nodes + 1) <= cores:
        return None
    share = max(1, cores // (other_nodes + 1))
    return (f"{other_nodes + 1} CPU nodes share this machine's {cores} cores at {threads} torch threads each: they "
            f"oversubscribe the cores and each inner step slows down many times; start each node with "
            f"OMP_NUM_THREADS={share}")


def other_local_nodes() -> int:
    """How many other ``composer-node join`` processes run on this machine (by command line; psutil). A node's
    forked children (hivemind's DHT and averager processes) carry its command line too: only processes whose parent
    is not a node count."""
    import psutil

    nodes = {}  # pid -> parent pid, of every process with a node's command line
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "nodes join" in cmd or "composer-node join" in cmd:
            nodes[proc.info["pid"]] = proc.info["ppid"]
    return sum(1 for pid, parent in nodes.items() if pid != os.getpid() and parent not in nodes)


def warn_if_cpu_oversubscribed(placement: Placement) -> None:
    """Log `cpu_oversubscription`'s WARNING for a CPU node that shares the machine with other nodes."""
    if not placement.use_cpu:
        return
    line = cpu_oversubscription(len(os.sched_getaffinity(0)), torch.get_num_threads(), other_local_nodes(),
                                os.environ.get("OMP_NUM_THREADS"))
    if line:
        log.warning(line)


__all__ = ["DTYPES", "BatchError", "DeviceError", "NodeBatch", "Placement", "cpu_oversubscription",
           "warn_if_cpu_oversubscribed"]
