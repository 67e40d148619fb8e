"""Evaluation: play a fixed set of fresh episodes against an env and report what the policy achieves.

One loop for every env and every caller (``python -m composer_diloco.policy evaluate``, ``bench/coding_eval.py``):
episode ``i`` is ``reset(seed, f"eval-{i}")`` on a session of the env server at ``env_url`` (any env this project
plays: typed OpenEnv or MCP, see ``composer_diloco.rollout.sessions.open_env_sessions``) or of an env package played in
this process, without a server (``env``: the env contract's ``EnvPackage.local_session``), so every policy meets the
same tasks. Each turn re-renders the episode so far with the chat template and the tools the env announced
(``add_generation_prompt=True``), generates one assistant turn (``model.generate``, greedy or sampled, stopping at
eos), parses it with ``composer_diloco.rollout.chat.parse_tool_call`` and sends the call to the env. An episode ends
when the env says done (its reward is the episode's), at a turn with no parsable call (a format failure, reward 0),
or after ``max_calls`` calls (the env is given the same budget).

Why not ``composer_diloco.rollout.play.play_episodes``: that is the training rollout (token-carrying, always
sampled, ends a turn cut before eos); this one decodes greedily too and re-renders each turn, as the measured
figures in README.md and :mod:`composer_diloco.policy.warmstart` were taken.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from composer_diloco.rollout.chat import episode_messages, parse_tool_call
from composer_diloco.rollout.episodes import EnvSession

__all__ = ["EVAL_EPISODE_PREFIX", "Comparison", "FamilyFn", "compare_policies", "evaluate_policy"]

logger = logging.getLogger(__name__)

EVAL_EPISODE_PREFIX = "eval"
"""Episode ``i`` of an evaluation is ``(seed, f"eval-{i}")``: ids no warm start (``warmstart-i``) or run draws."""

FamilyFn = Callable[[int, str], str]
"""``(seed, episode_id) -> family name``: how an env's episodes group (the coding env's task families)."""


@dataclass
class _Outcome:
    """One evaluated episode."""

    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    format_error: bool = False
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)


def _generate_turns(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], *,
                    temperature: float, max_new_tokens: int) -> list[str]:
    """One assistant turn per prompt (left-padded batch), decoded without special tokens."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False).to(model.device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) \
        if temperature > 0 else dict(do_sample=False)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **sampling)  # (B, P + new)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def _play_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sessions: Sequence[EnvSession],
                keys: Sequence[tuple[int, str]], *, temperature: float, max_calls: int,
                max_new_tokens: int) -> list[_Outcome]:
    """Play ``keys`` together, episode ``k`` on ``sessions[k]``, one batched ``generate`` per turn."""
    starts = [session.reset(seed, episode_id) for session, (seed, episode_id) in zip(sessions, keys)]
    outcomes = [_Outcome() for _ in keys]
    active = list(range(len(keys)))
    while active:
        prompts = [tokenizer.apply_chat_template(
            episode_messages(starts[k][0], outcomes[k].calls, outcomes[k].replies), tools=starts[k][1],
            add_generation_prompt=True, tokenize=False) for k in active]
        texts = _generate_turns(model, tokenizer, prompts, temperature=temperature, max_new_tokens=max_new_tokens)
        still = []
        for k, text in zip(active, texts):
            episode, parsed = outcomes[k], parse_tool_call(text)
            if not parsed.ok:
                episode.format_error = True
                continue
            content, error_kind, _meta, reward, done = sessions[k].call(parsed.name, parsed.arguments)
            episode.calls.append((parsed.name, parsed.arguments))
            episode.replies.append(content)
            episode.tool_calls += 1
            episode.tool_errors += error_kind is not None
            if done:
                episode.reward = reward
            elif episode.tool_calls < max_calls:
                still.append(k)
        active = still
    return outcomes


def _mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample standard deviation / sqrt(n)); (0, 0) for no values."""
    n = max(len(values), 1)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return mean, math.sqrt(var / n)


def _summary(outcomes: list[_Outcome], keys: list[tuple[int, str]], family: FamilyFn | None,
             seconds: float) -> dict[str, Any]:
    n = max(len(outcomes), 1)
    calls = sum(o.tool_calls for o in outcomes)
    mean, se = _mean_se([o.reward for o in outcomes])
    stats: dict[str, Any] = dict(
        mean_reward=mean,
        reward_se=se,
        success_rate=sum(o.reward >= 1.0 for o in outcomes) / n,
        format_error_rate=sum(o.format_error for o in outcomes) / n,
        tool_error_rate=sum(o.tool_errors for o in outcomes) / max(calls, 1),
        mean_tool_calls=calls / n,
        calls_by_tool=dict(sorted(Counter(name for o in outcomes for name, _ in o.calls).items())),
        n_episodes=len(outcomes),
        seconds=round(seconds, 2),
    )
    if family is not None:
        groups: dict[str, list[float]] = {}
        for (seed, episode_id), outcome in zip(keys, outcomes):
            groups.setdefault(family(seed, episode_id), []).append(outcome.reward)
        stats["by_family"] = {name: dict(episodes=len(r), mean_reward=sum(r) / len(r),
                                         success_rate=sum(x >= 1.0 for x in r) / len(r))
                              for name, r in sorted(groups.items())}
    return stats


def _open_sessions(env_url: str | None, env: str | None, count: int, max_calls: int,
                   reset_kwargs: Mapping[str, Any] | None) -> list[EnvSession]:
    """``count`` sessions of the served env at ``env_url``, or of ``env``'s package in this process."""
    if env_url is not None:
        from composer_diloco.rollout.sessions import open_env_sessions  # the env client stack, only when evaluating

        return open_env_sessions([env_url], count, max_tool_calls=max_calls, reset_kwargs=reset_kwargs)
    from composer_diloco.rollout.env_package import load_env_package

    package = load_env_package(env)
    return [package.local_session(max_tool_calls=max_calls, reset_kwargs=reset_kwargs) for _ in range(count)]


@torch.no_grad()
def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    n_episodes: int,
    seed: int,
    *,
    env_url: str | None = None,
    env: str | None = None,
    temperature: float = 0.0,
    max_calls: int = 8,
    max_new_tokens: int = 48,
    batch_size: int = 32,
    reset_kwargs: Mapping[str, Any] | None = None,
    family: FamilyFn | None = None,
    per_episode: bool = False,
) -> dict[str, Any]:
    """Play ``n_episodes`` fixed fresh episodes against the env server at ``env_url``, or the env package ``env`` in
    this process (see the module docstring).

    Episodes ``(seed, "eval-0") .. (seed, f"eval-{n_episodes - 1}")`` are played ``batch_size`` at a time (left
    padding; a batch of 1 generates exactly as one prompt alone), each on its own env session (opened once, reused).
    Sampling runs under ``torch.manual_seed(seed)`` in a forked RNG, so the caller's global RNG is untouched and the
    same arguments draw the same tokens.

    Args:
        model: a causal LM (any dtype/device; inputs follow ``model.device``); left in its train/eval mode.
        tokenizer: its tokenizer, with a chat template that renders tools and a pad token.
        n_episodes: number of episodes (``>= 1``).
        seed: the episodes' seed; also the sampling seed.
        env_url: base URL of a running env server (``composer_diloco.rollout.env_process.start_env_server``).
        env: instead of ``env_url``, an env's server module (``"envs.tool_env.server"``) whose package's
            environment is played in this process (`composer_diloco.rollout.env_package.EnvPackage.local_session`).
        temperature: 0 for greedy decoding, else sampling at this temperature (no top-k/top-p filter).
        max_calls: tool calls allowed per episode (also the env's budget, ``max_tool_calls`` of ``reset``).
        max_new_tokens: generation budget per assistant turn, in tokens.
        batch_size: episodes generated together (``>= 1``).
        reset_kwargs: more keywords for every ``reset`` (``[env] reset_kwargs``, e.g. ``{"source": "generated"}``).
        family: ``(seed, episode_id) -> family`` to also report per family; None: no ``by_family``.
        per_episode: also return ``episode_rewards``, the reward of each episode in order (for paired comparisons,
            `compare_policies`).

    Returns:
        ``mean_reward`` (the env's final reward per episode, 0 without one), ``reward_se`` (its standard error: the
        episodes' sample standard deviation / sqrt(n)), ``success_rate`` (episodes with
        reward >= 1), ``format_error_rate`` (episodes ended by an unparsable turn), ``tool_error_rate`` (failed
        calls / all calls), ``mean_tool_calls`` (per episode), ``calls_by_tool`` (``{tool name: calls}`` over all
        episodes, parsed calls only: what the policy does, e.g. writes that never reach ``submit``), ``n_episodes``,
        ``seconds`` (wall clock), and with
        ``family`` ``by_family``: ``{family: {"episodes", "mean_reward", "success_rate"}}``, sorted by name.

    Raises:
        ValueError: ``n_episodes``, ``max_calls`` or ``batch_size`` below 1, a negative ``temperature``, or not
            exactly one of ``env_url`` and ``env``.
        EnvPackageError: ``env``'s package has no playable environment (`EnvPackage.local_session`).
        EnvServerError, McpProtocolError: the env server cannot be reached or stops answering
            (from ``open_env_sessions`` and the sessions' calls); the sessions are closed.
    """
    if n_episodes < 1 or max_calls < 1 or batch_size < 1 or temperature < 0:
        raise ValueError(f"evaluate_policy: need n_episodes, max_calls, batch_size >= 1 and temperature >= 0; got "
                         f"{n_episodes}, {max_calls}, {batch_size}, {temperature}")
    if (env_url is None) == (env is None):
        raise ValueError(f"evaluate_policy: pass exactly one of env_url ({env_url!r}) and env ({env!r})")

    was_training = model.training
    model.eval()
    t0 = time.monotonic()
    keys = [(seed, f"{EVAL_EPISODE_PREFIX}-{i}") for i in range(n_episodes)]
    sessions = _open_sessions(env_url, env, min(batch_size, n_episodes), max_calls, reset_kwargs)
    outcomes: list[_Outcome] = []
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for first in range(0, n_episodes, batch_size):
                outcomes += _play_batch(model, tokenizer, sessions, keys[first:first + batch_size],
                                        temperature=temperature, max_calls=max_calls, max_new_tokens=max_new_tokens)
    finally:
        for session in sessions:
            session.close()
        model.train(was_training)
    stats = _summary(outcomes, keys, family, time.monotonic() - t0)
    if per_episode:
        stats["episode_rewards"] = [o.reward for o in outcomes]
    logger.info("evaluated %d episodes at temperature %g: mean reward %.3f in %.1f s", n_episodes, temperature,
                stats["mean_reward"], stats["seconds"])
    return stats


@dataclass(frozen=True)
class Comparison:
    """Two policies on the same episodes at one temperature: a paired comparison.

    Attributes:
        temperature: 0 = greedy.
        n_episodes: episodes each policy played (the same ``(seed, "eval-i")`` and, sampled, the same seed).
        before, after: mean rewards.
        diff_se: standard error of ``after - before`` from the per-episode differences (paired: the tasks' own
            difficulty cancels, so it is smaller than either mean's standard error when the policies agree often).
    """

    temperature: float
    n_episodes: int
    before: float
    after: float
    diff_se: float

    @property
    def diff(self) -> float:
        """``after - before``."""
        return self.after - self.before

    def describe(self, before: str = "warm start", after: str = "final") -> str:
        """One line, e.g. ``sampled T=1: warm start 0.555 -> final 0.602 (+0.047 +- 0.018 paired se, 256 tasks)``."""
        how = "greedy" if self.temperature == 0 else f"sampled T={self.temperature:g}"
        return (f"{how}: {before} {self.before:.3f} -> {after} {self.after:.3f} ({self.diff:+.3f} +- "
                f"{self.diff_se:.3f} paired se, {self.n_episodes} tasks)")


def compare_policies(before: PreTrainedModel, after: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     n_episodes: int, seed: int, *, temperatures: Sequence[float] = (1.0, 0.0),
                     **kwargs: Any) -> list[Comparison]:
    """Evaluate two policies (e.g. a run's warm start and its final model) on the same fixed episodes
    (`evaluate_policy` with ``per_episode=True``), one `Comparison` per temperature.

    Args:
        before, after: the two policies (the same tokenizer).
        n_episodes, seed: as `evaluate_policy` (``>= 2`` for a standard error).
        temperatures: 0 = greedy; others sample (the same sampling seed for both policies).
        kwargs: passed to `evaluate_policy` (``env`` or ``env_url``, ``max_calls``, ``max_new_tokens`` ...).
    Raises:
        as `evaluate_policy`.
    """
    out = []
    for t in temperatures:
        a = evaluate_policy(before, tokenizer, n_episodes, seed, temperature=t, per_episode=True, **kwargs)
        b = evaluate_policy(after, tokenizer, n_episodes, seed, temperature=t, per_episode=True, **kwargs)
        d = [y - x for x, y in zip(a["episode_rewards"], b["episode_rewards"], strict=True)]
        out.append(Comparison(t, len(d), a["mean_reward"], b["mean_reward"], _mean_se(d)[1]))
    return out
