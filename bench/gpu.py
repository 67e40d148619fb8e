"""The GPU yardstick: real-size runs on one GPU in one command, no download, a table to compare every change with.

Runs, in this order (a short machine loan still gets the first rows), each a `composer-coordinator simulate` of random
Qwen3 architectures built by `bench/real_arch.py` (planted tool calls, so episodes have calls, tool errors, SDPO sites
and DPO pairs; no reward):

    0.6b-lora-2nodes        Qwen3-0.6B LoRA r=16, coordinator + 2 nodes, configs/qwen3_0.6b_lora.toml (2 rounds)
    0.6b-full-2nodes        the same with full fine-tuning, configs/qwen3_0.6b_full.toml (the 7 GB state download)
    0.6b-16ep-batched       one node, 16 episodes a step (G = 8, 2 tasks, <= 6 calls of <= 48 tokens, 1,024-token
                            episodes, SDPO and DPO on), --rollout batched, bf16: the step of 2026-11-27 (19.5 s then)
    0.6b-16ep-batched-fp32  the same in fp32 (--dtype fp32)
    0.6b-16ep-continuous    the same in fp32 with --rollout continuous (continuous batching runs in fp32 only:
                            `nodes.options.resolve_rollout_engine`), against the row above
    1.7b-16ep               Qwen3-1.7B LoRA, one node, the same step (--rollout auto, bf16)

For each: exit codes, whether every round's theta agreed, and from the nodes' metrics lines of the last round: seconds
per inner step, episodes and generated tokens per second, the inner phase by part (``inner_phase_seconds``), the sync
by part, peak device memory measured (``torch.cuda.max_memory_allocated``) and planned. It writes ``OUT/gpu.json``
after every run, ``OUT/gpu.md`` (a markdown table) at the end, and exits 1 if a run failed. ``--budget-s`` (default
290) skips the runs that would start after it.

    python bench/gpu.py --out runs/gpu                 (on the GPU machine: `../shared/gpu-probe/README.md` for the
                                                        wheels it needs; PYTHONPATH=<repo> HF_HUB_OFFLINE=1)
    python bench/gpu.py --out /tmp/gpu-dry --dry-run   (CPU, 2-layer architectures, 1 round each: checks the script)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

PERF = {  # the 16-episode step of the 2026-11-27 H200 run (19.5 s a step then: issue "Real sizes, part 2")
    "rounds": 1, "inner_steps": 2, "max_seq_len": 1024,
    "env.max_tool_calls": 6, "env.max_turn_tokens": 48,
    "grpo.num_generations": 8, "grpo.tasks_per_step": 2,
    "loss.alpha_sdpo": 0.2, "loss.beta_dpo": 0.2,
    "preference.max_sites": 4, "preference.max_pairs_per_turn": 2,  # the defaults, as that run had
}
DRY = {  # --dry-run: the same code paths, at sizes a 2-core CPU runs in seconds
    "arch": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=1024),
    "two_nodes": {},  # 2 rounds of H = 1 already: a second node that starts late still joins round 1
    "perf": {"rounds": 1, "inner_steps": 1, "max_seq_len": 512, "env.max_tool_calls": 3, "env.max_turn_tokens": 40,
             "grpo.num_generations": 4, "grpo.tasks_per_step": 1},
}


@dataclass
class Run:
    """One row of the table: a simulate of ``arch`` with ``config`` (a file under configs/ or ``"perf"``)."""

    name: str
    arch: str
    config: str
    nodes: int
    rollout: str = "auto"
    lora: bool = True
    dtype: str = "auto"
    result: dict = field(default_factory=dict)


RUNS = [
    Run("0.6b-lora-2nodes", "0.6b", "qwen3_0.6b_lora.toml", 2),
    Run("0.6b-full-2nodes", "0.6b", "qwen3_0.6b_full.toml", 2, lora=False),
    Run("0.6b-16ep-batched", "0.6b", "perf", 1, rollout="batched"),
    Run("0.6b-16ep-batched-fp32", "0.6b", "perf", 1, rollout="batched", dtype="fp32"),
    Run("0.6b-16ep-continuous", "0.6b", "perf", 1, rollout="continuous", dtype="fp32"),
    Run("1.7b-16ep", "1.7b", "perf", 1),
]


def run_config(run: Run, out: Path, dry: bool) -> Path:
    """The run's config file under ``out/configs`` (`real_arch.write_config` over configs/qwen3_0.6b_lora.toml for
    ``"perf"``; with ``dry`` the sizes of `DRY`)."""
    from real_arch import write_config

    if run.config == "perf":
        settings = {**PERF, **(DRY["perf"] if dry else {})}
        base = ROOT / "configs" / "qwen3_0.6b_lora.toml"
    else:
        settings = DRY["two_nodes"] if dry else {}
        base = ROOT / "configs" / run.config
    return write_config(base, out / "configs" / f"{run.name}.toml",
                        [f"{k}={json.dumps(v)}" for k, v in settings.items()])


def summarize(result: dict) -> dict:
    """The table's figures of one `real_arch.watch_simulate` result: exit code, agreement, and node-0's last round."""
    from composer_diloco.metrics import replicas_agree, thetas_by_round

    rounds = result.get("rounds", {})
    nodes = sorted(name for name in rounds if name.startswith("node"))
    last = rounds[nodes[0]][-1] if nodes and rounds[nodes[0]] else {}
    steps = max(int(last.get("inner_steps", 0)), 1)
    inner = last.get("inner_seconds", 0.0)
    return {
        "exit": result.get("exit"),
        "agree": replicas_agree(rounds),
        "rounds": len(thetas_by_round(rounds)),
        "seconds": result.get("seconds"),
        "inner_s_per_step": round(inner / steps, 2) if last else None,
        "episodes_per_s": round(last.get("samples", 0) / inner, 2) if inner else None,
        "generated_tokens_per_s": last.get("generated_tokens_per_s"),
        "inner_phase_seconds": last.get("inner_phase_seconds", {}),
        "outer_phase_seconds": last.get("outer_phase_seconds", {}),
        "sync_seconds": last.get("sync_seconds"),
        "sdpo_sites": last.get("sdpo_sites"), "dpo_pairs": last.get("dpo_pairs"),
        "memory_peak_gb": round(last["memory_peak_bytes"] / 1e9, 2) if last.get("memory_peak_bytes") else None,
        "memory_planned_gb": round(last["memory_planned_bytes"] / 1e9, 2) if last.get("memory_planned_bytes") else None,
        "peak_rss_gb": {k: round(v / 1e9, 2) for k, v in result.get("peak_rss", {}).items() if v > 100e6},
    }


def table(runs: list[Run]) -> str:
    """The markdown table of the runs done so far."""
    lines = ["| run | exit | agree | s/step | episodes/s | gen tok/s | largest parts of the inner phase (s) | "
             "peak/plan GB | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s = run.result.get("summary")
        if s is None:
            lines.append(f"| {run.name} | {run.result.get('skipped', 'not run')} | | | | | | | |")
            continue
        parts = sorted(s["inner_phase_seconds"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"| {run.name} | {s['exit']} | {'yes' if s['agree'] else 'NO'} | {s['inner_s_per_step']} | "
                     f"{s['episodes_per_s']} | {s['generated_tokens_per_s']} | "
                     f"{', '.join(f'{k} {v:.2f}' for k, v in parts)} | {s['memory_peak_gb']}/{s['memory_planned_gb']} | "
                     f"{s['seconds']} |")
    return "\n".join(lines)


def device_info(device: str) -> dict:
    """What the numbers were measured on: the card, torch, transformers, the date."""
    import torch
    import transformers

    card = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "cpu"
    return {"device": card, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu.json, gpu.md, the models and the runs")
    ap.add_argument("--dry-run", action="store_true", help="CPU, 2-layer architectures, 1 round each")
    ap.add_argument("--budget-s", type=float, default=290.0, help="start no run after this many seconds")
    ap.add_argument("--only", nargs="*", help="run only these names, in the order given (default: all, in order)")
    ap.add_argument("--run-timeout-s", type=float, default=240.0, help="stop a run after this many seconds")
    a = ap.parse_args(argv)
    from real_arch import build, watch_simulate

    import torch

    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: error: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(a.only or ()) - {r.name for r in RUNS})
    if unknown:
        print(f"bench/gpu.py: error: --only {' '.join(unknown)}: expected names among {', '.join(r.name for r in RUNS)}",
              file=sys.stderr)
        return 2
    configs = {run.name: run_config(run, a.out, a.dry_run) for run in RUNS}  # every config checked before a build
    runs = [next(r for r in RUNS if r.name == name) for name in a.only] if a.only else RUNS  # --only: its order
    report = {**device_info(device), "dry_run": a.dry_run, "runs": []}
    t0 = time.monotonic()
    models: dict[str, Path] = {}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for run in runs:
        if time.monotonic() - t0 > a.budget_s:
            run.result = {"skipped": f"skipped: {a.budget_s:.0f} s budget spent"}
        else:
            if run.arch not in models:
                folder = a.out / "models" / run.arch
                if (folder / "config.json").exists():  # built by an earlier call with this --out
                    print(f"reusing {folder}", flush=True)
                    models[run.arch] = folder
                else:
                    models[run.arch] = build(run.arch, folder, **(DRY["arch"] if a.dry_run else {}))
            config = configs[run.name]
            run_dir = a.out / "runs" / run.name
            shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier call: its metrics are not this run's
            args = ["--model", str(models[run.arch]), "--nodes", str(run.nodes), "--config", str(config),
                    "--device", device, "--rollout", run.rollout, "--dtype", run.dtype, "--eval-episodes", "0"]
            print(f"== {run.name}: simulate {' '.join(args)}", flush=True)
            result = watch_simulate(args, run_dir, timeout_s=a.run_timeout_s)
            run.result = {"args": args, "summary": summarize(result), "metrics": result["rounds"]}
            print(json.dumps({run.name: run.result["summary"]}), flush=True)
        report["runs"] = [{"name": r.name, "arch": r.arch, "nodes": r.nodes, "rollout": r.rollout, **r.result}
                          for r in runs if r.result]
        (a.out / "gpu.json").write_text(json.dumps(report, indent=1))
    text = f"{report['device']}, torch {report['torch']}, transformers {report['transformers']}, {report['date']}" \
           f"{' (dry run)' if a.dry_run else ''}\n\n{table(runs)}\n"
    (a.out / "gpu.md").write_text(text)
    print(text)
    failed = [r.name for r in runs if "summary" in r.result
              and (r.result["summary"]["exit"] != 0 or not r.result["summary"]["agree"])]
    if failed:
        print(f"bench/gpu.py: failed: {', '.join(failed)} (logs under {a.out / 'runs'})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
