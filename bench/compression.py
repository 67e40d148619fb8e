"""Bytes on the wire per round for each pseudo-gradient codec (none / fp16 / int8), measured side by side.

Each codec runs the same short localhost simulation (`composer-coordinator simulate`: a coordinator and N nodes
as real processes over real hivemind all-reduces); the bytes are the payload each peer counted while sending
(`ExactAllReduceRunner`), so they reflect what the codec put on the wire. Ratios are against ``none`` in the
same invocation. Run:

    python bench/compression.py --nodes 2 --rounds 2 --out runs/bench-compression
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from composer_diloco.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CODECS = ("none", "fp16", "int8")


def run_codec(codec: str, out: Path, nodes: int, rounds: int) -> dict:
    """Simulate one run with ``compression = codec``; returns bytes per round and whether replicas agreed."""
    run_dir = out / codec
    config = out / f"{codec}.toml"
    config.write_text(f'compression = "{codec}"\nrounds = {rounds}\ninner_steps = 2\n')
    warm = out / "warmstart"  # one warm start shared by all codecs
    warm.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "warmstart").exists():
        (run_dir / "warmstart").symlink_to(warm.resolve(), target_is_directory=True)
    result = subprocess.run([sys.executable, "-m", "coordinator", "simulate", "--nodes", str(nodes), "--config",
                             str(config), "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{codec}: simulate exited {result.returncode}\n{result.stderr[-3000:]}")
    metrics = read_metrics(run_dir)
    per_round_total, per_peer, agree = [], [], True
    for r in range(rounds):
        records = [rec for recs in metrics.values() for rec in recs if rec["round"] == r]
        per_round_total.append(sum(rec["bytes_sent"] for rec in records))
        per_peer.extend(rec["bytes_sent"] for rec in records)
        agree &= len({rec["global_sha256"] for rec in records}) == 1
    return {"codec": codec, "total_per_round": statistics.fmean(per_round_total),
            "per_peer_per_round": statistics.fmean(per_peer), "agree": agree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-compression"))
    args = parser.parse_args()
    if args.out.exists() and any(args.out.glob("*/*/metrics.jsonl")):
        raise SystemExit(f"--out {str(args.out)!r} already holds results: pick a new folder")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run_codec(c, args.out, args.nodes, args.rounds) for c in CODECS]
    base = rows[0]["total_per_round"]
    print(f"{'codec':>6}  {'bytes/round (all peers)':>24}  {'bytes/round/peer':>17}  {'vs none':>8}  sha256 agree")
    for row in rows:
        print(f"{row['codec']:>6}  {row['total_per_round']:>24,.0f}  {row['per_peer_per_round']:>17,.0f}  "
              f"{row['total_per_round'] / base:>8.3f}  {'yes' if row['agree'] else 'NO'}")


if __name__ == "__main__":
    main()
