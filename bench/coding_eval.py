"""Evaluate policies on a fixed set of coding-env tasks, in-process: what a coding run's policy has learned.

A round's mean reward mostly says which task families that round drew; this plays the same fresh tasks with every
policy. Episode i is ``make_task(seed, f"eval-{i}", source)`` (seed 777 and the generated families by default, as
``configs/coding.toml`` trains on), played turn by turn: render the episode with the chat template and the env's
tools, generate one assistant turn (greedy, or sampled at a temperature), parse the tool call, run it with
``envs.coding_env.tools.execute`` (the sandbox runs ``run_tests`` and ``submit``), until ``submit``, a turn without a
parsable call, or ``--max-calls``. Reward: the fraction of hidden tests passed at ``submit``, else 0.

    python bench/coding_eval.py RUN/warmstart/<key> RUN/checkpoints/round-000006 --temperature 0 0.6

Prints one JSON line per (policy, temperature): the mean reward and the mean per family.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from composer_diloco.rollout.chat import episode_messages, parse_tool_call
from composer_diloco.policy import load_policy
from envs.coding_env.tasks import make_task
from envs.coding_env.tools import TOOL_SCHEMAS, execute


@torch.no_grad()
def evaluate(model_dir: str, *, episodes: int, seed: int, source: str, temperature: float, max_calls: int,
             max_turn_tokens: int) -> dict:
    """Mean reward of the policy in ``model_dir`` on ``episodes`` fixed tasks (see the module docstring).

    Returns:
        ``{"policy", "temperature", "mean_reward", "by_family": {family: mean reward}, "episodes", "seconds"}``.
    """
    model, tokenizer = load_policy(model_dir, run_dir=Path("."), seed=0, warmstart_steps=0)
    t0 = time.monotonic()
    rewards: dict[str, list[float]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(episodes):
            task = make_task(seed, f"eval-{i}", source)
            files, calls, replies, reward = task.files(), [], [], 0.0
            for _ in range(max_calls):
                prompt = tokenizer.apply_chat_template(episode_messages(task.question, calls, replies),
                                                       tools=TOOL_SCHEMAS, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
                sampling = (dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) if temperature > 0
                            else dict(do_sample=False))
                out = model.generate(**ids, max_new_tokens=max_turn_tokens, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id, **sampling)
                call = parse_tool_call(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
                if not call.ok:
                    break
                outcome = execute(task, files, call.name, call.arguments)
                calls.append((call.name, call.arguments))
                replies.append(outcome.content)
                if call.name == "submit":
                    reward = outcome.reward or 0.0
                    break
            rewards.setdefault(task.family, []).append(reward)
    every = [r for family in rewards.values() for r in family]
    return {"policy": model_dir, "temperature": temperature, "mean_reward": round(sum(every) / len(every), 4),
            "by_family": {f: round(sum(v) / len(v), 3) for f, v in sorted(rewards.items())}, "episodes": episodes,
            "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="+", help="save_pretrained directories (a warm start, a checkpoint)")
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--seed", type=int, default=777)
    parser.add_argument("--source", default="generated", help="make_task's task source")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--max-calls", type=int, default=6)
    parser.add_argument("--max-turn-tokens", type=int, default=200)
    args = parser.parse_args()
    for policy in args.policies:
        for temperature in args.temperature:
            print(json.dumps(evaluate(policy, episodes=args.episodes, seed=args.seed, source=args.source,
                                      temperature=temperature, max_calls=args.max_calls,
                                      max_turn_tokens=args.max_turn_tokens)), flush=True)


if __name__ == "__main__":
    main()
