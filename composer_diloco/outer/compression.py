"""Pseudo-gradient compression for the all-reduce: the config's names mapped to hivemind's codecs."""

from __future__ import annotations

from typing import Literal

import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)

CompressionName = Literal["none", "fp16", "int8"]

_CODECS: dict[str, type[CompressionBase]] = {
    "none": NoCompression,  # fp32 on the wire: 4 bytes per element
    "fp16": Float16Compression,  # 2 bytes per element
    "int8": Uniform8BitQuantization,  # 1 byte per element + a 256-entry codebook per part
}


def make_compression(name: str) -> CompressionBase:
    """The hivemind codec for ``name`` in {"none", "fp16", "int8"}. Raises ValueError on any other name."""
    try:
        return _CODECS[name]()
    except KeyError:
        raise ValueError(f"compression {name!r} is not one of {sorted(_CODECS)}") from None


def roundtrip(tensor: torch.Tensor, compression: CompressionBase) -> torch.Tensor:
    """``decompress(compress(tensor))`` exactly as a peer receiving ``tensor`` over the wire would see it.

    Args:
        tensor: a CPU tensor, any shape; not modified.
        compression: the codec the all-reduce uses.
    Returns:
        A new CPU tensor with the same shape and dtype, carrying the codec's rounding error.
    """
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, compression.compression_type))
