"""A peer of tests/test_closed_run.py, run as its own process: an outsider attacking a run, or a helper.

    outsider_peer.py attack --peer MADDR --run-name NAME [--prefix P] [--join-for S]
        Without the run secret (or with a wrong one in $COMPOSER_DILOCO_SECRET) try, against the peer at MADDR:
        joining the DHT and reading the run config; reading and writing the run's records with direct DHT RPCs
        (the run config, a heartbeat, an averager declaration that would make nodes download state from us);
        averaging with the open-run prefix; and calling the averager's RPCs (join group, aggregate part) and the
        state transfer's (manifest, chunks: `composer_diloco.outer.state_transfer`) directly, under the open prefix
        and under ``--prefix`` (the closed run's prefix, which libp2p's identify protocol would tell any connected
        peer). Prints ``{"peer_id", "attempts": {name: {"ok", "detail"}}}``
        as JSON: ``ok`` is true when the attack succeeded.
        ``--peer -`` (any mode) reads MADDR from stdin's first line: the test starts it beside the peer it attacks.
    outsider_peer.py join-loop --peer MADDR --prefix P
        Without the secret, ask the peer at MADDR to take us into its group until stdin closes; prints the replies.
    outsider_peer.py host --run-name NAME
        A stand-in for a coordinator (secret from $COMPOSER_DILOCO_SECRET, if set): a DHT with the run config, an
        averager, and a `StateTransfer` that serves a small state. Prints ``peer: MADDR`` and serves until stdin closes.
    outsider_peer.py inspect --peer MADDR --run-name NAME
        An insider (it needs $COMPOSER_DILOCO_SECRET): prints the run config, heartbeats and averager declarations
        that the run's DHT holds, as JSON.
    outsider_peer.py dial --peer MADDR --via XADDR --seconds S
        An insider (it needs $COMPOSER_DILOCO_SECRET) tricked into talking to XADDR, an outsider (`relay_peer.py`):
        its DHT joins the run at MADDR, then for S seconds pings XADDR and sends it a find of the run config and a
        store of a record, as it would to any peer in its routing table; meanwhile a second insider DHT asks MADDR
        where it routes the first one's DHT identity (node_id). Prints ``{"node_id", "via": {rpc: [answered,
        failed]}, "routes": [peer IDs MADDR gave for our node_id], "config_read"}`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import threading
import time
import traceback
from collections import Counter
from functools import partial

import hivemind
import torch
from hivemind.averaging.averager import compute_schema_hash
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, dht_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from composer_diloco.outer.auth import (
    BoundRPCClient, ClosedDHT, HMACAuthorizer, MembersOnlyAverager, RunMembers, averaging_prefix, load_secret,
)
from composer_diloco.outer.averaging import ExactAverager
from composer_diloco.outer.global_model import GlobalModel
from composer_diloco.outer.state_transfer import CHUNKS_RPC, MANIFEST_RPC, Manifest, StateTransfer
from composer_diloco.config import RunConfig
from composer_diloco.outer.peer import round_group_bits
from composer_diloco.outer.swarm import RUNS_KEY, publish_config, start_dht

RPC_TIMEOUT_S = 10.0
HOST_TENSORS = [torch.zeros(4)]  # what `host` averages (a real run's schema differs: its join is refused anyway)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def _peer_id(maddr: str) -> PeerID:
    return PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])


class Attack:
    """The attempts of one outsider; each records ``{"ok": attack succeeded, "detail": what happened}``."""

    def __init__(self, maddr: str, run_name: str, leaked_prefix: str | None):
        self.maddr, self.run_name, self.leaked_prefix = maddr, run_name, leaked_prefix
        self.target = _peer_id(maddr)
        self.secret = load_secret(None)  # a wrong secret, or None: the outsider never has the right one
        self.authorizer = HMACAuthorizer(self.secret) if self.secret else None
        self.attempts: dict[str, dict] = {}
        self.peer_id = ""

    def dht(self, **kwargs) -> hivemind.DHT:
        """Our DHT peer: with a (wrong) secret, one that signs as a closed run's peers do, bound to connections."""
        if self.secret:
            return ClosedDHT(initial_peers=[self.maddr], start=True, secret=self.secret, **kwargs)
        return hivemind.DHT(initial_peers=[self.maddr], start=True, **kwargs)

    def record(self, name: str, ok: bool, detail: str, **extra) -> None:
        self.attempts[name] = {"ok": bool(ok), "detail": detail[:600], **extra}

    # -- (a) join the DHT and read the run config ---------------------------------------------------------
    def join_dht(self) -> None:
        try:
            dht = self.dht()
        except Exception as e:
            self.record("join_dht_and_read_config", False, _error(e))
            return
        try:
            found = dht.get(RUNS_KEY, latest=True)
            runs = sorted(found.value) if found is not None and isinstance(found.value, dict) else []
            self.record("join_dht_and_read_config", self.run_name in runs, f"joined the DHT; runs visible: {runs}")
        finally:
            dht.shutdown()

    # -- (b) direct DHT RPCs to the target: read and write the run's records --------------------------------
    def _dht_stub(self, p2p):
        stub = super(DHTProtocol, DHTProtocol).get_stub(p2p, self.target)  # the raw stub, no authorizer of its own
        return BoundRPCClient(stub, self.authorizer, p2p.peer_id, self.target) if self.authorizer else stub

    async def find_config(self, p2p) -> None:
        request = dht_pb2.FindRequest(keys=[DHTID.generate(source=RUNS_KEY).to_bytes()])
        try:
            response = await self._dht_stub(p2p).rpc_find(request, timeout=RPC_TIMEOUT_S)
        except Exception as e:
            self.record("read_config_rpc", False, _error(e))
            return
        found = response is not None and response.results and response.results[0].type != dht_pb2.NOT_FOUND
        self.record("read_config_rpc", found, f"reply: {response}")

    async def store(self, p2p, name: str, key: str, subkey, value) -> None:
        request = dht_pb2.StoreRequest(
            keys=[DHTID.generate(source=key).to_bytes()], subkeys=[MSGPackSerializer.dumps(subkey)],
            values=[MSGPackSerializer.dumps(value)], expiration_time=[get_dht_time() + 7200.0], in_cache=[False],
        )
        try:
            response = await self._dht_stub(p2p).rpc_store(request, timeout=RPC_TIMEOUT_S)
        except Exception as e:
            self.record(name, False, _error(e))
            return
        stored = response is not None and list(response.store_ok) == [True]
        self.record(name, stored, f"store_ok: {None if response is None else list(response.store_ok)}")

    # -- (c) the averager's RPCs, called directly ----------------------------------------------------------
    async def download_state(self, p2p, name: str, prefix: str) -> None:
        """Ask the target for the run's state as a joiner does (`composer_diloco.outer.state_transfer`): its manifest,
        then the bytes of its first tensor (under the manifest's state id, or a made-up one)."""
        async def messages(rpc: str, request):
            stream = await p2p.iterate_protobuf_handler(self.target, f"{prefix}::{rpc}", request,
                                                        averaging_pb2.DownloadData)
            return [m async for m in stream]

        outcomes = []
        for _ in range(3):  # as a joiner retries: a reply that times out on a loaded box is not a refusal
            manifest = None
            try:
                replies = await asyncio.wait_for(messages(MANIFEST_RPC, averaging_pb2.DownloadData()), RPC_TIMEOUT_S)
                metas = [MSGPackSerializer.loads(m.metadata) for m in replies if m.metadata]
                manifest = next((Manifest.from_wire(m["manifest"]) for m in metas if "manifest" in m), None)
                ask = {"state_id": manifest.state_id if manifest else "0" * 64, "tensors": [0], "offset": 0,
                       "chunk_bytes": 1 << 16}
                chunks = await asyncio.wait_for(
                    messages(CHUNKS_RPC, averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(ask))),
                    RPC_TIMEOUT_S)
            except Exception as e:
                outcomes.append(_error(e))
                continue
            if any(m.tensor_part.buffer for m in chunks):
                self.record(name, True, "; ".join(outcomes + ["received model state"]))
                return
            # an empty stream is a closed run's refusal, or (seen once on a loaded 2-core CI box, against the open
            # control) a connection the daemon closed before the reply: asked again like a timeout, refused 3 times
            outcomes.append(f"empty reply: no state sent{' (a manifest came)' if manifest else ''}")
        self.record(name, False, "; ".join(outcomes))

    async def join_group(self, p2p, name: str, servicer, prefix: str, duration_s: float,
                         until: threading.Event | None = None) -> None:
        """Ask to join the target's group again and again for ``duration_s`` or until ``until`` is set (a round's
        group may form meanwhile). Records the replies as ``{code or error: count}``."""
        codes, accepted, deadline = Counter(), False, time.monotonic() + duration_s
        while not accepted:
            for round_ in (0, 1):
                request = averaging_pb2.JoinRequest(
                    schema_hash=compute_schema_hash(HOST_TENSORS), expiration=get_dht_time() + 5.0,
                    group_key=f"{prefix}.0b{round_group_bits(round_)}",
                    gather=MSGPackSerializer.dumps({"name": "outsider", "round": round_, "weight": 1000.0}))

                async def replies():
                    stream = await servicer.get_stub(p2p, self.target, namespace=prefix).rpc_join_group(request)
                    return [averaging_pb2.MessageCode.Name(m.code) async for m in stream]

                try:
                    got = await asyncio.wait_for(replies(), RPC_TIMEOUT_S)
                except Exception as e:
                    codes[_error(e)] += 1
                    continue
                codes.update(got)
                accepted = accepted or bool({"ACCEPTED", "BEGIN_ALLREDUCE"} & set(got))
            if time.monotonic() > deadline or (until is not None and until.is_set()):
                break
            await asyncio.sleep(0.5)
        self.record(name, accepted, f"replies: {sorted(codes)}", replies=dict(codes))

    async def aggregate_part(self, p2p, name: str, servicer, prefix: str) -> None:
        async def replies():
            request = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING,
                                                  group_id=secrets.token_bytes(16), weight=1000.0)

            async def requests():
                yield request

            stream = await servicer.get_stub(p2p, self.target, namespace=prefix).rpc_aggregate_part(requests())
            return [averaging_pb2.MessageCode.Name(m.code) async for m in stream]

        empty = 0
        for _ in range(3):  # as download_state: an empty stream may be a connection the daemon closed before the reply
            try:
                got = await asyncio.wait_for(replies(), RPC_TIMEOUT_S)
            except Exception as e:
                self.record(name, False, _error(e), empty_replies=empty)
                return
            if got:
                break
            empty += 1
        self.record(name, "AVERAGED_PART" in got, f"replies: {got}", empty_replies=empty)

    def averager_open_prefix(self, dht) -> None:
        """A real averager under the open run's prefix: look for the run's group, then download its state."""
        averager = ExactAverager([t.clone() for t in HOST_TENSORS], dht,
                                 prefix=averaging_prefix(self.run_name, None), start=True, min_group_size=2,
                                 min_matchmaking_time=2.0, request_timeout=1.0)
        try:
            averager.set_group_bits(round_group_bits(0))
            try:
                gathered = averager.step(weight=1000.0, timeout=4.0, allow_retries=False)
                step = f"step: {gathered}"
            except Exception as e:
                gathered, step = None, f"step: {_error(e)}"
            state = averager.load_state_from_peers(timeout=3.0)
            self.record("averager_open_prefix", bool(gathered) or state is not None,
                        f"{step}; load_state_from_peers: {'a state' if state is not None else None}")
        finally:
            averager.shutdown()

    def run(self, join_for_s: float) -> dict:
        self.join_dht()
        # a DHT peer that starts although nobody let it in: its p2p daemon is connected to the target
        dht = self.dht(ensure_bootstrap_success=False)
        self.peer_id = dht.peer_id.to_base58()
        try:
            found = dht.get(RUNS_KEY, latest=True)
            self.record("read_config_via_dht", found is not None, f"get: {found}")
            prefixes = [(averaging_prefix(self.run_name, None), ExactAverager, "open_prefix")]
            if self.leaked_prefix:
                prefixes.append((self.leaked_prefix, MembersOnlyAverager, "closed_prefix"))

            async def rpcs(dht_, _node=None):
                p2p = await dht_.replicate_p2p()
                await self.find_config(p2p)
                evil = json.dumps({"run_name": self.run_name, "rounds": 10_000, "outer": {"lr": 1e6}})
                await self.store(p2p, "overwrite_config_rpc", RUNS_KEY, self.run_name, evil)
                await self.store(p2p, "store_heartbeat_rpc", f"{self.run_name}.peers", "outsider",
                                 {"role": "node", "round": 0, "t": get_dht_time()})
                for prefix, _, label in prefixes:
                    await self.store(p2p, f"declare_averager_rpc_{label}", f"{prefix}.all_averagers",
                                     dht_.peer_id.to_bytes(), 1e9)
                for prefix, servicer, label in prefixes:
                    await self.download_state(p2p, f"download_state_rpc_{label}", prefix)
                    await self.aggregate_part(p2p, f"aggregate_part_rpc_{label}", servicer, prefix)
                    await self.join_group(p2p, f"join_group_rpc_{label}", servicer, prefix, join_for_s)

            asyncio.run(rpcs(dht))
            self.averager_open_prefix(dht)
        finally:
            dht.shutdown()
        return {"peer_id": self.peer_id, "attempts": self.attempts}

    def join_loop(self) -> dict:
        """Keep asking the target to take us into its group (closed prefix) until our stdin closes."""
        dht = self.dht(ensure_bootstrap_success=False)
        self.peer_id = dht.peer_id.to_base58()
        # only now: a thread blocked reading stdin while hivemind forks its DHT process deadlocks that process
        until = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), until.set()), daemon=True).start()
        try:
            async def ask(dht_, _node=None):
                p2p = await dht_.replicate_p2p()
                await self.join_group(p2p, "join_group_rpc_during_training", MembersOnlyAverager, self.leaked_prefix,
                                      3600.0, until)

            asyncio.run(ask(dht))
        finally:
            dht.shutdown()
        return {"peer_id": self.peer_id, "attempts": self.attempts}


def host(run_name: str) -> None:
    secret = load_secret(None)
    dht = start_dht(initial_peers=[], secret=secret)
    publish_config(dht, RunConfig(run_name=run_name))
    averager_type = MembersOnlyAverager if secret else ExactAverager
    prefix = averaging_prefix(run_name, secret)
    averager = averager_type([t.clone() for t in HOST_TENSORS], dht, prefix=prefix, start=True, min_group_size=2,
                             min_matchmaking_time=2.0, request_timeout=1.0)
    # a small state served as a peer serves its own (after the averager forked, as `DiLoCoPeer` does)
    state = GlobalModel(torch.nn.Linear(2, 4), lr=1.0, momentum=0.0)
    transfer = StateTransfer(dht, prefix, state, threading.Lock(),
                             lambda: {"run": run_name, "round": 0, "serves": True, "base_sha256": None, "layout": []},
                             members=RunMembers(dht, prefix) if secret else None, name="host")
    print(f"peer: {dht.get_visible_maddrs()[0]}", flush=True)
    try:
        averager.set_group_bits(round_group_bits(0))
        control = averager.step(weight=1.0, wait=False, timeout=3600.0, allow_retries=True)  # a leader waiting
        sys.stdin.read()  # until the test closes our stdin
        control.cancel()
    finally:
        transfer.close()
        averager.shutdown()
        dht.shutdown()


def inspect(maddr: str, run_name: str) -> dict:
    secret = load_secret(None)
    assert secret, "inspect needs $COMPOSER_DILOCO_SECRET"
    dht = start_dht(initial_peers=[maddr], secret=secret)
    try:
        def subkeys(key: str) -> dict:
            found = dht.get(key, latest=True)
            return dict(found.value) if found is not None and isinstance(found.value, dict) else {}

        configs = {str(k): v.value for k, v in subkeys(RUNS_KEY).items()}
        peers = {str(k): v.value for k, v in subkeys(f"{run_name}.peers").items()}
        members = [PeerID(k).to_base58() for k in subkeys(f"{averaging_prefix(run_name, secret)}.all_averagers")]
        return {"config": configs.get(run_name), "runs": sorted(configs), "peers": peers, "members": members}
    finally:
        dht.shutdown()


def dial(maddr: str, via: str, seconds: float, run_name: str) -> dict:
    secret = load_secret(None)
    assert secret, "dial needs $COMPOSER_DILOCO_SECRET"
    victim = start_dht(initial_peers=[maddr], secret=secret)
    observer = start_dht(initial_peers=[maddr], secret=secret)
    target, relay = _peer_id(maddr), _peer_id(via)
    node_id = victim.run_coroutine(_node_id)
    via_results = {"rpc_ping": [0, 0], "rpc_find": [0, 0], "rpc_store": [0, 0]}
    routes: set[str] = set()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for rpc, ok in victim.run_coroutine(partial(_talk_to, relay, run_name)).items():
                via_results[rpc][0 if ok else 1] += 1
            routes |= set(observer.run_coroutine(partial(_routes_of, target, node_id)))
            time.sleep(0.3)
        config = victim.get(RUNS_KEY, latest=True)
    finally:
        observer.shutdown()
        victim.shutdown()
    return {"node_id": node_id, "via": via_results, "routes": sorted(routes), "config_read": config is not None}


async def _node_id(_dht, node) -> str:
    return node.node_id.to_bytes().hex()


async def _talk_to(peer: PeerID, run_name: str, _dht, node) -> dict:
    """One ping, find and store sent to ``peer`` by this DHT node's protocol (signed as any DHT request is)."""
    ping = await node.protocol.call_ping(peer)
    found = await node.protocol.call_find(peer, [DHTID.generate(source=RUNS_KEY)])
    stored = await node.protocol.call_store(
        peer, [DHTID.generate(source=f"{run_name}.dial")], [MSGPackSerializer.dumps("hello")],
        get_dht_time() + 60.0)
    return {"rpc_ping": ping is not None, "rpc_find": found is not None, "rpc_store": stored is not None}


async def _routes_of(peer: PeerID, node_id_hex: str, _dht, node) -> list[str]:
    """The peer IDs ``peer`` gives for the DHT node ``node_id_hex`` (its routing table's nearest nodes)."""
    key = DHTID.from_bytes(bytes.fromhex(node_id_hex))
    found = await node.protocol.call_find(peer, [key])
    if not found:
        return []
    _, nearest = found[key]
    return [p.to_base58() for n, p in nearest.items() if n == key]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["attack", "join-loop", "host", "inspect", "dial"])
    ap.add_argument("--via", default="", help="dial: the outsider's multiaddr")
    ap.add_argument("--seconds", type=float, default=6.0, help="dial: how long to talk to --via")
    ap.add_argument("--peer", default="")
    ap.add_argument("--run-name", default="composer")
    ap.add_argument("--prefix", default=None, help="the closed run's averager prefix, as identify would leak it")
    ap.add_argument("--join-for", type=float, default=5.0, help="seconds to keep asking to join a group")
    args = ap.parse_args()
    if args.peer == "-":  # given on stdin's first line once that peer is up: this process's imports overlap its start
        args.peer = sys.stdin.readline().strip()
    if args.mode == "host":
        host(args.run_name)
        return
    try:
        if args.mode == "attack":
            out = Attack(args.peer, args.run_name, args.prefix).run(args.join_for)
        elif args.mode == "dial":
            out = dial(args.peer, args.via, args.seconds, args.run_name)
        elif args.mode == "join-loop":
            out = Attack(args.peer, args.run_name, args.prefix).join_loop()
        else:
            out = inspect(args.peer, args.run_name)
    except Exception:
        traceback.print_exc()
        sys.exit(2)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
