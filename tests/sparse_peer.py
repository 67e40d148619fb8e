"""One peer of tests/test_sparse_codec.py's three-process test, run as its own process.

Runs ``ROUNDS`` rounds of the ``sparse-2bit`` codec through the real code path: `ErrorFeedback.prepare` ->
`ExactAverager.set_message` (shared-memory hand-over to the averager process) -> ``ExactAverager.step`` (the
all-gather, `SparseGatherRunner`) -> `ErrorFeedback.settle`, with weights 1, 2, 3 for peers 0, 1, 2. Writes, per
round, the group order, its own message (hex), the SHA-256 of the mean it ended with, and bytes sent, as JSON.
"""

import hashlib
import json

import torch

from composer_diloco.outer.averaging import ExactAverager
from tests_support import peer_script_args
from composer_diloco.outer.sparse import ErrorFeedback, SparseCodec

SHAPES = [(20_000,), (64, 64), (7, 3)]
TOPK, CHUNK = 1 / 64, 1024
WEIGHTS = [1.0, 2.0, 3.0]
ROUNDS = 2


def codec() -> SparseCodec:
    """The codec every peer (and the test) uses."""
    return SparseCodec(SHAPES, topk_fraction=TOPK, chunk_elems=CHUNK)


def known_delta(index: int, round_: int) -> list[torch.Tensor]:
    """Peer ``index``'s pseudo-gradient of round ``round_`` (seeded)."""
    g = torch.Generator().manual_seed(1000 * round_ + index)
    return [torch.randn(s, generator=g) * 0.01 * (index + 1) for s in SHAPES]


def main() -> None:
    args, dht = peer_script_args()
    c = codec()
    buffers = [torch.zeros(s) for s in SHAPES]
    averager = ExactAverager(buffers, dht, prefix="tsparse", start=True,
                             min_group_size=3, target_group_size=3, min_matchmaking_time=3.0, request_timeout=1.0,
                             sparse_codec=c)
    ef = ErrorFeedback(c)
    rounds = []
    try:
        for r in range(ROUNDS):
            before = int(averager.bytes_sent.value)
            with averager.get_tensors() as ts:
                delta = known_delta(args.index, r)
                for t, d in zip(ts, delta):
                    t.copy_(d)
                message, norm = ef.prepare(ts)
            averager.set_message(r, message)
            gathered = averager.step(weight=WEIGHTS[args.index],
                                     gather={"i": args.index, "round": r, "weight": WEIGHTS[args.index], "norm": norm},
                                     timeout=60, allow_retries=False)
            order = [c_.metadata["i"] for c_ in gathered.values()]
            with averager.get_tensors() as ts:
                mean = b"".join(t.numpy().tobytes() for t in ts)
            rule = ef.settle("averaged", rejected=False, contributed=True)
            rounds.append({"order": order, "message": message.hex(), "mean_sha": hashlib.sha256(mean).hexdigest(),
                           "bytes_sent": int(averager.bytes_sent.value) - before, "rule": rule,
                           "failed_size": int(averager.failed_size.value),
                           "buffer_sha": hashlib.sha256(ef.buffer.numpy().tobytes()).hexdigest()})
    finally:
        averager.shutdown()
        dht.shutdown()
    with open(args.out, "w") as f:
        json.dump(rounds, f)


if __name__ == "__main__":
    main()
