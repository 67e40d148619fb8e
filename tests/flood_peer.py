"""An outsider that floods a closed run's peer with DHT requests it must refuse, and counts how many it absorbs.

    flood_peer.py --target MADDR [--seconds 10] [--workers 16] [--signed] [--join-prefix P] [--go-on-stdin]

Without the run secret: a bare libp2p host (hivemind's P2P) whose ``--workers`` concurrent loops send
``DHTProtocol.rpc_find`` requests (of the run config's key) to the peer at MADDR for ``--seconds`` seconds.
Unsigned by default; ``--signed``: signed with a wrong secret (from $COMPOSER_DILOCO_SECRET) and bound to this
host's and the target's peer IDs, so the target gets as far as the HMAC before refusing. ``--join-prefix P``:
the averager's ``rpc_join_group`` under prefix P (the closed run's, as identify leaks it) instead; a
``PROTOCOL_VIOLATION`` reply counts as refused. Prints one JSON line:
``{"seconds", "workers", "refused", "answered", "other", "refused_per_s"}`` (``answered``: the target accepted a
request, i.e. the flood got in; ``other``: timeouts, errors and empty replies, none of them an answer).
``--go-on-stdin``: start (imports, libp2p host) at once, print ``ready``, and flood once a line comes on stdin, so
a test pays the start before the moment it floods.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch
from hivemind.averaging.averager import compute_schema_hash
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2, dht_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from composer_diloco.outer.auth import HMACAuthorizer, MembersOnlyAverager, load_secret
from composer_diloco.outer.peer import round_group_bits
from composer_diloco.outer.swarm import RUNS_KEY


async def _join(p2p: P2P, target: PeerID, prefix: str) -> str:
    """One ``rpc_join_group``: "refused" (``PROTOCOL_VIOLATION``), "other" (an empty reply: the refusal was lost in
    flight, the server closing its end first under the flood's load) or "answered" (any other reply)."""
    request = averaging_pb2.JoinRequest(
        schema_hash=compute_schema_hash([torch.zeros(4)]), expiration=get_dht_time() + 5.0,
        group_key=f"{prefix}.0b{round_group_bits(0)}", gather=MSGPackSerializer.dumps({"name": "flood"}))
    stream = await MembersOnlyAverager.get_stub(p2p, target, namespace=prefix).rpc_join_group(request)
    codes = [m.code async for m in stream]
    return "refused" if codes == [averaging_pb2.PROTOCOL_VIOLATION] else "other" if not codes else "answered"


async def flood(target_maddr: str, seconds: float, workers: int, signed: bool, join_prefix: str | None,
                go_on_stdin: bool = False) -> dict:
    target = PeerID.from_base58(target_maddr.rsplit("/p2p/", 1)[1])
    p2p = await P2P.create(initial_peers=[target_maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if go_on_stdin:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    authorizer = HMACAuthorizer(load_secret(None)) if signed else None
    counts = {"refused": 0, "answered": 0, "other": 0}
    key = DHTID.generate(source=RUNS_KEY).to_bytes()

    async def worker(deadline: float) -> None:
        while time.monotonic() < deadline:
            if join_prefix:
                try:
                    counts[await asyncio.wait_for(_join(p2p, target, join_prefix), 10.0)] += 1
                except Exception:
                    counts["other"] += 1
                continue
            request = dht_pb2.FindRequest(keys=[key])
            if authorizer is not None:
                authorizer.sign_request_for(request, p2p.peer_id, target)
            try:
                await asyncio.wait_for(
                    p2p.call_protobuf_handler(target, "DHTProtocol.rpc_find", request, dht_pb2.FindResponse), 10.0)
                counts["answered"] += 1
            except Exception as e:
                counts["refused" if "RunSecretRefused" in str(e) else "other"] += 1

    start = time.monotonic()
    await asyncio.gather(*(worker(start + seconds) for _ in range(workers)))
    elapsed = time.monotonic() - start
    await p2p.shutdown()
    return {"seconds": round(elapsed, 1), "workers": workers, **counts,
            "refused_per_s": round(counts["refused"] / elapsed, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--signed", action="store_true", help="sign with a wrong secret ($COMPOSER_DILOCO_SECRET)")
    ap.add_argument("--join-prefix", default=None, help="flood the averager's rpc_join_group under this prefix")
    ap.add_argument("--go-on-stdin", action="store_true", help="print 'ready', flood once a line comes on stdin")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(flood(args.target, args.seconds, args.workers, args.signed, args.join_prefix,
                                       args.go_on_stdin))), flush=True)


if __name__ == "__main__":
    main()
