"""The ``sparse-2bit`` pseudo-gradient codec: chunked top-k, 2-bit values, Rice-coded indices, error feedback.

What it is (SparseLoCo, Sarfi et al., arXiv 2508.15706; DeMo, Peng et al., arXiv 2411.19870, for error feedback on a
sparsified signal; error feedback itself: Seide et al. 2014, Stich et al., arXiv 1809.07599). Each node i keeps an
error-feedback buffer e_i, fp32, in the layout of theta. After its H inner steps:

    e_i   <- beta * e_i + Delta_i                   (`ErrorFeedback.prepare`; beta = ``error_decay``, default 1)
    m_i    = C(e_i)                                 (`SparseCodec.encode`: the bytes sent)
    e_i   <- e_i - D(m_i)                           (`ErrorFeedback.settle`, once the round used m_i)
    Delta  = sum_i w_i D(m_i) / sum_i w_i           (`weighted_mean`, on every peer, in group order)

and the outer step takes Delta as before (`GlobalModel.outer_step`). With the embedded default's outer SGD (lr 1, no
momentum) that is SparseLoCo's global step theta <- theta - Delta; its outer momentum is the error feedback.

C, per tensor, per chunk of ``chunk_elems`` consecutive elements (the last chunk of a tensor may be shorter):
- **top-k**: keep the k = ceil(topk_fraction * chunk length) entries of largest magnitude (at least one);
- **2-bit values**: each kept value gets one of 4 codes: its sign times "small" or "large" magnitude (split at the
  chunk's median kept magnitude). The chunk's codebook holds the mean of the values of each code, as bfloat16 (fp32's
  exponent range: pseudo-gradients of 1e-8 do not underflow as in fp16), so the values of a code sum to what they
  were (up to bf16 rounding): a Lloyd-style 2-bit quantizer, SparseLoCo's "2-bit" with per-chunk levels;
- **indices**: within a chunk, sorted; the gaps between them are Rice-coded (Golomb 1966, Rice 1979): a gap g is
  ``g >> b`` in unary plus its low ``b`` bits, ``b`` chosen per message to minimise its size. For k = 64 of 4096
  that is about 8 bits an index instead of 12 fixed ones. The unary parts and the low bits go in two streams, so
  that both encode and decode are vectorised (numpy), with no per-element Python loop.

Message layout (little-endian; everything else follows from the layout of theta and the two parameters, which every
peer of a run shares through the run config): ``b"S2"``, ``b`` (u8), the unary stream's length in bits (u64); then
the codebooks (chunks x 4 bf16), the 2-bit codes (4 a byte), the low bits, the unary stream. Size for the embedded
default (0.90M parameters, k = 1/64 of 4096): about 19 KB, against 3.6 MB of fp32 (`bench/compression.py` measures
it).

Why every replica stays bit-identical: a peer never sums floats it computed itself from floats it holds. Every peer
decodes the same bytes (its own message included) with integer operations and exact bf16 -> fp32 casts, then forms
``sum_i w_i D(m_i)`` in group order with separate, correctly rounded fp32 multiplies and adds (no fused
multiply-add, no reduction across elements) and divides by ``sum_i w_i``: IEEE-754 fixes every bit, whatever the CPU.
Encoding (top-k, quantization) runs only on the sender, so it needs no determinism across machines.

Where the error-feedback buffer lives: in the node's own process (`ErrorFeedback`, held by
`composer_diloco.outer.peer.DiLoCoPeer`), never in the global state. A node that resyncs (downloads a peer's theta)
keeps it: e_i is the part of the node's own pseudo-gradients that the swarm has not received yet, which the resync
does not deliver. `ErrorFeedback.settle` documents what each way a round ends does to it (a resync: "kept", or
"idle" when the node took the run's theta before preparing a message). `ErrorFeedback.state_dict` is what a node
saves: in ``<run-dir>/<node>/codec_state.pt`` every ``checkpoint_every`` rounds, read back when it restarts under the
same name, and in a checkpoint it writes itself (`composer_diloco.checkpoint.save_codec_state`,
`composer_diloco.checkpoint.save_checkpoint`'s ``codec_state``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hivemind.compression import NoCompression

from composer_diloco.outer.codec_contract import Prepared, RoundCodec, adopt_feedback_buffer
from composer_diloco.outer.codecs import codec_entry

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig

CODEC_NAME = "sparse-2bit"
_MAGIC = b"S2"
_HEADER = struct.Struct("<2sBQ")  # magic, Rice parameter b, unary stream length in bits
_MAX_RICE_BITS = 40


class CodecError(ValueError):
    """A message that does not decode for this codec's layout (truncated, corrupted, or another layout)."""


@dataclass(frozen=True)
class _Group:
    """``chunks`` consecutive chunks of ``length`` elements each, ``k`` kept per chunk, from flat offset ``offset``."""

    offset: int
    chunks: int
    length: int
    k: int

    @property
    def kept(self) -> int:
        return self.chunks * self.k


class SparseCodec:
    """Encode a pseudo-gradient to a compact sparse message and decode it back (see the module docstring).

    Args:
        shapes: the shapes of theta's tensors, in order (every peer of a run has the same).
        topk_fraction: share of each chunk's elements kept, in (0, 1]; k = ceil(topk_fraction * chunk length), >= 1.
        chunk_elems: elements per chunk (a tensor is split into chunks of this many; its last may be shorter).

    Attributes:
        numel: P, elements of theta.
        chunks: chunks of all tensors together.
        kept: entries a message carries (sum of k over chunks).

    Raises:
        ValueError: ``topk_fraction`` outside (0, 1], ``chunk_elems`` < 1, or no elements at all.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], *, topk_fraction: float, chunk_elems: int):
        if not 0.0 < topk_fraction <= 1.0:
            raise ValueError(f"topk_fraction {topk_fraction!r}: expected a share in (0, 1]")
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems {chunk_elems!r}: expected at least 1 element per chunk")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.topk_fraction, self.chunk_elems = float(topk_fraction), int(chunk_elems)
        self.groups: list[_Group] = []
        offset = 0
        for shape in self.shapes:
            n = math.prod(shape)
            full, rest = divmod(n, self.chunk_elems)
            if full:
                self.groups.append(_Group(offset, full, self.chunk_elems, self._k(self.chunk_elems)))
            if rest:
                self.groups.append(_Group(offset + full * self.chunk_elems, 1, rest, self._k(rest)))
            offset += n
        self.numel = offset
        if self.numel == 0:
            raise ValueError("SparseCodec: the layout holds no elements")
        self.chunks = sum(g.chunks for g in self.groups)
        self.kept = sum(g.kept for g in self.groups)
        # a gap is < the longest chunk, so with b = its bit length every index costs exactly 1 + b bits: the encoder
        # never does worse than that (`_rice_parameter`), which bounds the message (`max_message_bytes`)
        self._b_cap = max(g.length for g in self.groups).bit_length()

    def max_message_bytes(self) -> int:
        """Upper bound (bytes) of any message of this layout: header, codebooks (8 bytes a chunk), 2-bit codes, and
        at most ``kept x (1 + b_cap)`` bits of indices, where ``b_cap`` is the bit length of the longest chunk (the
        encoder always weighs b = b_cap, at which every index costs 1 + b_cap bits). What the averager's
        shared-memory message buffer is sized to (`composer_diloco.outer.averaging.ExactAverager`)."""
        return (_HEADER.size + self.chunks * 8 + _ceil_div(self.kept, 4)
                + _ceil_div(self.kept * self._b_cap, 8) + _ceil_div(self.kept, 8) + 1)

    def _k(self, length: int) -> int:
        return max(1, min(length, math.ceil(self.topk_fraction * length - 1e-9)))

    # -- encoding (the sender only) ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> bytes:
        """The message for ``tensors``.

        Args:
            tensors: theta-shaped tensors (any dtype, CPU), or one flat tensor of ``numel`` elements; not modified.
                NaN/Inf encode without error (the codebooks then hold them; screening drops such a contribution).
        Returns:
            The message bytes (module docstring's layout).
        Raises:
            ValueError: ``tensors`` do not hold ``numel`` elements.
        """
        flat = self._flat(tensors)
        gaps, codes, books = [], [], []
        for g in self.groups:
            block = flat[g.offset:g.offset + g.chunks * g.length].view(g.chunks, g.length)
            # ties broken by torch.topk; only the sender runs this, so it need not match any other machine
            idx = block.abs().topk(g.k, dim=1, sorted=False).indices.sort(dim=1).values  # (chunks, k) int64
            values = block.gather(1, idx)
            code, book = _quantize_2bit(values)
            gap = torch.diff(idx, dim=1, prepend=torch.full((g.chunks, 1), -1, dtype=idx.dtype)) - 1
            gaps.append(gap.reshape(-1))
            codes.append(code.reshape(-1))
            books.append(book.reshape(-1))
        gap_np = torch.cat(gaps).numpy()
        b = _rice_parameter(gap_np, self._b_cap)
        unary_bits, unary = _unary_stream(gap_np >> b)
        low = _pack_bits(gap_np & ((1 << b) - 1), b)
        code_bytes = _pack_2bit(torch.cat(codes).to(torch.uint8).numpy())
        book_bytes = torch.cat(books).view(torch.int16).numpy().astype("<i2").tobytes()
        return b"".join((_HEADER.pack(_MAGIC, b, unary_bits), book_bytes, code_bytes, low, unary))

    # -- decoding (every peer) -----------------------------------------------------------------------------------
    def decode_sparse(self, message: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept entries of ``message``: ``(positions, values)``.

        Returns:
            positions: int64, shape (kept,), flat indices into theta (unique, ascending within each chunk).
            values: fp32, shape (kept,).
        Raises:
            CodecError: the message is truncated, has trailing bytes, a bad header, or an index outside its chunk.
        """
        if len(message) < _HEADER.size:
            raise CodecError(f"sparse message of {len(message)} bytes is shorter than its header")
        magic, b, unary_bits = _HEADER.unpack_from(message)
        if magic != _MAGIC or b > _MAX_RICE_BITS:
            raise CodecError(f"not a {CODEC_NAME} message (header {message[:_HEADER.size].hex()})")
        sizes = (self.chunks * 8, _ceil_div(self.kept, 4), _ceil_div(self.kept * b, 8), _ceil_div(unary_bits, 8))
        if _HEADER.size + sum(sizes) != len(message):
            raise CodecError(f"sparse message of {len(message)} bytes, expected {_HEADER.size + sum(sizes)} for this "
                             f"layout ({self.numel} elements, {self.kept} kept, b={b})")
        at = _HEADER.size
        sections = []
        for size in sizes:
            sections.append(np.frombuffer(message, dtype=np.uint8, count=size, offset=at))
            at += size
        book_np, code_np, low_np, unary_np = sections
        books = torch.from_numpy(book_np.view("<i2").astype(np.int16)).view(torch.bfloat16).float().view(-1, 4)
        codes = torch.from_numpy(_unpack_2bit(code_np, self.kept).astype(np.int64))
        low = _unpack_bits(low_np, b, self.kept)
        ends = np.flatnonzero(np.unpackbits(unary_np, count=unary_bits) == 0)
        if len(ends) != self.kept or (unary_bits and ends[-1] != unary_bits - 1):
            raise CodecError(f"sparse message's index stream holds {len(ends)} indices, expected {self.kept}")
        high = np.diff(ends, prepend=-1) - 1
        gaps = torch.from_numpy((high.astype(np.int64) << b) | low)
        positions, values, at, chunk0 = [], [], 0, 0
        for g in self.groups:
            idx = torch.cumsum(gaps[at:at + g.kept].view(g.chunks, g.k) + 1, dim=1) - 1
            if int(idx[:, -1].max()) >= g.length:
                raise CodecError(f"sparse message holds an index past its chunk of {g.length} elements")
            starts = g.offset + torch.arange(g.chunks, dtype=torch.int64).unsqueeze(1) * g.length
            positions.append((starts + idx).reshape(-1))
            chunk = (chunk0 + torch.arange(g.chunks).unsqueeze(1)).expand(g.chunks, g.k)
            values.append(books[chunk.reshape(-1), codes[at:at + g.kept]])
            at += g.kept
            chunk0 += g.chunks
        return torch.cat(positions), torch.cat(values)

    transport = "gather"  # the averager all-gathers the messages (`composer_diloco.outer.averaging`)

    def combine(self, messages: Sequence[bytes], weights: Sequence[float]) -> torch.Tensor:
        """`weighted_mean` of the contributors' messages: what every member of the all-gather forms."""
        return weighted_mean(self, messages, weights)

    def decode(self, message: bytes) -> torch.Tensor:
        """``D(message)``: the dense fp32 vector, shape (numel,), zeros outside the kept entries. Raises CodecError."""
        positions, values = self.decode_sparse(message)
        out = torch.zeros(self.numel, dtype=torch.float32)
        out[positions] = values
        return out

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat (numel,) tensor in the shapes of theta."""
        out, at = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[at:at + n].view(shape))
            at += n
        return out

    def dense_bytes(self) -> int:
        """Bytes of the same vector in fp32 (4 * numel), the codec's reference size."""
        return 4 * self.numel

    def _flat(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        if isinstance(tensors, torch.Tensor):
            flat = tensors.detach().reshape(-1).to(torch.float32)
        else:
            flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors]) if tensors else \
                torch.zeros(0)
        if flat.numel() != self.numel:
            raise ValueError(f"SparseCodec: {flat.numel()} elements given, the layout holds {self.numel}")
        return flat


def weighted_mean(codec: SparseCodec, messages: Sequence[bytes], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i D(m_i) / sum_i w_i``, bit-identical on every peer given the same messages in the same order.

    Args:
        codec: the run's codec.
        messages: the contributors' messages, in group order (the order fixes the rounding).
        weights: their weights (samples), > 0, parallel to ``messages``.
    Returns:
        fp32 tensor of shape (numel,): each message's values times its fp32 weight, added in order into zeros (one
        correctly rounded multiply and one add per kept entry), then divided by the fp32 sum of the weights.
    Raises:
        CodecError: a message does not decode. ValueError: no message, or a weight <= 0.
    """
    if not messages or len(messages) != len(weights):
        raise ValueError(f"weighted_mean: {len(messages)} messages for {len(weights)} weights")
    if any(not w > 0 for w in weights):
        raise ValueError(f"weighted_mean: weights must be > 0, got {list(weights)}")
    acc = torch.zeros(codec.numel, dtype=torch.float32)
    for message, weight in zip(messages, weights):
        positions, values = codec.decode_sparse(message)
        scaled = torch.mul(values, torch.tensor(weight, dtype=torch.float32))
        acc.index_put_((positions,), scaled, accumulate=True)  # positions are unique: one add per element
    total = 0.0
    for weight in weights:  # fp64, in order, then one rounding to fp32
        total += float(weight)
    return torch.div(acc, torch.tensor(total, dtype=torch.float32))


class ErrorFeedback:
    """One node's error-feedback buffer e_i (fp32, (numel,)), and the message it sends each round.

    Args:
        codec: the run's codec.
        decay: beta of ``e_i <- beta * e_i + Delta_i`` in [0, 1] (1: classic error feedback, nothing lost;
            SparseLoCo uses beta < 1 as its outer momentum's decay).

    The buffer is created at the first `prepare` (a coordinator, which never sends, holds none). A round is
    `prepare` (before the all-reduce) then `settle` (after it): between the two the buffer is unchanged, so a round
    abandoned half-way leaves it as it was.

    Raises:
        ValueError: ``decay`` outside [0, 1].
    """

    def __init__(self, codec: SparseCodec, *, decay: float = 1.0):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay {decay!r}: expected a value in [0, 1]")
        self.codec, self.decay = codec, float(decay)
        self.buffer: torch.Tensor | None = None
        self._next: torch.Tensor | None = None  # beta * e + Delta of the round being synced
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = None  # D(message) of that round, sparse

    def prepare_round(self, delta: Sequence[torch.Tensor]) -> Prepared:
        """`prepare` as the codec contract's `composer_diloco.outer.codec_contract.NodeState` gives it."""
        message, norm = self.prepare(delta)
        return Prepared(norm=norm, message=message)

    def observe(self, metadata: Sequence[Any], dropped: set[int]) -> None:
        """Nothing: what this node's message contributed does not depend on the group."""

    @torch.no_grad()
    def prepare(self, delta: Sequence[torch.Tensor]) -> tuple[bytes, float]:
        """Fold this round's pseudo-gradient in and encode what to send.

        Args:
            delta: Delta_i, theta-shaped fp32 CPU tensors; not modified.
        Returns:
            ``(message, norm)``: the bytes to send, and the L2 norm of ``D(message)`` (what the all-reduce averages,
            so what screening judges; fp64 accumulation), NaN when ``beta * e + Delta`` holds NaN or Inf.
        """
        flat = self.codec._flat(delta)  # a sequence is concatenated into a new tensor; one tensor may be a view
        nxt = flat.clone() if isinstance(delta, torch.Tensor) else flat
        if self.buffer is not None:  # in place: e and its next value are the only theta-sized tensors held here
            nxt.add_(self.buffer, alpha=self.decay)
        self._next = nxt
        message = self.codec.encode(self._next)
        positions, values = self.codec.decode_sparse(message)
        self._sent = (positions, values)
        if not torch.isfinite(self._next).all():
            return message, float("nan")
        return message, float(values.double().pow(2).sum().sqrt())

    @torch.no_grad()
    def settle(self, status: str, *, rejected: bool, contributed: bool) -> str:
        """Update e_i for how the round ended (the `composer_diloco.outer.peer.SyncStatus` string); returns the rule
        applied ("sent", "dropped", "applied", "kept" or "idle").

        - "sent": ``status`` "averaged" (or "unsettled": this node's theta holds the mean it formed), this node
          contributed (weight > 0) and was not rejected: the group's mean used D(m_i), so
          ``e_i <- (beta e_i + Delta_i) - D(m_i)``;
        - "dropped": screening rejected this node's contribution (NaN/Inf or a norm outlier, any status): the
          swarm refused that mass and would refuse it again, so ``e_i <- 0``;
        - "applied": ``status`` "alone": theta moved by this node's whole Delta_i, uncompressed
          (`DiLoCoPeer._step_alone`), so e_i keeps its value from before the round;
        - "kept": "resynced", "skipped", or no contribution (weight 0): nothing of Delta_i is known to have reached
          theta, so ``e_i <- beta e_i + Delta_i`` and it is sent in a later round. A round that failed after some
          peers had received m_i and the node then took their theta counts m_i twice: one message's worth, once;
        - "idle": no `prepare` this round (nothing to do).

        Which rule applies changes what this node sends later, never what any replica holds: theta agreement comes
        from the all-reduce and the recovery rules alone.
        """
        if self._next is None:
            return "idle"
        if rejected:
            rule = "dropped"
            self.buffer = torch.zeros_like(self._next)
        elif status in ("averaged", "unsettled") and contributed:
            rule = "sent"
            positions, values = self._sent
            self._next[positions] -= values
            self.buffer = self._next
        elif status == "alone":
            rule = "applied"
            self.buffer = self.buffer if self.buffer is not None else torch.zeros_like(self._next)
        else:
            rule = "kept"
            self.buffer = self._next
        self._next, self._sent = None, None
        return rule

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores: ``{"codec", "topk_fraction", "chunk_elems", "decay", "numel", "buffer"}``
        (``buffer``: a clone of e_i, fp32 (numel,), or None before the first round)."""
        return {"codec": CODEC_NAME, "topk_fraction": self.codec.topk_fraction, "chunk_elems": self.codec.chunk_elems,
                "decay": self.decay, "numel": self.codec.numel,
                "buffer": None if self.buffer is None else self.buffer.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a `state_dict` (the buffer is copied; codec parameters and decay must match this run's).

        Raises:
            ValueError: another codec, other parameters, another number of elements, or a non-fp32 buffer (one line).
        """
        self.buffer = adopt_feedback_buffer(state, self.state_dict(), self.codec.numel)
        self._next, self._sent = None, None


# -- bit-level helpers (numpy, vectorised) ----------------------------------------------------------------------------
def _quantize_2bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes (chunks, k) int64 in 0..3 and codebooks (chunks, 4) bf16 for the kept values (chunks, k).

    Code = 2 * (value >= 0) + (|value| >= the chunk's median kept magnitude); a code's level is the mean of its values
    (0 for an unused code)."""
    magnitude = values.abs()
    threshold = magnitude.median(dim=1, keepdim=True).values
    codes = (values >= 0).long() * 2 + (magnitude >= threshold).long()
    sums = torch.zeros(values.shape[0], 4, dtype=torch.float64).scatter_add_(1, codes, values.double())
    counts = torch.zeros(values.shape[0], 4, dtype=torch.float64).scatter_add_(
        1, codes, torch.ones_like(values, dtype=torch.float64))
    return codes, (sums / counts.clamp(min=1)).float().to(torch.bfloat16)


def _rice_parameter(gaps: np.ndarray, cap: int) -> int:
    """The b that makes ``sum(gap >> b) + len(gaps) * (1 + b)`` bits smallest among the few around the optimum for a
    geometric source (log2(mean gap x ln 2)) and ``cap`` (<= `_MAX_RICE_BITS`; every gap < 2**cap, so b = cap costs
    exactly 1 + cap bits a gap: the result never costs more)."""
    if gaps.size == 0:
        return 0
    mean = float(gaps.mean())
    guess = max(0, int(math.log2(max(mean * math.log(2), 1.0))))
    candidates = {b for b in range(max(0, guess - 1), guess + 3) if b <= cap} | {min(cap, _MAX_RICE_BITS)}
    return min(sorted(candidates), key=lambda b: int((gaps >> b).sum()) + gaps.size * (1 + b))


def _unary_stream(high: np.ndarray) -> tuple[int, bytes]:
    """``high[j]`` ones then a zero, for every j: ``(length in bits, packed bytes)``."""
    ends = np.cumsum(high.astype(np.int64) + 1) - 1
    length = int(ends[-1]) + 1 if ends.size else 0
    bits = np.ones(length, dtype=np.uint8)
    bits[ends] = 0
    return length, np.packbits(bits).tobytes()


def _pack_bits(values: np.ndarray, width: int) -> bytes:
    """The low ``width`` bits of each value, most significant first, packed."""
    if width == 0 or values.size == 0:
        return b""
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    bits = ((values.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def _unpack_bits(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of `_pack_bits`: ``count`` int64 values."""
    if width == 0:
        return np.zeros(count, dtype=np.int64)
    bits = np.unpackbits(packed, count=count * width).reshape(count, width).astype(np.int64)
    return bits @ (1 << np.arange(width - 1, -1, -1, dtype=np.int64))


def _pack_2bit(codes: np.ndarray) -> bytes:
    padded = np.zeros(_ceil_div(codes.size, 4) * 4, dtype=np.uint8)
    padded[:codes.size] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] | quads[:, 1] << 2 | quads[:, 2] << 4 | quads[:, 3] << 6).astype(np.uint8).tobytes()


def _unpack_2bit(packed: np.ndarray, count: int) -> np.ndarray:
    quads = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1)
    return quads.reshape(-1)[:count]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def build(config: RunConfig, shapes: Sequence[Sequence[int]]) -> RoundCodec:
    """The registry's builder of ``sparse-2bit`` (`composer_diloco.outer.codecs`): a `SparseCodec` on the wire (an
    all-gather) and an `ErrorFeedback` on the node, with the config's ``[sparse_codec]`` (or its defaults)."""
    from composer_diloco.config import SparseCodecConfig

    section = config.sparse_codec or SparseCodecConfig()
    codec = SparseCodec(shapes, topk_fraction=section.topk_fraction, chunk_elems=section.chunk_elems)
    return RoundCodec(codec_entry(CODEC_NAME), NoCompression(), codec, ErrorFeedback(codec, decay=section.error_decay))


__all__ = ["CODEC_NAME", "CodecError", "ErrorFeedback", "SparseCodec", "build", "weighted_mean"]
