"""Rollout seconds with and without the KV cache kept across turns, side by side in one process.

Both arms play the same episodes with the same warm-started default policy against one tool_env server
(`composer_diloco.rollout.episodes.play_episodes`, the code path of an inner step): ``cached`` keeps each lock-step
batch's `TurnCache`, so a turn encodes only the tool reply and the next header; ``full`` re-encodes every episode's
whole history every turn (the rollout before the cache). The arms alternate (full, cached, cached, full, ...) with
the torch seed reset before each call, so both see the same machine load and draw the same random numbers; each
pair's episodes are compared token for token.

``--synthetic`` measures `generate_turns` alone on longer histories than the tiny policy's episodes reach: 16 rows, a
300-token prompt, 6 turns of 40 sampled tokens (EOS disabled, so every row samples all 40) each followed by an
80-token "tool reply", ending near 1,020 tokens; random-token contexts, for the embedded default's architecture and for
a wider one (hidden 512, 8 layers, ~26M parameters, random weights): what re-encoding costs as histories and models
grow.

Run: ``python bench/rollout_cache.py [--episodes 16] [--repeats 3] [--run-dir runs/bench-rollout-cache]`` (the warm
start is cached per user, ``~/.cache/composer_diloco/warmstart``; ~1 min on 2 CPU cores once it is there),
``python bench/rollout_cache.py --synthetic`` (~3 min).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from composer_diloco.policy import load_policy
from composer_diloco.rollout import episodes as rollout
from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.sessions import open_env_sessions


WIDER = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64)
"""The ``--synthetic`` larger architecture (``tiny_model_config`` overrides)."""


def synthetic(repeats: int) -> None:
    """``--synthetic``: `generate_turns` with and without its `TurnCache` over growing random contexts (docstring)."""
    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    tok = load_default_tokenizer()
    vocab = len(tok) - 8

    def turns(model, cached: bool, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        contexts = [torch.randint(5, vocab, (300,), generator=g).tolist() for _ in range(16)]
        cache = rollout.TurnCache() if cached else None
        t0 = time.perf_counter()
        for turn in range(6):
            torch.manual_seed(100 * seed + turn)
            ids, _ = rollout.generate_turns(model, tok, contexts, 40, 1.0, cache=cache)
            contexts = [c + i + torch.randint(5, vocab, (80,), generator=g).tolist() for c, i in zip(contexts, ids)]
        return time.perf_counter() - t0

    print("| model | parameters | full s (6 turns) | cached s | speed-up |\n|---|---:|---:|---:|---:|")
    for name, overrides in (("embedded default", {}), ("wider", WIDER)):
        model = build_tiny_model(tok, 0, **overrides).eval()
        model.generation_config.eos_token_id = None  # every row samples all 40 tokens of every turn
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(repeats):
            for cached in ((False, True) if rep % 2 == 0 else (True, False)):
                seconds[cached].append(turns(model, cached, rep))
        full, cached = statistics.median(seconds[False]), statistics.median(seconds[True])
        print(f"| {name} | {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M | {full:.2f} | {cached:.2f} | "
              f"{full / cached:.2f}x |")


def main() -> None:
    """Parse the command line, run both arms, print the table and write ``results.json`` under ``--run-dir``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16, help="episodes per call (groups of 4)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per arm")
    parser.add_argument("--max-tool-calls", type=int, default=6)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench-rollout-cache"))
    parser.add_argument("--synthetic", action="store_true", help="generate_turns alone on longer random histories")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.synthetic:
        return synthetic(args.repeats)
    model, tok = load_policy(None, seed=0, warmstart_steps=200)
    model.eval()
    real = rollout.generate_turns

    def full(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        return real(model, tokenizer, contexts, max_new_tokens, temperature, cache=None)

    server = start_env_server("envs.tool_env.server", startup_timeout_s=60)
    seconds: dict[str, list[float]] = {"full": [], "cached": []}
    identical = total = 0
    worst = 0.0
    turns: list[int] = []
    try:
        sessions = open_env_sessions([server.url], args.episodes, max_tool_calls=args.max_tool_calls)
        suffix = functools.partial(tool_suffix_ids, tok)
        for rep in range(args.repeats):
            keys = [(rep, f"bench{i // 4}") for i in range(args.episodes)]
            played = {}
            for arm in (("full", "cached") if rep % 2 == 0 else ("cached", "full")):
                rollout.generate_turns = full if arm == "full" else real
                torch.manual_seed(1000 + rep)
                t0 = time.perf_counter()
                played[arm] = rollout.play_episodes(model, tok, sessions, keys, tool_suffix_ids=suffix,
                                                    max_tool_calls=args.max_tool_calls, max_turn_tokens=40,
                                                    max_seq_len=1024, temperature=1.0)
                seconds[arm].append(time.perf_counter() - t0)
            rollout.generate_turns = real
            for a, b in zip(played["full"], played["cached"]):
                total += 1
                if a.completion_ids == b.completion_ids:
                    identical += 1
                    worst = max([worst, *(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))])
            turns += [sum(t.role == "assistant" for t in e.turns) for e in played["full"]]
        for s in sessions:
            s.close()
    finally:
        rollout.generate_turns = real
        server.stop()
    result = {
        "episodes": args.episodes, "repeats": args.repeats, "seconds": seconds,
        "median_s": {k: statistics.median(v) for k, v in seconds.items()},
        "speedup": statistics.median(seconds["full"]) / statistics.median(seconds["cached"]),
        "identical_episodes": identical, "episodes_compared": total, "max_abs_logprob_diff": worst,
        "assistant_turns_mean": statistics.fmean(turns),
    }
    args.run_dir.mkdir(parents=True, exist_ok=True)
    (args.run_dir / "results.json").write_text(json.dumps(result, indent=2))
    print("| arm | median s per play_episodes call | calls |\n|---|---:|---:|")
    for arm in ("full", "cached"):
        print(f"| {arm} | {result['median_s'][arm]:.2f} | {len(seconds[arm])} |")
    print(f"\nspeed-up {result['speedup']:.2f}x; identical episodes {identical}/{total}; max |logprob difference| "
          f"{worst:.1e}; {result['assistant_turns_mean']:.1f} assistant turns per episode on average")


if __name__ == "__main__":
    main()
