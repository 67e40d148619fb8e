"""Bytes on the wire per round for each pseudo-gradient codec (none / fp16 / int8 / sparse-2bit), against data-parallel
training.

Each codec runs the same short localhost simulation (`composer-coordinator simulate`: a coordinator and N nodes
as real processes over real hivemind all-reduces); the bytes are the payload each peer counted while sending
(`ExactAllReduceRunner`), so they reflect what the codec put on the wire. Ratios are against ``none`` in the
same invocation.

Data-parallel training of the same samples would all-reduce one fp32 gradient per inner step: a ring (or
butterfly) all-reduce among N peers sends ``2 (N - 1) / N * 4 P`` bytes per peer per step (P parameters; the
standard bandwidth-optimal figure, e.g. NCCL's "bus bandwidth"), so ``H`` times that per round. That figure is
computed, not measured; ours is measured. Note that our all-reduce has N + 1 peers (the coordinator joins it
with weight 0 to receive the mean), so a node sends ``2 N / (N + 1) * b P`` per round.

``sparse-2bit`` (`composer_diloco.outer.sparse`) is all-gathered instead (`SparseGatherRunner`, bytes counted the
same way): a node sends its one message to each of the other N members (N - 1 nodes and the coordinator), so its
bytes grow with N while data-parallel's per-node bytes do not. A last table scales the measured bytes per message to
other N (``N x measured bytes / N measured``), computed, not measured. Run:

    python bench/compression.py --nodes 2 --rounds 2 --out runs/bench-compression
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from composer_diloco.metrics import read_metrics, replicas_agree

ROOT = Path(__file__).resolve().parents[1]
CODECS = ("none", "fp16", "int8", "sparse-2bit", "shared-blocks")


def run_codec(codec: str, out: Path, nodes: int, rounds: int) -> dict:
    """Simulate one run with ``compression = codec``; returns bytes per round and whether replicas agreed."""
    run_dir = out / codec
    config = out / f"{codec}.toml"
    config.write_text(f'compression = "{codec}"\nrounds = {rounds}\ninner_steps = 2\n')
    run_dir.mkdir(parents=True, exist_ok=True)  # one warm start shared by all codecs: the per-user cache
    result = subprocess.run([sys.executable, "-m", "coordinator", "simulate", "--eval-episodes", "0", "--nodes", str(nodes), "--config",
                             str(config), "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{codec}: simulate exited {result.returncode}\n{result.stderr[-3000:]}")
    metrics = read_metrics(run_dir)
    per_round_total, per_peer = [], []
    for r in range(rounds):
        records = [rec for recs in metrics.values() for rec in recs if rec["round"] == r]
        per_round_total.append(sum(rec["bytes_sent"] for rec in records))
        per_peer.extend(rec["bytes_sent"] for rec in records)
    per_node = [rec["bytes_sent"] for recs in metrics.values() for rec in recs if rec.get("role") == "node"]
    return {"codec": codec, "total_per_round": statistics.fmean(per_round_total),
            "per_peer_per_round": statistics.fmean(per_peer), "per_node_per_round": statistics.fmean(per_node),
            "agree": replicas_agree(metrics)}


def parameter_count() -> int:
    """Trainable parameters P of the embedded default policy."""
    from composer_diloco.config import RunConfig
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    model = build_tiny_model(load_default_tokenizer(), RunConfig().warmstart.seed)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def data_parallel_bytes(params: int, nodes: int, inner_steps: int) -> float:
    """Bytes one of ``nodes`` peers sends per round in data-parallel training: one fp32 gradient all-reduce
    (``2 (N - 1) / N * 4 P`` bytes) per inner step, ``inner_steps`` steps."""
    return inner_steps * 2 * (nodes - 1) / nodes * 4 * params


def _ratio(r: float) -> str:
    """``ours / data-parallel`` as a share and as "1/x" (x = times fewer bytes)."""
    return f"{r:.4f} (1/{1 / r:,.0f})" if r > 0 else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS))
    parser.add_argument("--out", type=Path, default=Path("runs/bench-compression"))
    args = parser.parse_args()
    if args.out.exists() and any(args.out.glob("*/*/metrics.jsonl")):
        raise SystemExit(f"--out {str(args.out)!r} already holds results: pick a new folder")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run_codec(c, args.out, args.nodes, args.rounds) for c in args.codecs]
    params = parameter_count()
    base = rows[0]["total_per_round"]
    print(f"P = {params:,} parameters, N = {args.nodes} nodes (+ the coordinator in the all-reduce)\n")
    print(f"| codec | bytes/round, all peers | bytes/round/node | vs {rows[0]['codec']} | sha256 agree |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['codec']} | {row['total_per_round']:,.0f} | {row['per_node_per_round']:,.0f} | "
              f"{row['total_per_round'] / base:.3f} | {'yes' if row['agree'] else 'NO'} |")
    n = max(args.nodes, 2)  # data-parallel training of one node sends nothing: compare with its smallest swarm
    print(f"\nPer node per round against data-parallel training of the same samples (N = {n}"
          f"{' (one node: the smallest data-parallel swarm)' if args.nodes < 2 else ''}, one fp32 "
          "gradient all-reduce per inner step; ratio = ours / data-parallel):\n")
    hs = (4, 16, 64, 500)
    print("| codec | " + " | ".join(f"H = {h}" for h in hs) + " |")
    print("|---|" + "---|" * len(hs))
    print("| data-parallel | " + " | ".join(f"{data_parallel_bytes(params, n, h):,.0f} B" for h in hs) + " |")
    for row in rows:
        print(f"| {row['codec']} | " + " | ".join(
            _ratio(row['per_node_per_round'] / data_parallel_bytes(params, n, h)) for h in hs) + " |")
    sparse = [row for row in rows if row["codec"] == "sparse-2bit"]
    if sparse and args.nodes >= 1:
        per_message = sparse[0]["per_node_per_round"] / args.nodes  # a node sends one message to each of N members
        print(f"\nsparse-2bit against N (computed from the measured {per_message:,.0f} B a message: a node sends N "
              "messages a round, data-parallel 2 (N - 1) / N x 4 P a step; ratio = data-parallel / ours):\n")
        ns = (2, 4, 8, 16, 32)
        print("| H | " + " | ".join(f"N = {n_}" for n_ in ns) + " |")
        print("|---|" + "---|" * len(ns))
        for h in hs:
            print(f"| {h} | " + " | ".join(
                f"{data_parallel_bytes(params, n_, h) / (n_ * per_message):,.0f}x" for n_ in ns) + " |")
    (args.out / "traffic.json").write_text(json.dumps({"params": params, "nodes": args.nodes, "rows": rows}))


if __name__ == "__main__":
    main()
