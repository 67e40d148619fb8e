"""One peer of tests/test_averaging.py's hung-reducer test, run as its own process (`tests/mute_peer.py`: of its
mute-sender test).

Three peers average one known tensor through `ExactAverager`; peer 2 runs with the fault ``stall_reducer`` (it never
adds its own part to its share, so its reducer waits for ever). Each writes how its step ended (``averaged`` or the
error), the seconds it took, the elements no reducer returned (``failed_size``) and the mean's SHA-256 as JSON; its
log (the averager's process too) goes to ``OUT.log``.
"""

import hashlib
import json
import logging
import time

import torch

from composer_diloco import faults
from composer_diloco.outer.averaging import ExactAverager
from tests_support import peer_script_args

STALLED = 2


def main(fault: str = "stall_reducer:*", next_chunk_timeout: float = 3.0, faulty_step_timeout: float = 60.0,
         part_size_bytes: int = 1 << 19, allreduce_timeout: float = 40.0) -> None:
    """Peer ``--index`` of the trio; peer `STALLED` runs with ``fault`` and gives its step ``faulty_step_timeout``
    seconds. hivemind times a sender's next part at ``next_chunk_timeout`` and a reducer's at twice that; the tensor
    (1.2 MB) goes in parts of ``part_size_bytes`` (hivemind's default: one part per peer's share)."""
    args, dht = peer_script_args()
    logging.basicConfig(filename=args.out + ".log", level=logging.WARNING,
                        format="%(asctime)s %(process)d %(name)s %(message)s")
    if args.index == STALLED:
        faults.install(fault)
    buffers = [torch.zeros(300_000)]
    # with the defaults, hivemind times a sender's next part at 3 s and a reducer's at 6 s; without the all-reduce's
    # own watch the hung peer would wait out allreduce_timeout (40 s)
    averager = ExactAverager(buffers, dht, prefix="stall", start=True, min_group_size=3, target_group_size=3,
                             min_matchmaking_time=3.0, request_timeout=1.0, next_chunk_timeout=next_chunk_timeout,
                             allreduce_timeout=allreduce_timeout, part_size_bytes=part_size_bytes)
    with averager.get_tensors() as ts:
        ts[0].copy_(torch.arange(300_000, dtype=torch.float32) * (args.index + 1))
    began = time.monotonic()
    try:
        timeout = faulty_step_timeout if args.index == STALLED else 60
        averager.step(weight=1.0, gather={"i": args.index}, timeout=timeout, allow_retries=False)
        outcome = "averaged"
    except Exception as e:  # the hung peer's step fails: what the node's round then recovers from
        outcome = repr(e)
    seconds = time.monotonic() - began
    with averager.get_tensors() as ts:
        mean_sha = hashlib.sha256(ts[0].numpy().tobytes()).hexdigest()
    with open(args.out, "w") as f:
        json.dump({"outcome": outcome, "seconds": seconds, "failed_size": int(averager.failed_size.value),
                   "mean_sha": mean_sha}, f)
    averager.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
