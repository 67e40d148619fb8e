"""A peer of tests/test_state_transfer.py, run as its own process (a fault SIGKILLs its whole process group).

    state_peer.py serve --role coordinator|node --name NAME [--peer MADDR|-]
        A `DiLoCoPeer` holding round 0 of a small run (theta = `model(0)`, the outer optimizer's initial state): it
        publishes its heartbeat and serves its state until its stdin closes. Faults come from $COMPOSER_DILOCO_FAULTS
        (``slow_state``, ``kill_in_state_serve``).
    state_peer.py join --peer MADDR --phase 1|2 --out FILE
        Joiners against those servers, one after the other, each its own DHT peer; writes what each saw as JSON.
        Phase 1: a joiner whose base differs from the run's (refused), one that loaded the run's base (nothing moves),
        one from a random skeleton (downloads theta from the coordinator, which is slow and then dies, and resumes
        from a node). Phase 2: a peer that holds a theta of its own downloads from the node named ``server-c`` only,
        which is slow: first with a deadline shorter than its delay, then without one while it dies mid-download:
        each fails in one line with the theta untouched.

``--peer -`` reads the multiaddr from the first line of stdin: the test starts every process at once (their imports
overlap: the suite's time) and hands each its peer when that peer is up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from composer_diloco import faults
from composer_diloco.config import NetworkConfig, OuterOptimizer, RunConfig
from composer_diloco.outer.peer import ArchitectureMismatch, DiLoCoPeer
from composer_diloco.outer.swarm import Swarm, start_dht, visible_multiaddr
from composer_diloco.policy.lora import base_sha256
from composer_diloco.reaper import watch_this_process

CHUNK = 64 * 1024  # bytes: the 4 MB weight is 64 chunks, so a fault after 20 chunks strikes mid-tensor


def config() -> RunConfig:
    # a stream may stay silent 20 s: longer than server A's 12 s before its first chunk (waited out, not retried), and
    # what the phase-2 holder waits for another server once server-c is gone (there is none: the suite's time)
    return RunConfig(run_name="statetest", outer=OuterOptimizer(optimizer="sgd", lr=0.7, momentum=0.9, nesterov=True),
                     network=NetworkConfig(heartbeat_s=1.0, heartbeat_ttl_s=6.0, state_chunk_timeout_s=20.0))


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(1024, 1024)


def peer(dht, name: str, role: str, seed: int, *, holds_theta: bool, base: str | None) -> DiLoCoPeer:
    cfg = config()
    swarm = Swarm(dht, run_name=cfg.run_name, peer_name=name, role=role)
    p = DiLoCoPeer(model(seed), cfg, swarm, holds_theta=holds_theta, base_sha256=base)
    p.chunk_bytes = CHUNK
    return p


def leave(p: DiLoCoPeer, dht) -> None:
    p.swarm.close()
    p.shutdown()
    dht.shutdown()


def serve(args: argparse.Namespace) -> None:
    faults.install_from_environment()
    watch_this_process()  # a SIGKILL by a fault takes hivemind's processes and p2pd with it
    dht = start_dht(initial_peers=[args.peer] if args.peer else [])
    p = peer(dht, args.name, args.role, 0, holds_theta=True, base=base_sha256(model(0)))
    p.transfer.manifest()  # hashed before anyone asks
    p.swarm.set_round(0, sha=p.global_model.sha256())
    p.swarm.start_heartbeat(1.0, 6.0)
    print(f"peer: {visible_multiaddr(dht)}", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    os._exit(0)


def join(args: argparse.Namespace) -> None:
    watch_this_process()  # its DHT peers and their p2pd go when it leaves through os._exit
    results: dict[str, dict] = {}
    if args.phase == 1:
        dht = start_dht(initial_peers=[args.peer])
        bad = peer(dht, "joiner-bad", "node", 2, holds_theta=False, base=base_sha256(model(2)))
        try:
            bad.load_state_from_peers(30.0)
            results["bad"] = {"raised": None}
        except ArchitectureMismatch as e:
            results["bad"] = {"raised": str(e), "ours": bad.base_sha256}
        leave(bad, dht)
        for name, seed, base in (("same", 0, base_sha256(model(0))), ("skeleton", 1, None)):
            dht = start_dht(initial_peers=[args.peer])
            j = peer(dht, f"joiner-{name}", "node", seed, holds_theta=False, base=base)
            ok = j.load_state_from_peers(30.0)
            r = j.last_download
            results[name] = {"ok": ok, "sha": j.global_model.sha256(), "round": j.round, "error": j.last_download_error,
                             "moved": r and r.bytes_moved, "kept": r and r.bytes_kept, "total": r and r.bytes_total,
                             "sources": r and r.sources, "retries": r and r.retries}
            leave(j, dht)  # it holds the state now: gone, so that the next joiner resumes from the servers only
    else:
        dht = start_dht(initial_peers=[args.peer])
        j = peer(dht, "holder", "node", 3, holds_theta=True, base=None)
        before = j.global_model.sha256()
        server = next(p for p in j.swarm.live_peers() if p.name == "server-c")
        ok = j.load_state_from_peers(30.0, peers=[server], deadline_s=2.0)  # its first chunk comes after 6 s
        results["deadline"] = {"ok": ok, "error": j.last_download_error, "after": j.global_model.sha256()}
        ok = j.load_state_from_peers(30.0, peers=[server])
        results["holder"] = {"ok": ok, "error": j.last_download_error, "before": before,
                             "after": j.global_model.sha256(), "round": j.round}
    Path(args.out).write_text(json.dumps(results))
    os._exit(0)  # hivemind's shared memory can abort an interpreter's teardown


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--role", choices=["coordinator", "node"], required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--peer")
    j = sub.add_parser("join")
    j.add_argument("--peer", required=True)
    j.add_argument("--phase", type=int, choices=[1, 2], required=True)
    j.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.peer == "-":  # given when its peer is up (module docstring)
        args.peer = sys.stdin.readline().strip()
    serve(args) if args.cmd == "serve" else join(args)


if __name__ == "__main__":
    main()
