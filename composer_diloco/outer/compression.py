"""Pseudo-gradient compression for the all-reduce: the config's names mapped to hivemind's codecs.

``none``, ``fp16`` and ``int8`` are hivemind per-part codecs used inside the butterfly all-reduce (`make_compression`).
``sparse-2bit`` is not one: it is top-k + 2-bit with error feedback, sent by all-gather
(`composer_diloco.outer.sparse`, `make_sparse_codec`; `composer_diloco.outer.averaging` for the transport).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)

from composer_diloco.outer.sparse import SparseCodec

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig

CompressionName = Literal["none", "fp16", "int8", "sparse-2bit"]
SPARSE = "sparse-2bit"

_CODECS: dict[str, type[CompressionBase]] = {
    "none": NoCompression,  # fp32 on the wire: 4 bytes per element
    "fp16": Float16Compression,  # 2 bytes per element
    "int8": Uniform8BitQuantization,  # 1 byte per element + a 256-entry codebook per part
}


def make_compression(name: str) -> CompressionBase:
    """The hivemind codec for ``name`` in {"none", "fp16", "int8"}; for "sparse-2bit", `NoCompression` (that codec
    compresses before the all-gather, whose messages travel as raw bytes). Raises ValueError on any other name."""
    if name == SPARSE:
        return NoCompression()
    try:
        return _CODECS[name]()
    except KeyError:
        raise ValueError(f"compression {name!r} is not one of {sorted([*_CODECS, SPARSE])}") from None


def make_sparse_codec(config: RunConfig, shapes: Sequence[Sequence[int]]) -> SparseCodec | None:
    """The run's `SparseCodec` over theta's ``shapes`` when ``config.compression`` is "sparse-2bit", else None
    (its parameters: ``config.sparse_codec``, or that section's defaults)."""
    if config.compression != SPARSE:
        return None
    from composer_diloco.config import SparseCodecConfig

    section = config.sparse_codec or SparseCodecConfig()
    return SparseCodec(shapes, topk_fraction=section.topk_fraction, chunk_elems=section.chunk_elems)


def roundtrip(tensor: torch.Tensor, compression: CompressionBase) -> torch.Tensor:
    """``decompress(compress(tensor))`` exactly as a peer receiving ``tensor`` over the wire would see it.

    Args:
        tensor: a CPU tensor, any shape; not modified.
        compression: the codec the all-reduce uses.
    Returns:
        A new CPU tensor with the same shape and dtype, carrying the codec's rounding error.
    """
    return deserialize_torch_tensor(serialize_torch_tensor(tensor, compression.compression_type))
