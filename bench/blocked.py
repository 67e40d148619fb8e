"""Seconds the inner loop is blocked on sync per round, blocking against overlapped sync, through the real node code.

Each mode is one `composer-coordinator simulate` run (a coordinator and ``--nodes`` node processes on 127.0.0.1, the
embedded default policy, the default config with ``--rounds``/``--inner-steps``), the first with ``[outer] overlap``
off, the second on (`composer_diloco.outer.overlap`). The node's own metrics line gives, per round:

    inner_seconds    the inner phase (rollouts + H inner steps)
    blocked_seconds  the seconds the inner loop stood still at the round's end (`composer_diloco.diloco.DiLoCoRounds.end_round`):
                     blocking, the whole sync; overlapped, the wait for the previous round's theta, the rebase and the
                     hand-off (the run's last round also waits for its own sync: it has nothing to overlap with)
    sync_seconds     the round's sync from ready (or hand-off) to theta (in the background when overlapped)

and utilization = sum(inner) / sum(inner + blocked) over the rounds, the last round included and reported apart.

Run (2 CPU cores here; about 4 min under load):

    python bench/blocked.py --rounds 5 --out runs/bench-blocked

``--handoff-elems N`` times only the overlapped mode's foreground work at a size of N fp32 elements (the
pseudo-gradient copy and the rebase; the anchor is made in the background: `handoff_seconds`), e.g. to scale it to
a 0.5B policy:

    python bench/blocked.py --handoff-elems 33554432
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from composer_diloco.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
rounds = {rounds}
inner_steps = {inner_steps}
[outer]
overlap = {overlap}
"""


def run_mode(out: Path, overlap: bool, rounds: int, inner_steps: int, nodes: int) -> list[dict]:
    """One simulate run; returns the nodes' metrics lines (dicts of `nodes.node.Node.round_ended`)."""
    mode = "overlapped" if overlap else "blocking"
    run_dir = out / mode
    config = out / f"{mode}.toml"
    config.write_text(CONFIG.format(rounds=rounds, inner_steps=inner_steps, overlap=str(overlap).lower()))
    result = subprocess.run([sys.executable, "-m", "coordinator", "simulate", "--nodes", str(nodes), "--config",
                             str(config), "--eval-episodes", "0", "--run-dir", str(run_dir)],
                            cwd=ROOT, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    if result.returncode != 0:
        raise SystemExit(f"{mode} run failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    records = read_metrics(run_dir)
    return [r for name, recs in sorted(records.items()) if name.startswith("node") for r in recs]


def summarize(mode: str, lines: list[dict], rounds: int) -> dict:
    """Per-mode medians and utilization; the last round (waited for in both modes) apart."""
    body = [r for r in lines if r["round"] < rounds - 1]
    last = [r for r in lines if r["round"] == rounds - 1]
    inner = sum(r["inner_seconds"] for r in lines)
    blocked = sum(r["blocked_seconds"] for r in lines)
    inner_b = sum(r["inner_seconds"] for r in body)
    blocked_b = sum(r["blocked_seconds"] for r in body)
    return {
        "mode": mode, "lines": len(lines),
        "inner_s_median": statistics.median(r["inner_seconds"] for r in lines),
        "sync_s_median": statistics.median(r["sync_seconds"] for r in lines),
        "blocked_s_median": statistics.median(r["blocked_seconds"] for r in body) if body else float("nan"),
        "blocked_s_last": statistics.median(r["blocked_seconds"] for r in last) if last else float("nan"),
        "utilization_all": inner / (inner + blocked),
        "utilization_without_last": inner_b / (inner_b + blocked_b) if body else float("nan"),
        "statuses": sorted({r["status"] for r in lines}),
        "shas": sorted({(r["round"], r["global_sha256"][:12]) for r in lines}),
    }


def handoff_seconds(elems: int, repeats: int = 3) -> dict:
    """Seconds of the overlapped mode's foreground work per round for a policy of ``elems`` fp32 CPU elements (split
    into tensors of 4M): the pseudo-gradient into the averager's buffers (`GlobalModel.pseudo_gradient`, what
    `DiLoCoPeer.hand_off` runs) and the fold (`overlap._apply_correction`), each the median of ``repeats``;
    ``foreground`` is their sum. ``anchor`` (theta - Delta, `DiLoCoPeer.handed_off_weights`) and ``correction``
    (`overlap._correction`) run in the background thread, like the all-reduce and the outer step, which are not in
    it."""
    import time

    import torch
    from torch import nn

    from composer_diloco.outer.global_model import GlobalModel
    from composer_diloco.outer.overlap import _apply_correction, _correction

    sizes = [4 * 2**20] * (elems // (4 * 2**20)) + ([elems % (4 * 2**20)] if elems % (4 * 2**20) else [])
    model = nn.ParameterList([nn.Parameter(torch.randn(n)) for n in sizes])
    theta = GlobalModel(model, lr=1.0, momentum=0.0)
    delta = [torch.empty(n) for n in sizes]
    timings: dict[str, list[float]] = {"pseudo_gradient": [], "anchor": [], "fold": [], "correction": []}
    for _ in range(repeats):
        t = time.perf_counter()
        theta.pseudo_gradient(model, delta)
        timings["pseudo_gradient"].append(time.perf_counter() - t)
        t = time.perf_counter()
        anchor = [torch.sub(g, d) for g, d in zip(theta.params, delta, strict=True)]
        timings["anchor"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _correction(theta.params, anchor)
        timings["correction"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _apply_correction(model, anchor)
        timings["fold"].append(time.perf_counter() - t)
        del anchor
    out = {k: statistics.median(v) for k, v in timings.items()}
    out["foreground"] = out["pseudo_gradient"] + out["fold"]
    out["elems"] = elems
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-blocked"))
    ap.add_argument("--handoff-elems", type=int, default=0,
                    help="instead of the runs: time the overlapped foreground work (`handoff_seconds`) at this size")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.handoff_elems:
        print(json.dumps(handoff_seconds(args.handoff_elems)))
        return
    rows = []
    for overlap in (False, True):
        mode = "overlapped" if overlap else "blocking"
        lines = run_mode(args.out, overlap, args.rounds, args.inner_steps, args.nodes)
        (args.out / f"{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        rows.append(summarize(mode, lines, args.rounds))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))


def table(rows: list[dict], percent_digits: int = 1) -> str:
    """The markdown table of `summarize` rows, one per mode."""
    lines = ["| mode | node-rounds | inner s (median) | sync s (median) | blocked s (median, rounds 0..R-2) | "
             "blocked s (last round) | utilization (rounds 0..R-2) | utilization (all) | statuses |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    pct = f".{percent_digits}%"
    for r in rows:
        lines.append(f"| {r['mode']} | {r['lines']} | {r['inner_s_median']:.2f} | {r['sync_s_median']:.2f} | "
                     f"{r['blocked_s_median']:.3f} | {r['blocked_s_last']:.2f} | "
                     f"{r['utilization_without_last']:{pct}} | {r['utilization_all']:{pct}} | "
                     f"{', '.join(r['statuses'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
