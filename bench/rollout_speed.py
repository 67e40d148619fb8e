"""Rollout engines side by side: generated tokens per second of `play_episodes` with ``engine="batched"`` (one
``generate`` of every episode per turn, in lock-step) and ``engine="continuous"`` (transformers' continuous batching,
`composer_diloco.rollout.continuous`), on the same model, env server and episode keys, alternating, in one process.

Each repeat plays the same ``--episodes`` keys (groups of G = 4) with each engine at temperature 1.0 and reports the
rollout's wall seconds, its ``generation`` and ``env`` parts (`composer_diloco.timing.PhaseClock`), the tokens the
policy generated (``env_mask`` 1), tokens per second of the whole rollout, and the continuous/batched ratio of the
medians. Run:

    python bench/rollout_speed.py                          (the embedded default, warm-started: cached per machine)
    python bench/rollout_speed.py --model runs/qwen3-0.6b-random --episodes 8 --max-tool-calls 4
        (a `bench/real_arch.py build` folder: Qwen3-0.6B's architecture with planted calls)
    add --device cuda on a GPU; --json OUT writes the rows.

On a GPU, ``--engines`` picks the variants (default ``batched continuous``): ``continuous-graphs`` is the continuous
engine with transformers' CUDA graphs forced on (``ContinuousBatchingConfig(use_cuda_graph=True)``, set here only: an
exploration of what the node could use); ``--lora R`` wraps the model with LoRA rank R as a ``[lora]`` node does,
``--dtype bf16`` places it as a bf16 node does (frozen linears in bf16, autocast forward: the batched engine only). A
variant that fails is reported with its error and the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def cuda_graphs(on: bool):
    """Within: the continuous engine's managers run with CUDA graphs forced on (``use_cuda_graph=True``)."""
    if not on:
        yield
        return
    from composer_diloco.rollout import continuous

    plain = continuous._manager_configs

    def with_graphs(*args, **kwargs):
        generation, batching = plain(*args, **kwargs)
        batching.use_cuda_graph = True
        return generation, batching

    continuous._manager_configs = with_graphs
    try:
        yield
    finally:
        continuous._manager_configs = plain


def main() -> None:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a save_pretrained folder; default: the embedded default")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-tool-calls", type=int, default=6)
    ap.add_argument("--max-turn-tokens", type=int, default=48)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engines", nargs="+", default=["batched", "continuous"],
                    choices=["batched", "continuous", "continuous-graphs"])
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: no adapters)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from composer_diloco.policy import load_policy
    from composer_diloco.rollout.env_process import start_env_server
    from composer_diloco.rollout.episode_tokens import tool_suffix_ids
    from composer_diloco.rollout.play import play_episodes
    from composer_diloco.rollout.sessions import open_env_sessions
    from composer_diloco.timing import PhaseClock, cuda_sync_for

    model, tok = load_policy(a.model, seed=0, warmstart_steps=0 if a.model else 200)
    if a.lora:
        from composer_diloco.config import LoraSection
        from composer_diloco.policy.lora import apply_lora

        model = apply_lora(model, LoraSection(r=a.lora, lora_alpha=a.lora))
    if a.dtype == "bf16":
        from nodes.device import Placement

        model = Placement(a.device, True).place(model)
    model = model.to(a.device).eval()
    server = start_env_server("envs.tool_env.server", startup_timeout_s=60)
    rows = []
    try:
        sessions = open_env_sessions([server.url], a.episodes, max_tool_calls=a.max_tool_calls)
        keys = [(0, f"speed{i // 4}") for i in range(a.episodes)]
        for repeat in range(a.repeats):
            for engine in a.engines:
                torch.manual_seed(repeat)
                clock = PhaseClock("other", sync=cuda_sync_for(a.device))
                t0 = time.perf_counter()
                try:
                    with cuda_graphs(engine == "continuous-graphs"):
                        episodes = play_episodes(
                            model, tok, sessions, keys, tool_suffix_ids=functools.partial(tool_suffix_ids, tok),
                            max_tool_calls=a.max_tool_calls, max_turn_tokens=a.max_turn_tokens,
                            max_seq_len=a.max_seq_len, temperature=1.0, engine=engine.split("-")[0], clock=clock)
                except Exception as e:  # noqa: BLE001 - one variant failing is a row of the report
                    rows.append({"engine": engine, "repeat": repeat, "error": f"{type(e).__name__}: {e}"[:400]})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                seconds = time.perf_counter() - t0
                parts = clock.take()
                tokens = sum(sum(e.env_mask) for e in episodes)
                row = {"engine": engine, "repeat": repeat, "seconds": round(seconds, 3), "tokens": tokens,
                       "tokens_per_s": round(tokens / seconds, 1), "generation_s": round(parts.get("generation", 0), 3),
                       "env_s": round(parts.get("env", 0), 3),
                       "turns": sum(e.tool_calls for e in episodes), "reward": statistics.fmean(e.reward for e in episodes)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        for s in sessions:
            s.close()
    finally:
        server.stop()
    median = {e: statistics.median(r["tokens_per_s"] for r in rows if r["engine"] == e and "error" not in r)
              for e in a.engines if any(r["engine"] == e and "error" not in r for r in rows)}
    summary = {"model": a.model or "embedded default", "device": a.device, "dtype": a.dtype, "lora": a.lora,
               "episodes": a.episodes, "max_tool_calls": a.max_tool_calls, "max_turn_tokens": a.max_turn_tokens,
               "median_tokens_per_s": median,
               **{f"{e}_over_batched": round(median[e] / median["batched"], 2)
                  for e in median if e != "batched" and "batched" in median}}
    print(json.dumps(summary))
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
