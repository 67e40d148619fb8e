"""An outsider of tests/test_closed_run.py, run as its own process: it captures, replays and relays insiders' DHT RPCs.

    relay_peer.py --target MADDR
        Without the run secret: a bare libp2p host (hivemind's P2P, no DHT node of its own) that serves the DHT's
        handler names (``DHTProtocol.rpc_ping`` / ``rpc_store`` / ``rpc_find``), so an insider that dials it (an
        insider told to ``--peer`` the attacker) sends it signed requests. The first request of each kind is
        *captured*: not forwarded (its caller gets an error), and replayed at once, unchanged, from this host's own
        connection to the insider at MADDR, which never saw it (a replay to a different peer within the time
        window). Every later request is *relayed*: forwarded to MADDR, and the reply (an insider's genuine signed
        reply, if MADDR accepts) returned to the caller. Prints ``peer: MADDR`` first; when stdin closes, prints
        ``{"peer_id", "replays": {rpc: {"ok", "detail"}}, "relay": {"forwarded", "answered", "refused",
        "unreached", "failed", "errors"}}`` as JSON (``ok``: the target answered the replay; ``answered``: relayed
        requests that got a reply from the target; ``refused``: those the target refused; ``unreached``: those that
        never reached it because this host could not dial it (libp2p's "failed to dial", e.g. a timeout on a loaded
        machine); ``failed``: any other error) and exits 0.

The attack of issue 14 item 7: before requests were bound to the sender's and receiver's libp2p peer IDs, both the
replay and the relay were accepted, and the target recorded the insider's DHT identity (node_id) at this host's
address.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections import Counter

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import dht_pb2

RPCS = {"rpc_ping": (dht_pb2.PingRequest, dht_pb2.PingResponse),
        "rpc_store": (dht_pb2.StoreRequest, dht_pb2.StoreResponse),
        "rpc_find": (dht_pb2.FindRequest, dht_pb2.FindResponse)}
TIMEOUT_S = 10.0
RELAY_COUNTS = ("forwarded", "answered", "refused", "unreached", "failed")  # reported even when 0


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _outcome(e: BaseException) -> str:
    """How a relayed request ended that raised ``e``: refused by the target, never sent to it, or another error."""
    if "RunSecretRefused" in str(e):
        return "refused"
    if "failed to dial" in str(e):  # the daemon could not open a stream to the target: the request never left
        return "unreached"
    return "failed"


async def serve(target_maddr: str, stdin_closed: threading.Event) -> dict:
    target = PeerID.from_base58(target_maddr.rsplit("/p2p/", 1)[1])
    p2p = await P2P.create(initial_peers=[target_maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    replays: dict[str, dict] = {}
    relay: Counter = Counter()
    errors: Counter = Counter()

    def handler_for(rpc: str):
        request_type, response_type = RPCS[rpc]
        name = f"DHTProtocol.{rpc}"

        async def handle(request, context: P2PContext):
            if rpc not in replays:  # capture: keep it from the target, replay it ourselves
                replays[rpc] = {"ok": False, "detail": "captured"}
                try:
                    reply = await asyncio.wait_for(
                        p2p.call_protobuf_handler(target, name, request, response_type), TIMEOUT_S)
                    replays[rpc] = {"ok": True, "detail": f"answered: {str(reply)[:200]!r}"}
                except Exception as e:
                    replays[rpc] = {"ok": False, "detail": _error(e)}
                raise RuntimeError("captured")
            relay["forwarded"] += 1
            try:
                reply = await asyncio.wait_for(p2p.call_protobuf_handler(target, name, request, response_type),
                                               TIMEOUT_S)
            except Exception as e:
                relay[_outcome(e)] += 1
                errors[_error(e)[:160]] += 1
                raise
            relay["answered"] += 1
            return reply

        return name, handle, request_type

    for rpc in RPCS:
        name, handle, request_type = handler_for(rpc)
        await p2p.add_protobuf_handler(name, handle, request_type)
    maddrs = await p2p.get_visible_maddrs()
    print(f"peer: {maddrs[0]}", flush=True)
    while not stdin_closed.is_set():
        await asyncio.sleep(0.2)
    await p2p.shutdown()
    return {"peer_id": p2p.peer_id.to_base58(), "replays": replays,
            "relay": {**{count: relay[count] for count in RELAY_COUNTS}, "errors": dict(errors)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="multiaddr of the insider to replay and relay to")
    args = ap.parse_args()
    stdin_closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stdin_closed.set()), daemon=True).start()
    print(json.dumps(asyncio.run(serve(args.target, stdin_closed))), flush=True)


if __name__ == "__main__":
    main()
