"""One peer of tests/test_shared_blocks.py's three-process test, run as its own process.

Runs ``ROUNDS`` rounds of the ``shared-blocks`` codec through the real code path: `BlockFeedback.prepare_round`
(writes x_i over the averager's buffers, scores into the gathered metadata) -> ``ExactAverager.step`` (the selection
from the gathered scores, then hivemind's butterfly over the kept blocks, `SharedBlocks.pack` / `unpack`) ->
`BlockFeedback.observe` / `settle`, with weights 1, 2, 3 for peers 0, 1, 2. Writes, per round, the group order, its
x_i (hex of the fp32 bytes), its scores (hex), the mean it ended with (hex) and bytes sent, as JSON.
"""

import json

import torch

from composer_diloco.outer.averaging import ExactAverager
from composer_diloco.outer.shared_blocks import BlockFeedback, SharedBlocks
from tests_support import peer_script_args

SHAPES = [(20_000,), (64, 64), (7, 3)]
BLOCK, DENSITY = 256, 1 / 16
WEIGHTS = [1.0, 2.0, 3.0]
ROUNDS = 2


def codec() -> SharedBlocks:
    """The codec every peer (and the test) uses."""
    return SharedBlocks(SHAPES, block_elems=BLOCK, density=DENSITY)


def known_delta(index: int, round_: int) -> list[torch.Tensor]:
    """Peer ``index``'s pseudo-gradient of round ``round_`` (seeded; the first tensor's second half 100x larger, so
    that the kept blocks are known to lie there)."""
    g = torch.Generator().manual_seed(1000 * round_ + index)
    out = [torch.randn(s, generator=g) * 0.01 * (index + 1) for s in SHAPES]
    out[0][10_000:] *= 100
    return out


def main() -> None:
    args, dht = peer_script_args()
    c = codec()
    buffers = [torch.zeros(s) for s in SHAPES]
    averager = ExactAverager(buffers, dht, prefix="tblocks", start=True, min_group_size=3, target_group_size=3,
                             min_matchmaking_time=3.0, request_timeout=1.0, codec=c, compression=c.wire)
    ef = BlockFeedback(c)
    rounds = []
    try:
        for r in range(ROUNDS):
            before = int(averager.bytes_sent.value)
            with averager.get_tensors() as ts:
                for t, d in zip(ts, known_delta(args.index, r)):
                    t.copy_(d)
                prepared = ef.prepare_round(ts)
                x = b"".join(t.numpy().tobytes() for t in ts)
            gathered = averager.step(weight=WEIGHTS[args.index],
                                     gather={"i": args.index, "round": r, "weight": WEIGHTS[args.index],
                                             "norm": prepared.norm, **prepared.gather},
                                     timeout=60, allow_retries=False)
            group = [c_.metadata for c_ in gathered.values()]
            ef.observe(group, set())
            with averager.get_tensors() as ts:
                mean = b"".join(t.numpy().tobytes() for t in ts)
            rule = ef.settle("averaged", rejected=False, contributed=True)
            rounds.append({"order": [g["i"] for g in group], "x": x.hex(), "scores": prepared.gather["scores"].hex(),
                           "mean": mean.hex(), "bytes_sent": int(averager.bytes_sent.value) - before, "rule": rule,
                           "failed_size": int(averager.failed_size.value), "buffer": ef.buffer.numpy().tobytes().hex()})
    finally:
        averager.shutdown()
        dht.shutdown()
    with open(args.out, "w") as f:
        json.dump(rounds, f)


if __name__ == "__main__":
    main()
