"""One peer of tests/test_averaging.py, run as its own process.

For each compression it averages a known tensor with the other peers through `ExactAverager`, applies the outer
step, and writes what it ended with (SHA-256 of the mean, the mean, bytes sent, new theta, reply streams its senders
closed) as JSON.
"""

import hashlib
import json

import torch
from torch import nn

from composer_diloco.outer.averaging import ExactAverager
from tests_support import peer_script_args
from composer_diloco.outer.compression import make_compression
from composer_diloco.outer.global_model import GlobalModel

WEIGHTS = [0.0, 1.0, 3.0]


def known_delta(index: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + index)
    return [torch.randn(50_000, generator=g) * 0.01 * (index + 1), torch.full((7, 3), float(index))]


def main() -> None:
    args, dht = peer_script_args()
    results = {}
    for compression in ("none", "fp16", "int8"):
        buffers = [torch.zeros(50_000), torch.zeros(7, 3)]
        averager = ExactAverager(buffers, dht, prefix=f"t{compression}",
                                 start=True, min_group_size=3, target_group_size=3, min_matchmaking_time=3.0,
                                 request_timeout=1.0, compression=make_compression(compression))
        with averager.get_tensors() as ts:
            for t, d in zip(ts, known_delta(args.index)):
                t.copy_(d)
        gathered = averager.step(weight=WEIGHTS[args.index], gather={"i": args.index}, timeout=60)
        with averager.get_tensors() as ts:
            mean = [t.clone() for t in ts]
        model = nn.Module()
        model.a, model.b = nn.Parameter(torch.ones(50_000)), nn.Parameter(torch.ones(7, 3))
        gm = GlobalModel(model, lr=0.7, momentum=0.9)
        gm.outer_step(mean)
        results[compression] = {
            "group": len(gathered),
            "mean_sha": hashlib.sha256(b"".join(t.numpy().tobytes() for t in mean)).hexdigest(),
            "mean_small": mean[1].flatten().tolist(),
            "mean_head": mean[0][:5].tolist(),
            "theta_sha": gm.sha256(),
            "theta_small": gm.params[1].detach().flatten().tolist(),
            "bytes_sent": int(averager.bytes_sent.value),
            "closed_by_sender": int(averager.replies_closed_by_sender.value),
        }
        averager.shutdown()
    with open(args.out, "w") as f:
        json.dump(results, f)
    dht.shutdown()


if __name__ == "__main__":
    main()
