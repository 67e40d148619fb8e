"""Micro-benchmark: the cost of signing and checking one DHT request and its reply in a closed run, before and after
requests were bound to both libp2p peer IDs (issue 14 item 7). Both run side by side in one process.

    PYTHONPATH=. python bench/dht_signing.py [--n 20000] [--before-commit 905fe9f]

"before" is `composer_diloco/outer/auth.py` as it was at ``--before-commit`` (read with ``git show``, so the exact old
code runs); "after" is this tree's. One round trip = the client signs the request, the server checks it (HMAC,
time, nonce store) and signs the reply, the client checks the reply, over the three DHT RPCs' typical messages (a
ping, a find of one key, a store of one heartbeat). Also timed: the server refusing a request signed for another
peer (a replay or a relay) and one with a wrong signature. Prints one JSON line: microseconds per operation, the
best of ``--repeats`` runs.

Raises (exits non-zero): ``git show`` fails (no such commit in this checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

ROOT = Path(__file__).resolve().parents[1]
SECRET = b"bench-secret-0123456789abcdef"


def old_auth_module(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:composer_diloco/outer/auth.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "auth_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("auth_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def messages():
    node = dht_pb2.NodeInfo(node_id=DHTID.generate().to_bytes())
    heartbeat = MSGPackSerializer.dumps({"role": "node", "round": 12, "since": get_dht_time(), "sha": "ab" * 32,
                                         "settled": True, "maddr": "/ip4/127.0.0.1/tcp/40000/p2p/" + "x" * 52,
                                         "t": get_dht_time()})
    return [
        (lambda: dht_pb2.PingRequest(peer=node, validate=False),
         lambda: dht_pb2.PingResponse(peer=node, dht_time=get_dht_time(), available=True)),
        (lambda: dht_pb2.FindRequest(keys=[DHTID.generate().to_bytes()], peer=node),
         lambda: dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.NOT_FOUND)], peer=node)),
        (lambda: dht_pb2.StoreRequest(keys=[DHTID.generate().to_bytes()], subkeys=[MSGPackSerializer.dumps("node-a")],
                                      values=[heartbeat], expiration_time=[get_dht_time() + 60], in_cache=[False],
                                      peer=node),
         lambda: dht_pb2.StoreResponse(store_ok=[True], peer=node)),
    ]


def bench_before(auth, n: int) -> float:
    client, server = auth.HMACAuthorizer(SECRET), auth.HMACAuthorizer(SECRET)
    kinds = messages()

    async def loop() -> float:
        start = time.perf_counter()
        for i in range(n):
            make_request, make_response = kinds[i % 3]
            request = make_request()
            await client.sign_request(request, None)
            await server.validate_request(request)
            response = make_response()
            await server.sign_response(response, request)
            await client.validate_response(response, request)
        return time.perf_counter() - start

    return asyncio.run(loop()) / n * 1e6


def bench_after(auth, n: int) -> float:
    client, server = auth.HMACAuthorizer(SECRET), auth.HMACAuthorizer(SECRET)
    alice, bob = PeerID(secrets.token_bytes(38)), PeerID(secrets.token_bytes(38))
    kinds = messages()
    start = time.perf_counter()
    for i in range(n):
        make_request, make_response = kinds[i % 3]
        request = make_request()
        client.sign_request_for(request, alice, bob)
        server.check_request(request, alice, bob)
        response = make_response()
        server.sign_response_for(response, request, bob, alice)
        client.check_response(response, request, bob, alice)
    return (time.perf_counter() - start) / n * 1e6


def bench_refusals(auth, n: int) -> dict:
    """Microseconds for the server to refuse one request: signed for another peer, or with a wrong secret."""
    client, server, wrong = (auth.HMACAuthorizer(s) for s in (SECRET, SECRET, b"another-secret-0123456789"))
    alice, bob, mallory = (PeerID(secrets.token_bytes(38)) for _ in range(3))
    store = messages()[2][0]
    out = {}
    for label, signer, sender in (("refuse_other_peer_us", client, alice), ("refuse_wrong_secret_us", wrong, mallory)):
        request = store()
        signer.sign_request_for(request, sender, mallory if label == "refuse_other_peer_us" else bob)
        start = time.perf_counter()
        for _ in range(n):
            try:
                server.check_request(request, mallory, bob)
            except auth.RunSecretRefused:
                pass
        out[label] = (time.perf_counter() - start) / n * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000, help="round trips per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before-commit", default="905fe9f", help="the commit whose auth.py is 'before'")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from composer_diloco.outer import auth as after

    before = old_auth_module(args.before_commit)
    results = {"before_round_trip_us": [], "after_round_trip_us": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        results["before_round_trip_us"].append(bench_before(before, args.n))
        results["after_round_trip_us"].append(bench_after(after, args.n))
    out = {k: round(min(v), 2) for k, v in results.items()}
    out.update({k: round(v, 2) for k, v in bench_refusals(after, args.n).items()})
    out["n"] = args.n
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
