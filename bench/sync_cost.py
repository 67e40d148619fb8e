"""Seconds of all-reduce plus outer step per DiLoCo round against parameter count, on loopback and throttled links.

``--peers`` peers (2 by default), each its own process (and its own hivemind DHT peer and p2pd daemon), run the
project's real sync path: `composer_diloco.outer.averaging.ExactAverager` built as `DiLoCoPeer` builds it (min group
2, the default config's matchmaking time, the codec of ``--codecs``, one group key per step) and then
`GlobalModel.outer_step` (fp32 CPU, SGD-Nesterov, lr 0.7, momentum 0.9) on the averaged pseudo-gradient, cloned first
as `DiLoCoPeer.sync` does. ``sparse-2bit`` all-gathers one top-k message per peer instead of the butterfly, each
encoded from the peer's error feedback first (`composer_diloco.outer.sparse`). Per step it records:

    allreduce_s    wall seconds of hivemind's all-reduce itself (`_run_allreduce_inplace_`: split, compress,
                   send, reduce, send back, decompress; or the all-gather and the weighted mean), the slowest peer
    outer_s        clone of the mean + `GlobalModel.outer_step`, the slowest peer
    encode_s       a codec with node state only (sparse-2bit, shared-blocks): error feedback + encoding (the message,
                   or the block scores) + handing it to the averager
    matchmaking_s  the rest of `averager.step` (group formation; a real round pays it once, after its barrier)
    bytes_sent     payload bytes the peer sent (per peer: mean, least and most; the mean received equals the mean sent)

Group formation (``--group-close``): ``window``, hivemind's default, waits out ``min_matchmaking_time`` (the
config's ``matchmaking_time_s``, 2 s) before the group forms; ``full``, what `DiLoCoPeer` does since its barrier
knows the group, closes it as soon as both peers are in (`ExactAverager.set_target_group_size`). Both in one run give
the side-by-side ratio.

and a round's sync cost is ``sync_s = allreduce_s + outer_s + matchmaking_s``; compute utilization is
``inner_s / (inner_s + sync_s)`` for a stated inner-phase time ``inner_s`` per round (``--inner-s``).

Links (``--links``): ``loopback`` (both peers on 127.0.0.1); ``RATE`` such as ``1gbit``/``100mbit``: the peers in two
network namespaces joined by a veth pair, each direction limited by ``tc ... tbf`` (root only); ``RATE+DELAYms``
adds a fixed one-way delay with a userspace TCP proxy (`bench/netns.py`; the kernel has no ``netem``).

Memory: a 0.5B fp32 pseudo-gradient is 2 GB a copy, and a peer holds about six (pseudo-gradient, theta, momentum,
cloned mean, gradient, hivemind's reassembled outputs): two peers of 1.5B would need ~70 GB. So a size above
``--chunk-elems`` (default 125M elements, 0.5 GB fp32) is measured in chunks: the peers all-reduce and outer-step a
chunk-sized tensor list ``ceil(size / chunk)`` times per round and the chunks' allreduce_s and outer_s add up
(per-element work and bytes are the same; matchmaking is counted once per round, as in one unchunked all-reduce).
Sizes in ``--extrapolate`` (default 1.5B) are not run at all: their rows scale the largest measured size of the
same link and codec linearly (allreduce, outer, bytes; matchmaking kept), and are labelled ``extrapolated``.
The ``default`` size is the embedded policy's real parameter layout (46 tensors, 0.90M elements); others are
split into tensors of 4M elements. Each peer gets ``torch.set_num_threads(1)``: one of this machine's 2 cores.

Inner seconds per round (``--inner-s``, defaults): ``default`` 3.8 s, measured here (median ``inner_seconds`` of
localhost runs of the default config, H=4 on 2 CPU cores); 0.5B 600 s and 1.5B 1800 s, assumed: H=500 inner steps
of ~3.6 s for a 1.5B policy on one H100 (30 min), scaled by parameter count for 0.5B.

Run (as root for the throttled links; on this 2-core machine ~2.5 min, ~10 min, ~3.5 min and ~4 min):

    python bench/sync_cost.py --sizes default --extrapolate "" --links loopback,1gbit,100mbit \
        --codecs none,int8 --rounds 3 --out runs/bench-sync-cost/default
    python bench/sync_cost.py --sizes 0.5B --extrapolate 1.5B --links loopback,1gbit,100mbit \
        --codecs none,int8 --rounds 1 --out runs/bench-sync-cost/0.5B
    python bench/sync_cost.py --sizes 1.5B --extrapolate "" --links 100mbit --codecs int8 \
        --out runs/bench-sync-cost/1.5B-check          # checks the extrapolation where it is bandwidth-bound
    python bench/sync_cost.py --sizes 0.5B --extrapolate "" --links 100mbit+20ms --codecs int8,fp16 \
        --out runs/bench-sync-cost/delay

Scaling in N (loopback only; N peer processes share this machine's 2 cores, so the seconds are CPU-bound and
contended, the bytes exact):

    for n in 2 4; do python bench/sync_cost.py --sizes default --extrapolate "" --links loopback \
        --codecs none,int8,sparse-2bit --peers $n --rounds 3 --out runs/bench-sync-cost/peers-$n; done
    python bench/sync_cost.py --sizes default --extrapolate "" --links loopback --codecs none,int8,sparse-2bit \
        --peers 8 --rounds 3 --matchmaking-s 10 --out runs/bench-sync-cost/peers-8   # 8 processes need > 2 s to meet

``--smoke`` (CI, < 60 s): loopback, the default size, fp32, one round.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from netns import PROXY_PORT, UPSTREAM_PORT, Link, LinkSpec, netns_unusable_reason, start_proxy, stop_process

ROOT = Path(__file__).resolve().parents[1]
TENSOR_ELEMS = 4 * 2**20  # split synthetic sizes into tensors of this many elements (a large layer's size)
DEFAULT_INNER_S = {"default": 3.8, "0.5B": 600.0, "1.5B": 1800.0}
OPENDILOCO_UTILIZATION = (0.90, 0.95)  # reported across continents (hivemind, fp16 all-reduce)
DEFAULT_TIMEOUT_S = 1800.0  # averaging timeout for the slow links: 1.5B fp32 at 100 Mbit/s is ~8 min a round


def parse_size(text: str) -> int | None:
    """Elements of a size token: ``0.5B`` = 500,000,000, ``125M``, ``4096``; None for ``default`` (the policy)."""
    if text == "default":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text)
    if not m:
        raise ValueError(f"size {text!r} is not 'default' or a count like 0.5B, 125M, 4096")
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[m.group(2)])


def default_layout() -> list[list[int]]:
    """Shapes of the embedded default policy's trainable parameters (builds the tiny Qwen3 once, ~10-20 s)."""
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    model = build_tiny_model(load_default_tokenizer(), seed=0)
    return [list(p.shape) for p in model.parameters() if p.requires_grad]


def chunk_layout(numel: int, chunk_elems: int) -> tuple[int, list[list[int]]]:
    """``(chunks, shapes of one chunk)`` for a synthetic size of ``numel`` elements.

    ``chunks = ceil(numel / chunk_elems)``; one chunk holds ``ceil(numel / chunks)`` elements, split into 1-D
    tensors of at most `TENSOR_ELEMS` elements (so a round averages up to ``chunks - 1`` elements more than asked).
    """
    chunks = max(1, math.ceil(numel / chunk_elems))
    per_chunk = math.ceil(numel / chunks)
    shapes = [[TENSOR_ELEMS]] * (per_chunk // TENSOR_ELEMS)
    if per_chunk % TENSOR_ELEMS:
        shapes.append([per_chunk % TENSOR_ELEMS])
    return chunks, shapes


# ------------------------------------------------------------------------------------------------------------
# One peer (its own process)
# ------------------------------------------------------------------------------------------------------------


def run_peer(args: argparse.Namespace) -> None:
    """One peer of a case: DHT, warm-up all-reduce, then ``rounds * chunks`` timed all-reduce + outer steps.

    The codec is built from the registry as `DiLoCoPeer` builds it (`codec_contract.build_codec`); one with node state
    (sparse-2bit, shared-blocks) first folds the pseudo-gradient into the peer's error feedback and prepares the round
    (`NodeState.prepare_round`: a message handed over with `ExactAverager.set_message`, or block scores sent in the
    gathered metadata), as `DiLoCoPeer` does: ``encode_s``.

    Writes ``{"steps": [{"round", "chunk", "step_s", "allreduce_s", "outer_s", "encode_s", "bytes_sent"}], ...}``
    (seconds, bytes) to ``args.result``. Raises RuntimeError when a step ends without a group of ``args.peers``.
    """
    import torch
    from hivemind.utils.timed_storage import get_dht_time
    from torch import nn

    from composer_diloco.outer.averaging import ExactAverager
    from composer_diloco.config import RunConfig
    from composer_diloco.outer.codec_contract import build_codec
    from composer_diloco.outer.peer import round_group_bits
    from composer_diloco.outer.global_model import GlobalModel
    from composer_diloco.outer.swarm import start_dht, visible_multiaddr

    class TimedAverager(ExactAverager):
        """ExactAverager that records the wall seconds of its last all-reduce (measured in its own process)."""

        def __init__(self, *a: Any, **kw: Any):
            self.last_allreduce_s = mp.Value(ctypes.c_double, 0.0)
            super().__init__(*a, **kw)

        async def _run_allreduce_inplace_(self, *a: Any, **kw: Any) -> None:
            start = time.monotonic()
            try:
                await super()._run_allreduce_inplace_(*a, **kw)
            finally:
                self.last_allreduce_s.value = time.monotonic() - start

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: averagers and the DHT (p2pd) shut down
    shapes = json.loads(args.shapes)
    started = time.monotonic()
    peer = _wait_for_file(Path(args.peer_file), [], 120.0) if args.peer_file else None
    dht = start_dht(initial_peers=[peer] if peer else [], listen=args.listen,
                    announce=[args.announce] if args.announce else None)
    averagers: list[TimedAverager] = []

    def make_averager(tensors: list[torch.Tensor], prefix: str, codec: str) -> tuple[TimedAverager, Any]:
        """The averager and the codec's node half (None for the dense codecs)."""
        # as DiLoCoPeer._make_averager, with the long timeout the slow links need
        mm = args.matchmaking_s
        from composer_diloco.outer.codecs import codec_entry

        options = json.loads(args.codec_options) if codec_entry(codec).options is not None else {}
        built = build_codec(RunConfig(compression=codec, codec_options=options), [t.shape for t in tensors])
        averagers.append(TimedAverager(
            tensors, dht, prefix=prefix, start=True, min_group_size=2,
            min_matchmaking_time=mm, request_timeout=min(5.0, mm / 2),
            allreduce_timeout=args.timeout_s, next_chunk_timeout=min(10.0, args.timeout_s / 3),
            compression=built.compression, codec=built.wire, declare_state_period=5.0,
            shutdown_timeout=5.0,
        ))
        return averagers[-1], built.node

    def step(averager: TimedAverager, index: int, extra: dict | None = None) -> tuple[float, list]:
        """One all-reduce: its seconds and the group's gathered metadata (group order)."""
        averager.set_group_bits(round_group_bits(index))
        averager.set_target_group_size(args.peers if args.group_close == "full" else None)
        t0 = time.monotonic()
        gathered = averager.step(weight=1.0, gather={"i": args.index, "round": index, "weight": 1.0, **(extra or {})},
                                 timeout=args.timeout_s, allow_retries=False,
                                 scheduled_time=get_dht_time() + args.matchmaking_s)
        if not gathered or len(gathered) != args.peers:
            raise RuntimeError(f"peer {args.index} step {index}: no group of {args.peers} ({gathered!r})")
        return time.monotonic() - t0, [c.metadata for c in gathered.values()]

    steps = []
    try:
        if args.addr_out:
            tmp = Path(args.addr_out + ".tmp")
            tmp.write_text(visible_multiaddr(dht))
            tmp.rename(args.addr_out)
        dht_s = time.monotonic() - started
        if args.barrier_dir:  # every peer's DHT is up before the first step: a slow starter would miss the group
            (Path(args.barrier_dir) / f"ready{args.index}").touch()
            deadline = time.monotonic() + 300.0
            while len(list(Path(args.barrier_dir).glob("ready*"))) < args.peers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"peer {args.index}: not all {args.peers} peers started within 300 s")
                time.sleep(0.1)

        # warm-up on a tiny tensor: both p2pd daemons connected, hivemind's code paths loaded, and torch's
        # optimizer initialised (its first step() costs ~0.5 s once, which no later round pays)
        warm, _ = make_averager([torch.zeros(1024)], "syncbench-warm", "none")
        t0 = time.monotonic()
        step(warm, 0)
        tiny = nn.Module()
        tiny.w = nn.Parameter(torch.zeros(1024))
        GlobalModel(tiny, lr=0.7, momentum=0.9).outer_step([torch.zeros(1024)])
        warmup_s = time.monotonic() - t0
        averagers.remove(warm)
        warm.shutdown()

        gen = torch.Generator().manual_seed(args.index)
        delta = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]  # pseudo-gradient-like values
        # The averager forks its process here, before theta and momentum exist: forked after them (as DiLoCoPeer
        # orders it), the first outer step would copy-on-write every page of theta and momentum (one-time, ~10x
        # the outer step's own cost on this machine), which no later round pays.
        averager, feedback = make_averager(delta, "syncbench", args.codec)
        model = nn.Module()
        model.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(7)))
                                     for s in shapes])
        global_model = GlobalModel(model, lr=0.7, momentum=0.9)
        del model
        for r in range(args.rounds):
            for c in range(args.chunks):
                sent_before = averager.bytes_sent.value
                encode_s, extra = 0.0, {}
                if feedback is not None:  # DiLoCoPeer._pseudo_gradient's codec part
                    t0 = time.monotonic()
                    with averager.get_tensors() as d:
                        prepared = feedback.prepare_round(d)
                    if prepared.message is not None:
                        averager.set_message(r * args.chunks + c, prepared.message)
                    extra = prepared.gather
                    encode_s = time.monotonic() - t0
                step_s, group = step(averager, r * args.chunks + c, extra)
                if feedback is not None:
                    feedback.observe(group, set())
                allreduce_s = averager.last_allreduce_s.value
                t0 = time.monotonic()
                with averager.get_tensors() as d:
                    mean = [t.clone() for t in d]
                global_model.outer_step(mean)
                del mean
                outer_s = time.monotonic() - t0
                if feedback is not None:
                    feedback.settle("averaged", rejected=False, contributed=True)
                steps.append({"round": r, "chunk": c, "step_s": step_s, "allreduce_s": allreduce_s,
                              "outer_s": outer_s, "encode_s": encode_s,
                              "bytes_sent": int(averager.bytes_sent.value - sent_before)})
                print(f"peer {args.index} round {r} chunk {c + 1}/{args.chunks}: step {step_s:.2f} s "
                      f"(all-reduce {allreduce_s:.2f} s), outer {outer_s:.2f} s", flush=True)
    finally:
        for a in averagers:
            a.shutdown()
        dht.shutdown()
    Path(args.result).write_text(json.dumps({"index": args.index, "dht_s": dht_s, "warmup_s": warmup_s,
                                             "steps": steps}))


# ------------------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------------------


def _wait_for_file(path: Path, procs: list[subprocess.Popen], timeout_s: float) -> str:
    """The stripped text of ``path`` once it exists (polls every 0.2 s). Raises RuntimeError after ``timeout_s``
    seconds, or when one of ``procs`` has exited first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"peer exited {p.returncode} before publishing its address")
        time.sleep(0.2)
    raise RuntimeError(f"no peer address in {path} after {timeout_s:.0f} s")


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_case(*, size: str, shapes: list[list[int]], chunks: int, numel: int, link: LinkSpec, net: Link | None,
             codec: str, args: argparse.Namespace, case_dir: Path, group_close: str = "full") -> dict:
    """Run the ``args.peers`` peers of one (size, link, codec) case; returns its row (seconds, bytes). Raises
    RuntimeError."""
    case_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    addr_file = case_dir / "peer0.addr"
    addr_file.unlink(missing_ok=True)
    for ready in case_dir.glob("ready*"):  # the start barrier's files of an earlier attempt
        ready.unlink()
    base = [sys.executable, str(Path(__file__).resolve()), "_peer", "--shapes", json.dumps(shapes),
            "--chunks", str(chunks), "--codec", codec, "--rounds", str(args.rounds),
            "--matchmaking-s", str(args.matchmaking_s), "--timeout-s", str(args.timeout_s),
            "--group-close", group_close, "--peers", str(args.peers), "--barrier-dir", str(case_dir),
            "--codec-options", json.dumps(args.codec_options)]
    started = time.monotonic()
    try:
        for index in range(args.peers):
            argv = [*base, "--index", str(index), "--result", str(case_dir / f"peer{index}.json")]
            if net is None:
                argv += ["--listen", "/ip4/127.0.0.1/tcp/0"]
            elif link.delay_ms > 0:  # p2pd behind the namespace's delay proxy
                argv += ["--listen", f"/ip4/127.0.0.1/tcp/{UPSTREAM_PORT}",
                         "--announce", f"/ip4/{net.addresses[index]}/tcp/{PROXY_PORT}"]
            else:
                argv += ["--listen", f"/ip4/{net.addresses[index]}/tcp/0"]
            if index == 0:
                argv += ["--addr-out", str(addr_file)]
            else:  # starts at once (imports in parallel), dials peer 0 once its address is there
                argv += ["--peer-file", str(addr_file)]
            if net is not None:
                argv = net.wrap(index, argv)
            with open(case_dir / f"peer{index}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + args.case_timeout_s
        for index, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"peer {index} still running after {args.case_timeout_s:.0f} s") from None
            if rc != 0:
                raise RuntimeError(f"peer {index} exited {rc}:\n{_tail(case_dir / f'peer{index}.log')}")
    finally:
        for p in procs:
            stop_process(p)
    wall_s = time.monotonic() - started
    peers = [json.loads((case_dir / f"peer{i}.json").read_text()) for i in range(args.peers)]
    row = summarize(size=size, numel=numel, chunks=chunks, link=link.name, codec=codec, peers=peers,
                    inner_s=args.inner_s.get(size), wall_s=wall_s)
    row["group_close"], row["peers"] = group_close, args.peers
    return row


def summarize(*, size: str, numel: int, chunks: int, link: str, codec: str, peers: list[dict],
              inner_s: float | None, wall_s: float) -> dict:
    """One table row from every peer's step records: per-round means over the timed rounds.

    A step's all-reduce, outer and encode seconds are the slowest peer's; a round adds its chunks' seconds;
    matchmaking is the mean per step (a real round pays it once). Bytes are per peer per round: ``bytes_per_peer``
    the mean over the peers, ``bytes_per_peer_min`` / ``_max`` the least and most one peer sent. Every byte one peer
    sends another receives, so the mean bytes received per peer equal ``bytes_per_peer``.
    """
    rounds = sorted({s["round"] for s in peers[0]["steps"]})
    per_round: dict[str, list[float]] = {"allreduce_s": [], "outer_s": [], "encode_s": [], "bytes_sent": [],
                                         "bytes_min": [], "bytes_max": []}
    matchmaking = []
    for r in rounds:
        steps = [[s for s in p["steps"] if s["round"] == r] for p in peers]
        groups = list(zip(*steps, strict=True))  # one step (chunk) of every peer
        for key in ("allreduce_s", "outer_s", "encode_s"):
            per_round[key].append(sum(max(s.get(key, 0.0) for s in g) for g in groups))
        sent = [sum(s["bytes_sent"] for s in st) for st in steps]  # per peer, this round
        per_round["bytes_sent"].append(statistics.fmean(sent))
        per_round["bytes_min"].append(min(sent))
        per_round["bytes_max"].append(max(sent))
        matchmaking += [max(s["step_s"] - s["allreduce_s"] for s in g) for g in groups]
    row = {"size": size, "numel": numel, "chunks": chunks, "link": link, "codec": codec, "rounds": len(rounds),
           "allreduce_s": statistics.fmean(per_round["allreduce_s"]), "outer_s": statistics.fmean(per_round["outer_s"]),
           "encode_s": statistics.fmean(per_round["encode_s"]),
           "matchmaking_s": statistics.fmean(matchmaking), "bytes_per_peer": statistics.fmean(per_round["bytes_sent"]),
           "bytes_per_peer_min": statistics.fmean(per_round["bytes_min"]),
           "bytes_per_peer_max": statistics.fmean(per_round["bytes_max"]),
           "allreduce_s_rounds": per_round["allreduce_s"], "wall_s": wall_s, "source": "measured"}
    return finish_row(row, inner_s)


def finish_row(row: dict, inner_s: float | None) -> dict:
    """Add ``sync_s`` (s: all-reduce + outer + matchmaking + the sparse codec's encode), ``goodput_mbit_s`` (payload
    bits sent per peer / all-reduce seconds, Mbit/s) and ``utilization`` = inner_s / (inner_s + sync_s) (None without
    an inner time) to a row, in place."""
    row["sync_s"] = row["allreduce_s"] + row["outer_s"] + row["matchmaking_s"] + row.get("encode_s", 0.0)
    row["goodput_mbit_s"] = row["bytes_per_peer"] * 8 / 1e6 / row["allreduce_s"] if row["allreduce_s"] > 0 else None
    row["inner_s"] = inner_s
    row["utilization"] = inner_s / (inner_s + row["sync_s"]) if inner_s is not None else None
    return row


def extrapolate(rows: list[dict], size: str, numel: int, inner_s: float | None) -> list[dict]:
    """Rows for ``size`` scaled linearly (by elements) from the largest measured size of each link, codec and group
    close."""
    out = []
    measured = [r for r in rows if r["source"] == "measured"]
    for link, codec, close in dict.fromkeys((r["link"], r["codec"], r.get("group_close")) for r in measured):
        base = max((r for r in measured if (r["link"], r["codec"], r.get("group_close")) == (link, codec, close)),
                   key=lambda r: r["numel"])
        k = numel / base["numel"]
        row = {"size": size, "numel": numel, "chunks": None, "link": link, "codec": codec, "rounds": 0,
               "allreduce_s": base["allreduce_s"] * k, "outer_s": base["outer_s"] * k,
               "matchmaking_s": base["matchmaking_s"], "bytes_per_peer": base["bytes_per_peer"] * k,
               "allreduce_s_rounds": [], "wall_s": 0.0, "source": f"extrapolated from {base['size']}",
               "group_close": close, "peers": base.get("peers", 2), "encode_s": base.get("encode_s", 0.0) * k}
        out.append(finish_row(row, inner_s))
    return out


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (seconds per round, MB per peer per round, utilization in %)."""
    lines = ["| size | elements | link | codec | peers | group close | all-reduce s | outer s | encode s | "
             "matchmaking s | sync s | MB/peer | goodput Mbit/s | inner s | utilization | source |",
             "|---|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        util = f"{100 * r['utilization']:.1f}%" if r["utilization"] is not None else "-"
        goodput = f"{r['goodput_mbit_s']:.0f}" if r["goodput_mbit_s"] else "-"
        inner = f"{r['inner_s']:g}" if r["inner_s"] is not None else "-"
        lines.append(f"| {r['size']} | {r['numel']:,} | {r['link']} | {r['codec']} | {r.get('peers', 2)} | "
                     f"{r.get('group_close', 'window')} | {r['allreduce_s']:.2f} | "
                     f"{r['outer_s']:.2f} | {r.get('encode_s', 0.0):.2f} | {r['matchmaking_s']:.2f} | {r['sync_s']:.2f} | "
                     f"{r['bytes_per_peer'] / 1e6:,.3f} | {goodput} | {inner} | {util} | {r['source']} |")
    return "\n".join(lines)


def _parse_inner(text: str) -> dict[str, float]:
    out = dict(DEFAULT_INNER_S)
    for item in filter(None, text.split(",")):
        size, _, seconds = item.partition("=")
        try:
            out[size] = float(seconds)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--inner-s item {item!r} is not SIZE=SECONDS") from None
    return out


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main() -> None:
    """Parse the command line; run the cases; print the table; write ``results.json`` under ``--out``."""
    if len(sys.argv) > 1 and sys.argv[1] == "_peer":
        return _peer_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_csv, default=["default", "0.5B"],
                        help="measured sizes: 'default' (the embedded policy) or element counts like 0.5B, 125M")
    parser.add_argument("--extrapolate", type=_csv, default=["1.5B"],
                        help="sizes scaled linearly from the largest measured size (not run); '' for none")
    parser.add_argument("--links", type=_csv, default=["loopback", "1gbit", "100mbit"],
                        help="loopback, RATE (e.g. 1gbit, 100mbit) or RATE+DELAYms (e.g. 100mbit+20ms)")
    parser.add_argument("--codecs", type=_csv, default=["none", "int8"],
                        help="codec names (composer_diloco.outer.codecs): none (fp32), fp16, int8, shared-blocks "
                             "(butterfly all-reduce), sparse-2bit (all-gather)")
    parser.add_argument("--codec-options", type=json.loads, default={},
                        help='JSON [codec_options] for the codecs that take them, e.g. \'{"density": 0.03125}\'')
    parser.add_argument("--peers", type=int, default=2,
                        help="peer processes in the all-reduce (more than 2: loopback only)")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per case (after a tiny warm-up)")
    parser.add_argument("--chunk-elems", type=parse_size, default=125_000_000,
                        help="largest tensor list a peer holds; bigger sizes run in chunks (elements)")
    parser.add_argument("--inner-s", type=_parse_inner, default=dict(DEFAULT_INNER_S),
                        help="inner seconds per round by size, e.g. '0.5B=600,1.5B=1800' (defaults: see docstring)")
    parser.add_argument("--matchmaking-s", type=float, default=None,
                        help="hivemind min_matchmaking_time (default: the run config's matchmaking_time_s)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="averaging timeout, seconds")
    parser.add_argument("--case-timeout-s", type=float, default=3600.0, help="give a case up after this long")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-sync-cost"))
    parser.add_argument("--group-close", type=_csv, default=["full"],
                        help="full (close the group once both peers are in, as DiLoCoPeer does), window (wait out "
                             "min_matchmaking_time, hivemind's default), or both: window,full")
    parser.add_argument("--smoke", action="store_true", help="loopback, default size, fp32, one round (< 60 s)")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.extrapolate, args.links, args.codecs, args.rounds = ["default"], [], ["loopback"], ["none"], 1
    if args.matchmaking_s is None:
        from composer_diloco.config import NetworkConfig

        args.matchmaking_s = NetworkConfig().matchmaking_time_s
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        links = [LinkSpec.parse(t) for t in args.links]
        sizes = {s: parse_size(s) for s in args.sizes}
        extra = {s: parse_size(s) for s in args.extrapolate}
    except ValueError as e:
        parser.error(str(e))
    if bad := [c for c in args.group_close if c not in ("full", "window")]:
        parser.error(f"--group-close {bad} are not among full, window")
    from composer_diloco.outer.codecs import CODECS  # torch-free

    if bad := [c for c in args.codecs if c not in CODECS]:
        parser.error(f"--codecs {bad} are not among {', '.join(CODECS)}")
    if args.peers < 2:
        parser.error(f"--peers {args.peers}: an all-reduce needs at least 2 peers")
    if args.peers > 2 and any(lk.namespaced for lk in links):
        parser.error(f"--peers {args.peers}: throttled links join 2 namespaces; more peers run on loopback only")
    if any(n is None for n in extra.values()):
        parser.error("--extrapolate takes element counts, not 'default'")
    if any(lk.namespaced for lk in links) and (why := netns_unusable_reason()):
        parser.error(f"throttled links need network namespaces, unusable here: {why}")

    # Ctrl-C and SIGTERM both unwind through the finally blocks: peers stopped, namespaces deleted
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (background)
    args.out.mkdir(parents=True, exist_ok=True)
    layouts: dict[str, tuple[int, list[list[int]], int]] = {}
    for size, numel in sizes.items():
        if numel is None:
            shapes = default_layout()
            layouts[size] = (1, shapes, sum(math.prod(s) for s in shapes))
        else:
            chunks, shapes = chunk_layout(numel, args.chunk_elems)
            layouts[size] = (chunks, shapes, numel)

    started = time.monotonic()
    rows: list[dict] = []
    failures: list[str] = []
    prefix = f"sc{os.getpid() % 100000}"
    for li, link in enumerate(links):
        net: Link | None = Link(link, prefix=f"{prefix}{li}", octet=li) if link.namespaced else None
        proxies: list[subprocess.Popen] = []
        try:
            if net is not None:
                net.open()
                if link.delay_ms > 0:
                    proxies = [start_proxy(net, side, args.out / f"proxy-{link.name}-{side}.log") for side in (0, 1)]
            for size, (chunks, shapes, numel) in layouts.items():
                for codec, close in ((c, g) for c in args.codecs for g in args.group_close):
                    name = f"{size}-{link.name}-{codec}" + (f"-{close}" if len(args.group_close) > 1 else "")
                    print(f"[{time.monotonic() - started:6.0f} s] {name}: {numel:,} elements in {chunks} chunk(s)",
                          file=sys.stderr, flush=True)
                    try:
                        row = run_case(size=size, shapes=shapes, chunks=chunks, numel=numel, link=link, net=net,
                                       codec=codec, args=args, case_dir=args.out / name, group_close=close)
                    except RuntimeError as e:
                        failures.append(f"{name}: {e}")
                        print(f"{name} FAILED: {e}", file=sys.stderr, flush=True)
                        continue
                    rows.append(row)
                    print(f"    all-reduce {row['allreduce_s']:.2f} s, outer {row['outer_s']:.2f} s, "
                          f"case wall {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
                    _write(args, rows, failures, started)
        finally:
            for p in proxies:
                stop_process(p)
            if net is not None:
                net.close()
    for size, numel in extra.items():
        rows += extrapolate(rows, size, numel, args.inner_s.get(size))
    _write(args, rows, failures, started)
    print(markdown(rows))
    print(f"\nutilization = inner_s / (inner_s + sync_s); OpenDiLoCo reported "
          f"{OPENDILOCO_UTILIZATION[0]:.0%}-{OPENDILOCO_UTILIZATION[1]:.0%} across continents. "
          f"Wall time {time.monotonic() - started:.0f} s; JSON in {args.out / 'results.json'}")
    if failures:
        raise SystemExit("failed cases:\n" + "\n".join(failures))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _write(args: argparse.Namespace, rows: list[dict], failures: list[str], started: float) -> None:
    meta = {"command": " ".join(sys.argv), "rounds": args.rounds, "chunk_elems": args.chunk_elems,
            "matchmaking_s": args.matchmaking_s, "timeout_s": args.timeout_s, "inner_s": args.inner_s,
            "opendiloco_utilization": OPENDILOCO_UTILIZATION, "wall_s": time.monotonic() - started, "peers": args.peers,
            "cpu_count": os.cpu_count(), "torch_threads_per_peer": 1}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "failures": failures}, indent=1))


def _peer_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="sync_cost.py _peer")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--shapes", required=True, help="JSON list of the chunk's tensor shapes")
    p.add_argument("--chunks", type=int, required=True)
    p.add_argument("--codec", required=True)
    p.add_argument("--codec-options", default="{}", help="JSON: [codec_options] of the codecs that take them")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--matchmaking-s", type=float, required=True)
    p.add_argument("--timeout-s", type=float, required=True)
    p.add_argument("--group-close", choices=("full", "window"), default="full")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--barrier-dir", default=None, help="wait until --peers files ready<i> are in this folder")
    p.add_argument("--listen", required=True)
    p.add_argument("--announce", default=None)
    p.add_argument("--peer-file", default=None, help="wait for this file and dial the multiaddr in it")
    p.add_argument("--addr-out", default=None)
    p.add_argument("--result", required=True)
    run_peer(p.parse_args(argv))


if __name__ == "__main__":
    main()
