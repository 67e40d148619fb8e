"""Rollout seconds with and without the KV cache kept across turns, side by side in one process.

Both arms play the same episodes with the same warm-started default policy against one tool_env server
(`composer_diloco.rollout.play.play_episodes`, the code path of an inner step): ``cached`` keeps each lock-step
batch's `TurnCache`, so a turn encodes only the tool reply and the next header; ``full`` re-encodes every episode's
whole history every turn (the rollout before the cache). The arms alternate (full, cached, cached, full, ...) with
the torch seed reset before each call, so both see the same machine load and draw the same random numbers; each
pair's episodes are compared token for token.

``--synthetic`` measures `generate_turns` alone on longer histories than the tiny policy's episodes reach, per
``--arch`` (the embedded default; a wider one, hidden 512, 8 layers, ~26M parameters; Qwen3-0.6B's architecture,
596M parameters; all random weights) and per ``--turns`` count: ``--rows`` random-token episodes in one lock-step
batch, a ``--prompt-tokens`` prompt, then per turn ``--reply-tokens`` sampled tokens (no EOS: the tokenizer handed to
`generate_turns` has none, so every row samples all of them) followed by a ``--tool-tokens`` random "tool reply".
Defaults: 16 rows, a 300-token prompt, 6 turns of 40 sampled + 80 reply tokens, ending near 1,020 tokens. It prints
seconds per call (one batch of ``--rows`` episodes), per episode, generated tokens per second, the speed-up in wall
seconds and in process CPU seconds (the work, robust to other processes holding the cores), and how many rows sampled
the same tokens in both arms (log-prob difference on those); ``--run-dir``/synthetic.json keeps every call's seconds.

Run: ``python bench/rollout_cache.py [--episodes 16] [--repeats 3] [--run-dir runs/bench-rollout-cache]`` (the warm
start is cached per user, ``~/.cache/composer_diloco/warmstart``; ~1 min on 2 CPU cores once it is there),
``python bench/rollout_cache.py --synthetic`` (~3 min), ``python bench/rollout_cache.py --synthetic --arch qwen3-0.6b
--turns 2 6 12 --rows 4 --prompt-tokens 60 --reply-tokens 8 --tool-tokens 16 --repeats 1 --threads 1`` (BENCHMARKS.md
section 6; ``--threads 1`` where other processes load the cores: two threads that wait on each other's barrier when
one is descheduled made a 0.6B decode step 3-8 s instead of 0.4-0.8 s at load 5-6 on 2 cores).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from composer_diloco.policy import load_policy
from composer_diloco.rollout import episodes as rollout
from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.sessions import open_env_sessions


WIDER = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64)
"""The ``--synthetic`` larger architecture (``tiny_model_config`` overrides)."""

ARCHS = ("default", "wider", "qwen3-0.6b")
"""``--arch`` choices: the embedded default, `WIDER`, and Qwen3-0.6B's published architecture (`real_arch.qwen3_config`:
hidden 1024, SwiGLU 3072, 28 layers, 16 heads of 128, 8 key/value heads, vocabulary 151,936, tied embeddings, RoPE theta
1e6, 40,960 positions; 596M parameters), all with random weights."""


def synthetic_model(arch: str, tok) -> torch.nn.Module:
    """The ``arch`` model (one of `ARCHS`), random weights from seed 0, fp32 on CPU, eval mode, EOS unset in its
    ``generation_config``. Qwen3-0.6B keeps its 151,936-row vocabulary (the compute of its real embedding and LM head);
    only the shipped tokenizer's pad id is used, and context tokens are drawn from its first ids (as for the other
    archs); sampled ids range over all 151,936."""
    from transformers import AutoModelForCausalLM

    from composer_diloco.policy import build_tiny_model

    if arch == "qwen3-0.6b":
        from real_arch import qwen3_config  # bench/ is sys.path[0] when this file runs as a script

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(qwen3_config("0.6b", tok), dtype=torch.float32)
    else:
        model = build_tiny_model(tok, 0, **(WIDER if arch == "wider" else {}))
    model.generation_config.eos_token_id = None
    return model.eval()


def synthetic_episodes(model, tok, *, cached: bool, seed: int, rows: int, prompt: int, turns: int, reply: int,
                       tool: int) -> tuple[float, float, list[list[int]], list[list[float]]]:
    """One lock-step batch of ``rows`` random episodes of ``turns`` assistant turns through `generate_turns`.

    Each row starts from ``prompt`` random token ids; every turn samples exactly ``reply`` tokens (temperature 1, no
    EOS: the tokenizer handed to `generate_turns` has none) and appends them and ``tool`` random "tool reply" ids. The
    torch seed is reset to ``100 * seed + turn`` before each turn and the random ids come from a generator seeded with
    ``seed``, so both arms see the same draws.

    Returns:
        (seconds, cpu_seconds, ids, logps): wall and process CPU seconds of the ``turns`` calls (CPU seconds count
        the work, not the time other processes held the cores); per row, its sampled ids over all turns
        (``turns * reply``) and their log-probs.
    """
    vocab = len(tok) - 8
    no_eos = SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=None)
    g = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(5, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    sampled: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    cache = rollout.TurnCache() if cached else None
    t0, c0 = time.perf_counter(), time.process_time()
    for turn in range(turns):
        torch.manual_seed(100 * seed + turn)
        ids, lps = rollout.generate_turns(model, no_eos, contexts, reply, 1.0, cache=cache)
        for row, (i, lp) in enumerate(zip(ids, lps)):
            sampled[row] += i
            logps[row] += lp
        contexts = [c + i + torch.randint(5, vocab, (tool,), generator=g).tolist() for c, i in zip(contexts, ids)]
    return time.perf_counter() - t0, time.process_time() - c0, sampled, logps


def synthetic(args: argparse.Namespace) -> list[dict]:
    """``--synthetic``: `generate_turns` with (``cached``) and without (``full``) its `TurnCache`, per ``--arch`` and
    ``--turns``; the arms alternate (the order flips every repeat and every turn count) with the same seeds.

    Prints one markdown row per (arch, turns): median seconds per call (one lock-step batch of ``--rows`` episodes),
    per episode (call / rows), generated tokens per second (rows * turns * reply / call seconds), the speed-up
    (full / cached) in wall seconds and in process CPU seconds, how many (row, repeat) pairs sampled the same tokens in both arms and the largest |log-prob
    difference| over those. Returns the rows as dicts (also written to ``--run-dir``/synthetic.json).
    """
    from composer_diloco.policy import load_default_tokenizer

    tok = load_default_tokenizer()
    sizes = dict(rows=args.rows, prompt=args.prompt_tokens, reply=args.reply_tokens, tool=args.tool_tokens)
    print("| model | parameters | turns | sizes | full s/call | cached s/call | full s/episode | cached s/episode | "
          "full tok/s | cached tok/s | speed-up | CPU-s speed-up | same tokens | max abs logprob diff |\n"
          "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    results = []
    for arch in args.arch:
        model = synthetic_model(arch, tok)
        for k, turns in enumerate(args.turns):
            seconds: dict[bool, list[float]] = {False: [], True: []}
            cpu: dict[bool, list[float]] = {False: [], True: []}
            same = compared = 0
            worst = 0.0
            tokens: dict[bool, int] = {}
            for rep in range(args.repeats):
                played = {}
                for cached in ((False, True) if (rep + k) % 2 == 0 else (True, False)):
                    s, c, ids, lps = synthetic_episodes(model, tok, cached=cached, seed=rep, turns=turns, **sizes)
                    seconds[cached].append(s)
                    cpu[cached].append(c)
                    played[cached] = (ids, lps)
                    tokens[cached] = sum(map(len, ids))  # rows * turns * reply: no EOS ends a row early
                (ids_f, lps_f), (ids_c, lps_c) = played[False], played[True]
                for a, b, lp_f, lp_c in zip(ids_f, ids_c, lps_f, lps_c):
                    compared += 1
                    if a == b:
                        same += 1
                        worst = max([worst, *(abs(x - y) for x, y in zip(lp_f, lp_c))])
            full, cached = statistics.median(seconds[False]), statistics.median(seconds[True])
            cpu_speedup = statistics.median(cpu[False]) / statistics.median(cpu[True])
            row = dict(arch=arch, parameters=sum(p.numel() for p in model.parameters()), turns=turns, **sizes,
                       repeats=args.repeats, threads=args.threads, full_s=seconds[False], cached_s=seconds[True],
                       full_cpu_s=cpu[False], cached_cpu_s=cpu[True], tokens_per_call=tokens[True],
                       full_s_per_call=full, cached_s_per_call=cached, full_s_per_episode=full / args.rows,
                       cached_s_per_episode=cached / args.rows, full_tokens_per_s=tokens[False] / full,
                       cached_tokens_per_s=tokens[True] / cached, speedup=full / cached, cpu_speedup=cpu_speedup,
                       same_rows=same, rows_compared=compared, max_abs_logprob_diff=worst)
            results.append(row)
            print(f"| {arch} | {row['parameters'] / 1e6:.1f}M | {turns} | {args.rows} x ({args.prompt_tokens} + "
                  f"{turns} x ({args.reply_tokens} + {args.tool_tokens})) | {full:.2f} | {cached:.2f} | "
                  f"{full / args.rows:.3f} | {cached / args.rows:.3f} | {tokens[False] / full:.1f} | "
                  f"{tokens[True] / cached:.1f} | {full / cached:.2f}x | {cpu_speedup:.2f}x | {same}/{compared} | "
                  f"{worst:.1e} |", flush=True)
        del model
    args.run_dir.mkdir(parents=True, exist_ok=True)
    (args.run_dir / "synthetic.json").write_text(json.dumps(results, indent=2))
    return results


def main() -> None:
    """Parse the command line, run both arms, print the table and write ``results.json`` under ``--run-dir``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16, help="episodes per call (groups of 4)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per arm")
    parser.add_argument("--max-tool-calls", type=int, default=6)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench-rollout-cache"))
    parser.add_argument("--synthetic", action="store_true", help="generate_turns alone on longer random histories")
    parser.add_argument("--arch", nargs="+", choices=ARCHS, default=["default", "wider"], help="--synthetic models")
    parser.add_argument("--turns", nargs="+", type=int, default=[6], help="--synthetic assistant turns per episode")
    parser.add_argument("--rows", type=int, default=16, help="--synthetic episodes per lock-step batch")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="--synthetic prompt length")
    parser.add_argument("--reply-tokens", type=int, default=40, help="--synthetic tokens sampled per assistant turn")
    parser.add_argument("--tool-tokens", type=int, default=80, help="--synthetic tool-reply tokens after each turn")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.synthetic:
        synthetic(args)
        return
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
                played[arm] = play_episodes(model, tok, sessions, keys, tool_suffix_ids=suffix,
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
