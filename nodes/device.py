"""Where a node trains: device and dtype picked from ``--device`` and what the machine has."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class DeviceError(ValueError):
    """``--device`` names a device this machine does not have."""


@dataclass(frozen=True)
class Placement:
    """The node's device and precision.

    Attributes:
        device: "cpu" or "cuda" (a ``cuda:N`` choice is made the current CUDA device).
        bf16: train in bf16 autocast (where the GPU supports it); the global model stays fp32 on CPU.
    """

    device: str
    bf16: bool

    @property
    def use_cpu(self) -> bool:
        return self.device == "cpu"

    @classmethod
    def resolve(cls, choice: str) -> Placement:
        """``auto`` = the first CUDA GPU if there is one, else CPU; ``cpu``; or ``cuda:N``.

        Raises:
            DeviceError: an unknown value, or CUDA asked for where there is none.
        """
        if choice == "cpu":
            return cls("cpu", False)
        if choice == "auto":
            choice = "cuda:0" if torch.cuda.is_available() else "cpu"
            if choice == "cpu":
                return cls("cpu", False)
        if not choice.startswith("cuda"):
            raise DeviceError(f"--device {choice!r} is not one of auto, cpu, cuda:N")
        index = choice.partition(":")[2] or "0"
        if not index.isdigit():
            raise DeviceError(f"--device {choice!r}: expected cuda:N with N a GPU index")
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {choice!r}: CUDA is not available on this machine (use cpu or auto)")
        if int(index) >= torch.cuda.device_count():
            raise DeviceError(f"--device {choice!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(int(index))  # "cuda" (the Trainer's device) now means cuda:N
        return cls("cuda", torch.cuda.is_bf16_supported())

    def place(self, model: nn.Module) -> nn.Module:
        """Move the policy to the device (fp32 master weights; bf16 only under autocast)."""
        return model.to("cuda" if self.device == "cuda" else "cpu")

    def describe(self) -> str:
        return f"{self.device}{' (bf16)' if self.bf16 else ''}"
