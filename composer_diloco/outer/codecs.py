"""The pseudo-gradient codecs by name: what the config's ``compression`` may be, and what each one costs.

A codec is one module behind one contract (`composer_diloco.outer.codec_contract`) plus one entry here. The entry
is torch-free, so that the config (`composer_diloco.config.RunConfig`) checks a name and its options, and the memory
plan (`composer_diloco.policy.memory_plan`) counts its buffers, without importing torch, hivemind or the codec:

- ``transport``: how the group combines it (`composer_diloco.outer.averaging.ExactAverager`): "butterfly", hivemind's
  reduce-scatter + all-gather of a dense vector (each peer's bytes do not grow with the group), or "gather", an
  all-gather of one message per contributor, decoded and averaged by every member (bytes grow with the group);
- ``local_state_tensors``: theta-sized fp32 tensors a node keeps for itself (error feedback), never downloaded;
- ``options``: its settings model (pydantic, torch-free), filled from the config's ``[codec_options]``;
- ``build``: ``"module:function"`` that builds its `composer_diloco.outer.codec_contract.RoundCodec` from the run
  config and theta's shapes, imported only when a peer starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SharedBlocksOptions(BaseModel):
    """Settings of ``compression = "shared-blocks"`` (`composer_diloco.outer.shared_blocks`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_elems: int = Field(512, ge=1, le=2**24, description="Elements per block (within one tensor). Each block "
                             "costs one byte of scores per member and round: 512 keeps the scores under half the "
                             "values' bytes up to N = 8.")
    density: float = Field(1 / 64, gt=0, le=1, description="Share of the blocks averaged each round (1/64: the "
                           "share of entries sparse-2bit keeps).")
    values: Literal["fp16", "fp32", "int8"] = Field("fp16", description="Wire codec of the kept values.")
    error_decay: float = Field(1.0, ge=0, le=1, description="beta of the error feedback e <- beta e + Delta.")


@dataclass(frozen=True)
class CodecEntry:
    """One codec of the registry (module docstring).

    Attributes:
        name: the config's ``compression`` value.
        summary: one line for ``--help`` and errors.
        transport: "butterfly" or "gather".
        local_state_tensors: theta-sized fp32 tensors a node keeps (0, 1 or 2).
        options: its settings model, or None when it takes none.
        build: ``"module:function"``: ``function(config, shapes) -> RoundCodec``.
    """

    name: str
    summary: str
    transport: Literal["butterfly", "gather"]
    local_state_tensors: int
    options: type[BaseModel] | None
    build: str

    def builder(self) -> Any:
        """The imported ``build`` function (imports torch and hivemind)."""
        module, _, function = self.build.partition(":")
        return getattr(importlib.import_module(module), function)


_DENSE = "composer_diloco.outer.compression:build"
CODECS: dict[str, CodecEntry] = {entry.name: entry for entry in (
    CodecEntry("none", "fp32 in hivemind's butterfly (4 bytes an element)", "butterfly", 0, None, _DENSE),
    CodecEntry("fp16", "fp16 in hivemind's butterfly (2 bytes an element)", "butterfly", 0, None, _DENSE),
    CodecEntry("int8", "hivemind's 8-bit uniform quantization in the butterfly (1 byte an element)", "butterfly", 0,
               None, _DENSE),
    # its options live in the config's [sparse_codec] section, which predates this registry
    CodecEntry("sparse-2bit", "each node's top-k + 2-bit values + error feedback, all-gathered (SparseLoCo)",
               "gather", 2, None, "composer_diloco.outer.sparse:build"),
    CodecEntry("shared-blocks", "block top-k on a selection every peer shares + error feedback, in the butterfly",
               "butterfly", 2, SharedBlocksOptions, "composer_diloco.outer.shared_blocks:build"),
)}


def codec_entry(name: str) -> CodecEntry:
    """The registry entry of ``name``. Raises ValueError (one line, listing the known names) for any other."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"compression {name!r} is not one of {sorted(CODECS)}") from None


__all__ = ["CODECS", "CodecEntry", "SharedBlocksOptions", "codec_entry"]
