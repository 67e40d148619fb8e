"""The ``shared-blocks`` pseudo-gradient codec: block top-k on a selection every peer shares, then a reduce-scatter.

Why it exists: ``sparse-2bit`` (`composer_diloco.outer.sparse`) keeps each node's own top-k entries, so two nodes'
messages hold different entries and cannot be summed on the way: they are all-gathered, and a node's bytes grow with
the group size N (1,547x less than data-parallel at N = 2, 677x at N = 8: BENCHMARKS.md section 2). Here every peer
sends the *same* coordinates, so the values can go through the ordinary butterfly all-reduce (a reduce-scatter, then
an all-gather of the reduced parts), whose bytes per peer do not grow with N.

How the peers agree on the coordinates without a round of their own: theta is cut into blocks of ``block_elems``
consecutive elements within each tensor (a tensor's last block may be shorter). Each node i keeps an error-feedback
buffer e_i (fp32, in theta's flat layout) and, after its H inner steps:

    x_i    = beta * e_i + Delta_i                          (`BlockFeedback.prepare`, written over the averager's buffers)
    s_i[b] = ||x_i[block b]||^2, one byte each              (quantized in half octaves: `score_bytes`)

``s_i`` travels in the metadata hivemind's matchmaking already gathers to every group member (the same bytes on
every member). Every member then sums ``w_i * s_i[b]`` over the group's contributors (weight w_i > 0, not screened
out) in group order in fp64, and keeps the ``ceil(density * blocks)`` blocks of largest sum, ties to the lower index
(`select_blocks`): the same blocks on every member, computed from the same bytes. The butterfly averages the kept
blocks' values only (`pack` / `unpack`, in the averager's process; the wire codec ``values``: fp16 by default), so a
round moves about ``2 * density`` of theta's elements per peer, whatever N; everything outside the kept blocks is 0 in
the mean. Then, on each node (`BlockFeedback.settle`):

    e_i <- x_i - Q(x_i restricted to the kept blocks)       (what the mean used of x_i, Q the wire codec's rounding)

so e_i holds exactly the part of the node's pseudo-gradients the swarm has not applied: classic error feedback (Seide
et al. 2014; Stich et al., arXiv 1809.07599). Choosing the coordinates from the sum of all peers' magnitudes rather
than each peer's own is the shared-index idea of ScaleCom (Chen et al., NeurIPS 2020: one worker's top-k indices,
used by all, so the sparse values commute with a reduce-scatter) and of gTop-k (Shi et al. 2019), at block
granularity (a block's score is one byte: the selection's price is ``blocks`` bytes per member per round).

Why every replica stays bit-identical: the selection is a deterministic function of bytes every member holds (the
gathered scores and the screening verdicts, which `composer_diloco.outer.averaging.ExactAverager` already agrees on),
and the kept values are averaged by the same exact butterfly as the dense codecs (every peer decodes the same
reduced bytes).

Failure behaviour: as the butterfly's (`composer_diloco.outer.averaging`): a reducer that dies leaves its parts zero
and ``failed_size`` > 0, and `composer_diloco.outer.recovery.settle_pick` brings the peer to a member that got every
part. A round that ends without a group (resynced, alone, skipped) settles the error feedback by the same rules as
``sparse-2bit`` (`BlockFeedback.settle`).

Costs: on a node, two theta-sized fp32 buffers (e_i and x_i between `prepare` and `settle`); on the wire, per peer
and round, ``2 (n - 1) / n * kept * bytes(value)`` for the values (n = group size, the coordinator included) plus
about ``(n - 1) * blocks`` bytes of scores through matchmaking (hivemind's group leader relays every member's
metadata to every member, so the leader itself sends more: ``n * (n - 1) * blocks``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization

from composer_diloco.outer.codec_contract import Prepared, RoundCodec, adopt_feedback_buffer
from composer_diloco.outer.codecs import codec_entry

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig

CODEC_NAME = "shared-blocks"
_SCORE_ZERO = 0  # the byte of a block whose squared norm is 0 (or underflows the scale)
_SCORE_OFFSET = 200  # byte = round(2 * log2(sum of squares)) + offset: half octaves from 2^-99.5 to 2^27.5
_VALUES: dict[str, type[CompressionBase]] = {"fp32": NoCompression, "fp16": Float16Compression,
                                             "int8": Uniform8BitQuantization}


@dataclass(frozen=True)
class Block:
    """``length`` consecutive elements of tensor ``tensor`` from element ``start`` of its flat view, at flat offset
    ``offset`` of theta."""

    tensor: int
    start: int
    length: int
    offset: int


class SharedBlocks:
    """The codec's layout and its two halves of a round in the averager's process (`pack`, `unpack`).

    Args:
        shapes: the shapes of theta's tensors, in order (every peer of a run has the same).
        block_elems: elements per block (within one tensor; a tensor's last block may be shorter), >= 1.
        density: share of the blocks averaged each round, in (0, 1]: ``kept_blocks = ceil(density * blocks)``.
        values: the wire codec of the kept values in the butterfly: "fp16" (default), "fp32" or "int8" (hivemind's).

    Attributes:
        blocks: every `Block` of theta, in flat order. numel: P. kept_blocks: blocks averaged per round.
        transport: "butterfly" (what `composer_diloco.outer.averaging.ExactAverager` runs for it).
        wire: the hivemind per-part codec of the kept values.

    Raises:
        ValueError: ``block_elems`` < 1, ``density`` outside (0, 1], an unknown ``values`` codec, or no elements.
    """

    transport = "butterfly"

    def __init__(self, shapes: Sequence[Sequence[int]], *, block_elems: int, density: float, values: str = "fp16"):
        if block_elems < 1:
            raise ValueError(f"block_elems {block_elems!r}: expected at least 1 element per block")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density {density!r}: expected a share of the blocks in (0, 1]")
        if values not in _VALUES:
            raise ValueError(f"values codec {values!r}: expected one of {sorted(_VALUES)}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.block_elems, self.density, self.values = int(block_elems), float(density), values
        self.wire = _VALUES[values]()
        self.blocks: list[Block] = []
        offset = 0
        for t, shape in enumerate(self.shapes):
            n = math.prod(shape)
            for start in range(0, n, self.block_elems):
                self.blocks.append(Block(t, start, min(self.block_elems, n - start), offset + start))
            offset += n
        self.numel = offset
        if not self.blocks:
            raise ValueError("SharedBlocks: the layout holds no elements")
        self.kept_blocks = max(1, math.ceil(self.density * len(self.blocks) - 1e-9))
        self._lengths = torch.tensor([b.length for b in self.blocks], dtype=torch.int64)
        self._offsets = torch.tensor([b.offset for b in self.blocks], dtype=torch.int64)

    # -- the selection (every member, from the gathered metadata) ------------------------------------------------
    def score_bytes(self, flat: torch.Tensor) -> bytes:
        """One byte per block for the flat fp32 (numel,) vector ``flat``: its block's sum of squares in half octaves
        (0: zero, or NaN/Inf, which screening drops anyway). Reduces each tensor's blocks in place of theta-sized
        temporaries (fp64 accumulation, `torch.linalg.vector_norm`)."""
        sums = torch.empty(len(self.blocks), dtype=torch.float64)
        at, first = 0, 0
        for shape in self.shapes:
            n = math.prod(shape)
            full, rest = divmod(n, self.block_elems)
            if full:
                sums[first:first + full] = torch.linalg.vector_norm(
                    flat[at:at + full * self.block_elems].view(full, self.block_elems), dim=1,
                    dtype=torch.float64).square()
            if rest:
                sums[first + full] = torch.linalg.vector_norm(flat[at + full * self.block_elems:at + n],
                                                              dtype=torch.float64).square()
            at, first = at + n, first + full + (1 if rest else 0)
        codes = torch.zeros(len(self.blocks), dtype=torch.int64)
        finite = torch.isfinite(sums) & (sums > 0)
        codes[finite] = (2 * torch.log2(sums[finite])).round().long() + _SCORE_OFFSET
        return codes.clamp(0, 255).to(torch.uint8).numpy().tobytes()

    def select_blocks(self, scores: Sequence[bytes], weights: Sequence[float]) -> torch.Tensor:
        """The blocks the group averages: int64, shape (kept_blocks,), ascending.

        Args:
            scores: the contributors' `score_bytes`, in group order.
            weights: their weights (> 0), parallel.
        Returns:
            The ``kept_blocks`` blocks of largest ``sum_i w_i * 2^((s_i - offset) / 2)`` (fp64, in group order), ties
            to the lower block; with no contributor, the first ``kept_blocks`` blocks.
        Raises:
            ValueError: a score string of the wrong length (another layout).
        """
        total = np.zeros(len(self.blocks), dtype=np.float64)
        for raw, weight in zip(scores, weights, strict=True):
            if len(raw) != len(self.blocks):
                raise ValueError(f"block scores of {len(raw)} bytes, this layout has {len(self.blocks)} blocks")
            codes = np.frombuffer(raw, dtype=np.uint8).astype(np.float64)
            total += float(weight) * np.where(codes == _SCORE_ZERO, 0.0, np.exp2((codes - _SCORE_OFFSET) / 2))
        order = np.lexsort((np.arange(len(self.blocks)), -total))  # by score descending, then index ascending
        return torch.from_numpy(np.sort(order[:self.kept_blocks]).astype(np.int64))

    def metadata_bytes(self, metadata: Any) -> int:
        """Bytes this codec added to a member's gathered ``metadata``: its scores (what the traffic count adds)."""
        scores = metadata.get("scores") if isinstance(metadata, dict) else None
        return len(scores) if isinstance(scores, bytes) else 0

    def kept_elements(self, selected: torch.Tensor) -> int:
        """Elements of theta in the blocks ``selected``."""
        return int(self._lengths[selected].sum())

    def positions(self, selected: torch.Tensor) -> torch.Tensor:
        """Flat indices (int64, ascending) of every element of the blocks ``selected``."""
        lengths = self._lengths[selected]
        starts = torch.repeat_interleave(self._offsets[selected], lengths)
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths,
                                                                             lengths)
        return starts + within

    # -- the averager's process: what the butterfly averages ----------------------------------------------------
    def pack(self, tensors: Sequence[torch.Tensor], metadata: Sequence[Any],
             dropped: frozenset[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What the butterfly averages of theta-shaped ``tensors`` (this peer's x_i) in a group with this gathered
        ``metadata`` (group order) and screened-out members ``dropped``: ``([values], selected)``, the kept blocks'
        values as one new fp32 tensor, and the blocks (`group_selection`) that `unpack` takes back."""
        selected = group_selection(self, metadata, dropped)
        return self.pack_blocks(tensors, selected), selected

    def pack_blocks(self, tensors: Sequence[torch.Tensor], selected: torch.Tensor) -> list[torch.Tensor]:
        """The values of the blocks ``selected`` of theta-shaped ``tensors``, as one new fp32 tensor in a list."""
        flats = [t.reshape(-1) for t in tensors]
        parts = [flats[b.tensor][b.start:b.start + b.length] for b in (self.blocks[i] for i in selected.tolist())]
        return [torch.cat(parts).float()]

    def unpack(self, packed: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], selected: torch.Tensor) -> None:
        """Write the averaged kept values ``packed`` into theta-shaped ``tensors``, zeros elsewhere (in place)."""
        flats = [t.reshape(-1) for t in tensors]
        for flat in flats:
            flat.zero_()
        at, source = 0, packed[0]
        for b in (self.blocks[i] for i in selected.tolist()):
            flats[b.tensor][b.start:b.start + b.length].copy_(source[at:at + b.length])
            at += b.length

    def flat(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """A new flat fp32 (numel,) copy of theta-shaped ``tensors``. Raises ValueError on another element count."""
        if isinstance(tensors, torch.Tensor):
            flat = tensors.detach().reshape(-1).to(torch.float32).clone()
        else:
            flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        if flat.numel() != self.numel:
            raise ValueError(f"SharedBlocks: {flat.numel()} elements given, the layout holds {self.numel}")
        return flat


def group_selection(codec: SharedBlocks, metadata: Sequence[Any], dropped: frozenset[int] | set[int]) -> torch.Tensor:
    """`SharedBlocks.select_blocks` over a group's gathered metadata (dicts with ``weight`` and ``scores``), in group
    order, leaving out members of weight 0 and the indices in ``dropped`` (screened out): what the averager's
    process and each node compute, from the same bytes. Raises ValueError on a contributor without scores."""
    scores, weights = [], []
    for i, meta in enumerate(metadata):
        weight = float(meta.get("weight", 0.0)) if isinstance(meta, dict) else 0.0
        if weight <= 0 or i in dropped:
            continue
        if not isinstance(meta.get("scores"), bytes):
            raise ValueError(f"group member {i} contributes (weight {weight}) but sent no block scores")
        scores.append(meta["scores"])
        weights.append(weight)
    return codec.select_blocks(scores, weights)


class BlockFeedback:
    """One node's error feedback for ``shared-blocks`` (module docstring): e_i, fp32 (numel,).

    A round is `prepare` (before the all-reduce: writes x_i = beta e_i + Delta_i over the averager's buffers and
    returns the block scores), `observe` (the group's metadata once it formed: fixes the kept blocks), `settle` (after
    the round). Between `prepare` and `settle` e_i is unchanged, so a round abandoned half-way leaves it as it was.

    Args:
        codec: the run's `SharedBlocks`.
        decay: beta in [0, 1] (1: classic error feedback).
    Raises:
        ValueError: ``decay`` outside [0, 1].
    """

    def __init__(self, codec: SharedBlocks, *, decay: float = 1.0):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay {decay!r}: expected a value in [0, 1]")
        self.codec, self.decay = codec, float(decay)
        self.buffer: torch.Tensor | None = None
        self._next: torch.Tensor | None = None
        self._selected: torch.Tensor | None = None

    def prepare_round(self, delta: Sequence[torch.Tensor]) -> Prepared:
        """`prepare` as the codec contract's `composer_diloco.outer.codec_contract.NodeState` gives it."""
        scores, norm = self.prepare(delta)
        return Prepared(norm=norm, gather={"scores": scores})

    @torch.no_grad()
    def prepare(self, delta: Sequence[torch.Tensor]) -> tuple[bytes, float]:
        """Fold Delta_i (theta-shaped fp32 ``delta``, the averager's buffers) into x_i, write x_i over ``delta``;
        returns ``(scores, norm)``: the block scores for the gathered metadata and ||x_i|| (fp64 sum; NaN when x_i
        holds NaN/Inf), what screening judges."""
        nxt = self.codec.flat(delta)
        if self.buffer is not None:
            nxt.add_(self.buffer, alpha=self.decay)
            at = 0
            for d in delta:
                d.copy_(nxt[at:at + d.numel()].view_as(d))
                at += d.numel()
        self._next, self._selected = nxt, None
        if not torch.isfinite(nxt).all():
            return self.codec.score_bytes(torch.zeros_like(nxt)), float("nan")
        return self.codec.score_bytes(nxt), float(nxt.double().pow(2).sum().sqrt())

    def observe(self, metadata: Sequence[Any], dropped: set[int]) -> None:
        """The round's group formed with this gathered ``metadata`` (group order) and these screened-out indices:
        fix the blocks it averages (`group_selection`, as the averager's process did)."""
        if self._next is not None:
            self._selected = group_selection(self.codec, metadata, dropped)

    @torch.no_grad()
    def settle(self, status: str, *, rejected: bool, contributed: bool) -> str:
        """Update e_i for how the round ended (a `composer_diloco.outer.peer.SyncStatus`); returns the rule applied:

        - "sent": "averaged"/"unsettled", contributed, not rejected, the group known (`observe`): the mean used
          Q(x_i) on the kept blocks, so ``e_i <- x_i`` with those blocks set to ``x_i - Q(x_i)`` (Q: the wire codec);
        - "dropped": screened out: ``e_i <- 0`` (the swarm refused that mass);
        - "applied": "alone": theta moved by the whole x_i (the buffers held it), so ``e_i <- 0``;
        - "kept": anything else (resynced, skipped, weight 0, no group): ``e_i <- x_i``;
        - "idle": no `prepare` this round.
        """
        if self._next is None:
            return "idle"
        nxt, selected = self._next, self._selected
        if rejected or status == "alone":
            rule = "dropped" if rejected else "applied"
            self.buffer = torch.zeros_like(nxt)
        elif status in ("averaged", "unsettled") and contributed and selected is not None:
            rule = "sent"
            where = self.codec.positions(selected)
            sent = nxt[where]
            wire = _roundtrip(sent, self.codec.wire)
            nxt[where] = sent - wire
            self.buffer = nxt
        else:
            rule = "kept"
            self.buffer = nxt
        self._next, self._selected = None, None
        return rule

    def state_dict(self) -> dict[str, Any]:
        """``{"codec", "block_elems", "density", "values", "decay", "numel", "buffer"}`` (buffer: a clone of e_i or
        None)."""
        c = self.codec
        return {"codec": CODEC_NAME, "block_elems": c.block_elems, "density": c.density, "values": c.values,
                "decay": self.decay, "numel": c.numel, "buffer": None if self.buffer is None else self.buffer.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a `state_dict`. Raises ValueError: another codec, parameters or layout, or a non-fp32 buffer."""
        self.buffer = adopt_feedback_buffer(state, self.state_dict(), self.codec.numel)
        self._next, self._selected = None, None


def _roundtrip(values: torch.Tensor, wire: CompressionBase) -> torch.Tensor:
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

    return deserialize_torch_tensor(serialize_torch_tensor(values, wire.compression_type)).float()


def build(config: RunConfig, shapes: Sequence[Sequence[int]]) -> RoundCodec:
    """The registry's builder of ``shared-blocks`` (`composer_diloco.outer.codecs`): `SharedBlocks` on the wire (the
    butterfly, with its ``values`` codec) and a `BlockFeedback` on the node, with the config's ``[codec_options]``."""
    from composer_diloco.outer.codecs import SharedBlocksOptions

    options = SharedBlocksOptions.model_validate(config.codec_options)
    codec = SharedBlocks(shapes, block_elems=options.block_elems, density=options.density, values=options.values)
    return RoundCodec(codec_entry(CODEC_NAME), codec.wire, codec, BlockFeedback(codec, decay=options.error_decay))


__all__ = ["CODEC_NAME", "Block", "BlockFeedback", "SharedBlocks", "build", "group_selection"]
