"""hivemind's per-part codecs as the all-reduce uses them: which one carries a codec (`make_compression`), and what a
tensor looks like after the wire (`roundtrip`). The codecs themselves: `composer_diloco.outer.codecs`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)

from composer_diloco.outer.codec_contract import RoundCodec
from composer_diloco.outer.codecs import codec_entry

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig


_HIVEMIND = {"none": NoCompression, "fp16": Float16Compression, "int8": Uniform8BitQuantization}


def build(config: RunConfig, shapes: Sequence[Sequence[int]]) -> RoundCodec:
    """The registry's builder of none / fp16 / int8: hivemind's per-part codec in the butterfly over the whole
    pseudo-gradient, no node state (`composer_diloco.outer.codec_contract.RoundCodec`)."""
    return RoundCodec(codec_entry(config.compression), _HIVEMIND[config.compression]())


def make_compression(name: str) -> CompressionBase:
    """The hivemind per-part codec the butterfly carries codec ``name`` with (`codec_contract.build_codec`'s
    ``compression``: NoCompression for the codecs that compress themselves). Raises ValueError for an unknown name."""
    from composer_diloco.config import RunConfig
    from composer_diloco.outer.codec_contract import build_codec

    return build_codec(RunConfig(compression=name), [(1,)]).compression


def roundtrip(tensor: torch.Tensor, compression: CompressionBase) -> torch.Tensor:
    """``decompress(compress(tensor))`` exactly as a peer receiving ``tensor`` over the wire would see it.

    Args:
        tensor: a CPU tensor, any shape; not modified.
        compression: the codec the all-reduce uses.
    Returns:
        A new CPU tensor with the same shape and dtype, carrying the codec's rounding error.
    """
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, compression.compression_type))
