"""What a pseudo-gradient codec is to the round: the contract every codec meets, and the builders the registry names.

A codec has two halves (`RoundCodec`):

- **on the wire** (`WireCodec`, used by `composer_diloco.outer.averaging.ExactAverager` in its own process): a
  "butterfly" codec says how the averaged tensors are packed before hivemind's reduce-scatter and unpacked after it
  (`pack` / `unpack`, from the group's gathered metadata) and which hivemind per-part codec carries them (``wire``); a
  "gather" codec gives the byte bound of one message (`max_message_bytes`) and how every member combines the
  contributors' messages into the mean (`combine`);
- **on the node** (`NodeState`, held by `composer_diloco.outer.peer.DiLoCoPeer`): what it does with the node's
  pseudo-gradient before the round (`prepare_round`: its norm, a message, metadata for the group), once the group formed
  (`observe`), and after the round (`settle`, by how it ended), and its checkpointed state (`state_dict`). The dense
  codecs have none.

Which codecs exist, their options and their memory: `composer_diloco.outer.codecs` (torch-free), whose entries name
each codec's ``build(config, shapes) -> RoundCodec`` in its own module (`composer_diloco.outer.compression.build` for
none / fp16 / int8, `composer_diloco.outer.sparse.build`, `composer_diloco.outer.shared_blocks.build`). Adding one is
its module plus an entry there; nothing here, in the averager, the peer or the memory plan names a codec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from hivemind.compression import CompressionBase

from composer_diloco.outer.codecs import CodecEntry, codec_entry

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig


@dataclass
class Prepared:
    """A node's round as its codec prepared it.

    Attributes:
        norm: L2 norm of what the group averages from this node (what screening judges), NaN when non-finite.
        message: the bytes a "gather" codec sends, else None.
        gather: entries added to the node's gathered metadata (e.g. ``{"scores": bytes}``), the same on every member.
    """

    norm: float
    message: bytes | None = None
    gather: dict[str, Any] = field(default_factory=dict)


class NodeState(Protocol):
    """A codec's state on one node (error feedback); see the module docstring for when each call comes."""

    def prepare_round(self, delta: Sequence[torch.Tensor]) -> Prepared:
        """Fold the round's pseudo-gradient (theta-shaped fp32, the averager's buffers; a codec may rewrite them) in."""

    def observe(self, metadata: Sequence[Any], dropped: set[int]) -> None:
        """The group formed: its gathered metadata in group order, and the members screening dropped."""

    def settle(self, status: str, *, rejected: bool, contributed: bool) -> str:
        """The round ended with ``status``: update the state; returns the rule applied (for the log)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a `state_dict`; ValueError for another codec or layout."""


class WireCodec(Protocol):
    """A codec in the averager's process (module docstring). ``transport`` decides which members it must have."""

    transport: Literal["butterfly", "gather"]


@dataclass
class RoundCodec:
    """One run's codec: its registry entry, the averager's half and the node's half.

    Attributes:
        entry: the `composer_diloco.outer.codecs.CodecEntry`.
        compression: the hivemind per-part codec of the butterfly (NoCompression for a "gather" codec).
        wire: what `ExactAverager` asks (pack/unpack or combine), or None for a plain dense butterfly.
        node: the node's `NodeState`, or None (the dense codecs keep nothing).
    """

    entry: CodecEntry
    compression: CompressionBase
    wire: Any = None
    node: NodeState | None = None

    @property
    def name(self) -> str:
        """The config's ``compression``."""
        return self.entry.name


def adopt_feedback_buffer(state: Mapping[str, Any], ours: Mapping[str, Any], numel: int) -> torch.Tensor | None:
    """The error-feedback buffer of a checkpointed ``state`` (a copy, flat fp32), after checking that every key of
    ``ours`` (this run's `NodeState.state_dict`) but ``"buffer"`` has the same value in it: the shared half of the
    sparse codecs' ``load_state_dict``.

    Raises:
        ValueError: another codec, other parameters or element count, or a buffer that is not fp32 of ``numel``
            elements (one line).
    """
    for key in ours:
        if key != "buffer" and state.get(key) != ours[key]:
            raise ValueError(f"error feedback state has {key} = {state.get(key)!r}, this run's is {ours[key]!r}")
    buffer = state.get("buffer")
    if buffer is not None and (not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.float32
                               or buffer.numel() != numel):
        raise ValueError(f"error feedback buffer must be fp32 with {numel} elements")
    return None if buffer is None else buffer.detach().reshape(-1).clone()


def build_codec(config: RunConfig, shapes: Sequence[Sequence[int]]) -> RoundCodec:
    """The run's `RoundCodec` for theta's ``shapes`` (``config.compression`` looked up in the registry). Raises
    ValueError for a name the registry does not hold."""
    return codec_entry(config.compression).builder()(config, shapes)


__all__ = ["NodeState", "Prepared", "RoundCodec", "WireCodec", "adopt_feedback_buffer", "build_codec"]
