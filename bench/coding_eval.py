"""Evaluate policies on a fixed set of coding-env tasks: what a coding run's policy has learned.

A round's mean reward mostly says which task families that round drew; this plays the same fresh tasks with every
policy. Episode i is ``make_task(seed, f"eval-{i}", source)`` (seed 777 and the generated families by default, as
``configs/coding.toml`` trains on), played against one local coding env server with the project's evaluation loop
(``composer_diloco.policy.evaluate_policy``, ``--batch-size`` episodes at a time): render the episode with the chat
template and the env's tools, generate one assistant turn (greedy, or sampled at a temperature), parse the tool call,
run it on the server (the sandbox runs ``run_tests`` and ``submit``), until the env ends the episode, a turn without a
parsable call, or ``--max-calls``. Reward: the fraction of hidden tests passed at ``submit``, else 0.

    python bench/coding_eval.py ~/.cache/composer_diloco/warmstart/KEY RUN/checkpoints/round-000006 --temperature 0 0.6

(the warm start's ``KEY`` is in the coordinator's log: ``warm start cached at ...`` / ``reusing ... at ...``).

Prints one JSON line per (policy, temperature): the mean reward, the mean per family, and the tool calls by name.
"""

from __future__ import annotations

import argparse
import json
import sys

from composer_diloco.policy import PolicyLoadError, evaluate_policy, load_policy
from composer_diloco.rollout.env_process import EnvServerError, start_env_server
from envs.coding_env.tasks import make_task

CODING_SERVER = "envs.coding_env.server"


def evaluate(model_dir: str, *, env_url: str, episodes: int, seed: int, source: str, temperature: float,
             max_calls: int, max_turn_tokens: int, batch_size: int = 16) -> dict:
    """Mean reward of the policy in ``model_dir`` on ``episodes`` fixed tasks (see the module docstring).

    Args:
        model_dir: a save_pretrained directory (a warm start, a checkpoint) or a hub id.
        env_url: a running coding env server.
        episodes, seed, source: the tasks, ``make_task(seed, f"eval-{i}", source)`` for ``i < episodes``.
        temperature: 0 for greedy, else the sampling temperature.
        max_calls: tool calls per episode; max_turn_tokens: tokens per assistant turn.
        batch_size: episodes generated together (left-padded; 1 generates each prompt alone).

    Returns:
        ``{"policy", "temperature", "mean_reward", "by_family": {family: mean reward}, "calls_by_tool": {tool:
        calls over all episodes}, "episodes", "seconds"}``.

    Raises:
        PolicyLoadError: ``model_dir`` cannot be loaded. EnvServerError: the server stops answering.
    """
    model, tokenizer = load_policy(model_dir, seed=0, warmstart_steps=0)
    stats = evaluate_policy(model, tokenizer, episodes, seed, env_url=env_url, temperature=temperature,
                            max_calls=max_calls, max_new_tokens=max_turn_tokens, batch_size=batch_size,
                            reset_kwargs={"source": source},
                            family=lambda task_seed, episode_id: make_task(task_seed, episode_id, source).family)
    return {"policy": model_dir, "temperature": temperature, "mean_reward": round(stats["mean_reward"], 4),
            "by_family": {f: round(v["mean_reward"], 3) for f, v in stats["by_family"].items()},
            "calls_by_tool": stats["calls_by_tool"],
            "episodes": episodes, "seconds": round(stats["seconds"], 1)}


def main() -> int:
    """The command line (see the module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policies", nargs="+", help="save_pretrained directories (a warm start, a checkpoint)")
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--seed", type=int, default=777)
    parser.add_argument("--source", default="generated", help="make_task's task source")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--max-calls", type=int, default=6)
    parser.add_argument("--max-turn-tokens", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="episodes generated together")
    args = parser.parse_args()
    try:
        with start_env_server(CODING_SERVER) as server:
            for policy in args.policies:
                for temperature in args.temperature:
                    print(json.dumps(evaluate(policy, env_url=server.url, episodes=args.episodes, seed=args.seed,
                                              source=args.source, temperature=temperature, max_calls=args.max_calls,
                                              max_turn_tokens=args.max_turn_tokens,
                                              batch_size=args.batch_size)), flush=True)
    except (PolicyLoadError, EnvServerError, ValueError) as exc:
        print(f"coding_eval: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
