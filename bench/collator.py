"""SDPO site finding speed (`composer_diloco.channels.sdpo_sites.SiteFinder`, what the SDPO channel runs each step):
our one-pass finder against the prefix re-tokenizing approach, on the same traces.

The baseline is the approach of the seed collator (`../shared/seeds/000_*`): to find where message i's tokens
lie, render and tokenize messages[:i] and messages[:i+1] with the chat template and take the difference; that is
O(turns) renderings of O(turns) length each, quadratic in the number of turns. Ours renders once with offsets
(raw traces) or reads the rollout's env_mask runs (played episodes): linear.

Both produce the same SDPO sites (checked below before timing). Run:

    python bench/collator.py --turns 8 16 32 64 --traces 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from composer_diloco.channels.dpo_pairs import render_tool_call
from composer_diloco.channels.sdpo_sites import SdpoStats, SiteFinder
from composer_diloco.policy import load_default_tokenizer
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.episodes import Episode, Turn
from envs.tool_env.tasks import TOOL_SCHEMAS, execute, make_task


def make_trace(tok, seed: int, n_turns: int, error_every: int = 4):
    """A trace of ``n_turns`` assistant turns (calls rendered by ``tok``'s chat template), one in ``error_every`` a
    failing call followed by its recovery."""
    task = make_task(seed, f"bench-{seed}")
    bad = [("sum", {"a": 1, "b": 2}), ("lookup", {"item": "zzz"}), ("add", {"x": 3})]
    good = [("lookup", {"item": task.x}), ("lookup", {"item": task.y})]
    steps = []
    for k in range(n_turns):
        name, args = bad[k % 3] if k % error_every == 0 else good[k % 2]
        content, kind, meta = execute(task, name, args)
        text, ids = render_tool_call(tok, name, args)
        steps.append((text[: -len(tok.eos_token)], ids, content, kind, meta))
    turns = [Turn("user", task.question)]
    for text, _, reply, kind, meta in steps:
        turns += [Turn("assistant", text), Turn("tool", reply, None, kind, meta)]
    return task, steps, turns


def played_episode(tok, seed: int, question: str, steps) -> Episode:
    """The `Episode` the rollout would record had the policy generated the trace's calls: prompt, then per step the
    call's ids (EOS included, env_mask 1) and the template's tool-reply suffix (env_mask 0)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tools=TOOL_SCHEMAS,
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    ep = Episode(seed, f"bench-{seed}", [Turn("user", question)], TOOL_SCHEMAS, list(prompt), end_reason="done")
    for text, ids, reply, kind, meta in steps:
        suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "tool", "content": reply}])
        ep.completion_ids += ids + suffix
        ep.env_mask += [1] * len(ids) + [0] * len(suffix)
        ep.logprobs += [0.0] * (len(ids) + len(suffix))
        ep.turns += [Turn("assistant", tok.decode(ids)), Turn("tool", reply, None, kind, dict(meta))]
    return ep


def prefix_retokenize_sites(collator: SiteFinder, turns: list[Turn], tools: list[dict]) -> list[tuple]:
    """The baseline: per-message token spans by re-tokenizing every prefix, then the same sites."""
    tok = collator.tokenizer
    messages = [{"role": t.role, "content": t.content} for t in turns]
    bounds = [len(tok.apply_chat_template(messages[:1], tools=tools, tokenize=True, return_dict=False))]
    for i in range(1, len(messages)):
        bounds.append(len(tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=True, return_dict=False)))
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    header = collator.header_ids
    sites = []
    for k in range(1, len(turns) - 1):
        if turns[k].role != "tool" or turns[k].error_kind is None or turns[k + 1].role != "assistant":
            continue
        start, end = bounds[k], bounds[k + 1]  # the recovery message's tokens, scaffolding included
        content = tok(turns[k + 1].content, add_special_tokens=False)["input_ids"]
        c0 = next(i for i in range(start, end) if ids[i:i + len(content)] == content)
        hint = collator.hints.hint(turns[k].error_kind, turns[k].error_meta)
        sites.append((k + 1, start if ids[start:start + len(header)] == header else None, c0, c0 + len(content), hint))
    return sites


def ours_sites(collator: SiteFinder, turns: list[Turn], tools: list[dict]) -> list[tuple]:
    _, sites = collator.sites_from_trace(turns, tools, SdpoStats())
    return [(s.turn, s.student_idx[0], s.student_idx[-1] + 1) for s in sites]


def timed(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--traces", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = load_default_tokenizer()
    collator = SiteFinder(tok, max_length=1 << 16)
    rows = []
    for n in args.turns:
        traces = [make_trace(tok, seed, n) for seed in range(args.traces)]
        for _, _, turns in traces:  # same sites from both before timing
            base = [(t, c0, c1) for t, _, c0, c1, _ in prefix_retokenize_sites(collator, turns, TOOL_SCHEMAS)]
            assert base == ours_sites(collator, turns, TOOL_SCHEMAS), "baseline and collator disagree"
        episodes = [played_episode(tok, s, task.question, steps) for s, (task, steps, _) in enumerate(traces)]
        t_base = timed(lambda: [prefix_retokenize_sites(collator, tr, TOOL_SCHEMAS) for _, _, tr in traces],
                       args.repeats)
        t_trace = timed(lambda: [collator.sites_from_trace(tr, TOOL_SCHEMAS, SdpoStats()) for _, _, tr in traces],
                        args.repeats)
        t_episode = timed(lambda: collator.tensors([site for ep in episodes  # the channel's build, verification off
                                                    for site in collator.sites_from_episode(ep, SdpoStats())]),
                          args.repeats)
        row = {"turns": n, "traces": args.traces, "error_sites_per_trace": sum(1 for k in range(n) if k % 4 == 0),
               "prefix_retokenize_s": round(t_base, 4), "ours_raw_trace_s": round(t_trace, 4),
               "ours_episode_s": round(t_episode, 4), "speedup_raw_trace": round(t_base / t_trace, 1),
               "speedup_episode": round(t_base / t_episode, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
