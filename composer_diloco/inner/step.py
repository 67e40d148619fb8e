"""The data of one inner step and of one round, as objects: `StepBatch` (one optimizer step, handed between TRL's
hooks), `StepLosses` (the step's loss values) and `RoundStats` (what the node writes as its metrics line).

One optimizer step in `composer_diloco.inner.trainer.ComposerGRPOTrainer`:

1. ``_generate_and_score_completions`` opens a `StepBatch` with TRL's dataset rows of the generation batch;
2. the rollout plays one episode per row into ``StepBatch.episodes``;
3. after TRL scored them, every channel builds its rows and splits them into K parts (`StepBatch.build_channels`);
4. each of the K ``_compute_loss`` calls takes the next parts (`StepBatch.next_parts`) and adds to ``losses``;
   the last one hands ``losses`` to the round (`RoundStats.add_step`).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_diloco.channels.base import ChannelPart, Counts, LossChannel
from composer_diloco.rollout.episodes import Episode
from composer_diloco.timing import PhaseClock

__all__ = ["RoundStats", "StepBatch", "StepLosses"]


class StepLosses:
    """One optimizer step's loss values (floats, nats) and trained row counts, by metric key.

    Keys: ``loss_grpo`` (the sum of the K micro-batches' GRPO terms), then for every channel its ``loss_key`` (the
    sum over parts of ``weight_k * L_c(part_k)``: the channel's loss on the whole step) and its ``count_key`` (rows
    trained). Read a key as an attribute (``losses.loss_sdpo``) or with `as_dict`.

    Args:
        channels: the channel classes whose keys the record holds (0 until added to).
    """

    def __init__(self, channels: Sequence[type[LossChannel]] = ()):
        self._values: dict[str, float | int] = {"loss_grpo": 0.0}
        self._values.update({c.metrics.loss_key: 0.0 for c in channels})
        self._values.update({c.metrics.count_key: 0 for c in channels})

    def add(self, key: str, value: float | int) -> None:
        """Add ``value`` to ``key`` (created at 0 if absent)."""
        self._values[key] = self._values.get(key, 0) + value

    def __getattr__(self, key: str) -> float | int:
        try:
            return self.__dict__["_values"][key]
        except KeyError:
            raise AttributeError(key) from None

    def as_dict(self) -> dict[str, float | int]:
        """The values by key (``loss_grpo`` first, then the channels' losses, then their counts)."""
        return dict(self._values)


@dataclass
class StepBatch:
    """One optimizer step's data: TRL's dataset rows, the played episodes, each channel's K parts, the losses.

    Attributes:
        rows: TRL's dataset rows of the generation batch, ``{"prompt", "seed", "episode_id"}`` each (the rollout
            needs ``(seed, episode_id)``; TRL hands ``rollout_func`` the prompts only).
        episodes: the episodes played for ``rows``, in the same order.
        parts: ``{channel name: [ChannelPart] * K}``, consumed front to back by `next_parts`.
        micro_left: micro-batches of the step not yet through ``_compute_loss``.
        losses: the step's `StepLosses`, filled micro-batch by micro-batch.
    """

    rows: list[dict[str, Any]]
    losses: StepLosses
    episodes: list[Episode] = field(default_factory=list)
    parts: dict[str, list[ChannelPart]] = field(default_factory=dict)
    micro_left: int = 0

    def build_channels(self, channels: Sequence[LossChannel], model: torch.nn.Module, micro_batches: int,
                       round_stats: RoundStats, clock: PhaseClock | None = None) -> None:
        """Every channel's rows of ``episodes`` (in channel order), cut into ``micro_batches`` parts; each
        channel's counts go to ``round_stats``; each channel's build counts as the ``clock``'s phase of its name.

        Raises:
            ValueError: ``micro_batches`` below 1; whatever a channel's ``build`` raises.
        """
        if micro_batches < 1:
            raise ValueError(f"parts {micro_batches}: expected a number of micro-batches >= 1")
        for channel in channels:
            stats = channel.stats_type()
            with clock.phase(channel.name) if clock is not None else contextlib.nullcontext():
                rows = channel.build(model, self.episodes, stats)
            round_stats.add_channel_stats(channel.name, stats)
            self.parts[channel.name] = (channel.split(rows, micro_batches) if rows is not None
                                        else [ChannelPart() for _ in range(micro_batches)])
        self.micro_left = micro_batches

    def next_parts(self) -> dict[str, ChannelPart]:
        """The next micro-batch's part of every channel (``{}`` once all are taken, or outside a step)."""
        return {name: parts.pop(0) for name, parts in self.parts.items() if parts}


class RoundStats:
    """What one node did in one round's inner phase, accumulated step by step; `record` is its metrics line part.

    Args:
        channels: the channel classes of the trainer (their keys appear in `record` even when turned off).
        episodes_per_step: episodes per optimizer step (groups ``step_rewards``).

    Attributes:
        episodes: the episodes played, in step order.
        steps: one `StepLosses` per optimizer step.
        channel_stats: ``{channel name: Counts}`` summed over the steps (absent for a channel that was off).
    """

    def __init__(self, channels: Sequence[type[LossChannel]], episodes_per_step: int):
        self.channels, self.episodes_per_step = tuple(channels), episodes_per_step
        self.episodes: list[Episode] = []
        self.steps: list[StepLosses] = []
        self.channel_stats: dict[str, Counts] = {}

    @property
    def samples(self) -> int:
        """Episodes played in the round (the node's all-reduce weight)."""
        return len(self.episodes)

    @property
    def longest_episode_tokens(self) -> int:
        """Tokens of the round's longest episode, prompt and completion (0 without episodes): what the memory plan's
        row bound (`composer_diloco.policy.memory_plan.row_bound`) must cover."""
        return max((len(e.prompt_ids) + len(e.completion_ids) for e in self.episodes), default=0)

    @property
    def generated_tokens(self) -> int:
        """Tokens the policy sampled in the round's episodes (``env_mask`` 1: its turns, EOS included; tool replies
        and prompts are not counted)."""
        return sum(sum(e.env_mask) for e in self.episodes)

    @property
    def episodes_without_tool_call(self) -> int:
        """Episodes of the round in which the policy never produced a parsed tool call (`Episode.tool_calls` 0):
        they end at the first turn with reward 0 and teach nothing about the env."""
        return sum(1 for e in self.episodes if e.tool_calls == 0)

    @property
    def episodes_env_error(self) -> int:
        """Episodes of the round that the env ended by failing a call (end reason ``"env_error"``, reward 0)."""
        return sum(1 for e in self.episodes if e.end_reason == "env_error")

    @property
    def no_tool_call(self) -> bool:
        """True when the round played episodes and not one of them had a parsed tool call."""
        return self.samples > 0 and self.episodes_without_tool_call == self.samples

    @property
    def frac_reward_zero_std(self) -> float:
        """Fraction of the round's GRPO groups (the episodes of one step sharing ``(seed, episode_id)``: one task
        played G times) whose rewards are all equal, in [0, 1] (0.0 for a round without episodes).

        Such a group's advantages are all 0 (GRPO, arXiv 2402.03300: reward minus the group mean), so GRPO's loss
        carries no signal from it; TRL logs the same quantity per step as ``frac_reward_zero_std``. A round near 1.0
        learns nearly nothing from GRPO, however many episodes it played (DAPO's dynamic sampling, arXiv
        2503.14476, exists to avoid exactly this).
        """
        per_step, groups, flat = self.episodes_per_step, 0, 0
        for start in range(0, len(self.episodes), per_step):
            by_task: dict[tuple[int, str], list[float]] = {}
            for e in self.episodes[start:start + per_step]:
                by_task.setdefault((e.seed, e.episode_id), []).append(e.reward)
            groups += len(by_task)
            flat += sum(1 for rewards in by_task.values() if max(rewards) == min(rewards))
        return flat / groups if groups else 0.0

    def add_episodes(self, episodes: Iterable[Episode]) -> None:
        """Keep one step's played episodes (in TRL's row order)."""
        self.episodes.extend(episodes)

    def add_step(self, losses: StepLosses) -> None:
        """Keep one finished optimizer step's losses."""
        self.steps.append(losses)

    def add_channel_stats(self, name: str, stats: Counts) -> None:
        """Add one step's counts of channel ``name``."""
        if name in self.channel_stats:
            self.channel_stats[name].add(stats)
        else:
            self.channel_stats[name] = stats

    def record(self) -> dict[str, Any]:
        """The round's keys of a node's metrics line: ``samples``, ``mean_reward``, ``success_rate`` (reward >= 1),
        ``step_rewards`` / ``step_success`` (per step, 4 decimals), ``frac_reward_zero_std`` (4 decimals),
        ``tool_errors_per_episode``, ``episodes_without_tool_call``, ``episodes_env_error``, ``generated_tokens``,
        ``loss_grpo`` (mean over steps) and every channel's `LossChannel.round_record` (its loss's mean over steps, its counts)."""
        episodes, samples = self.episodes, self.samples
        rewards = [e.reward for e in episodes]
        per_step = self.episodes_per_step  # episodes are kept in the order of the inner steps
        steps = [rewards[i:i + per_step] for i in range(0, len(rewards), per_step)]
        record: dict[str, Any] = {
            "samples": samples, "mean_reward": statistics.fmean(rewards) if rewards else 0.0,
            "success_rate": sum(r >= 1.0 for r in rewards) / samples if samples else 0.0,
            "step_rewards": [round(statistics.fmean(step), 4) for step in steps],
            "step_success": [round(sum(x >= 1.0 for x in step) / len(step), 4) for step in steps],
            "frac_reward_zero_std": round(self.frac_reward_zero_std, 4),
            "tool_errors_per_episode": sum(e.tool_errors for e in episodes) / samples if samples else 0.0,
            "episodes_without_tool_call": self.episodes_without_tool_call,
            "episodes_env_error": self.episodes_env_error,
            "generated_tokens": self.generated_tokens,
            "loss_grpo": _mean(s.loss_grpo for s in self.steps),
        }
        for channel in self.channels:
            key = channel.metrics.loss_key
            loss_mean = _mean(s.as_dict().get(key, 0.0) for s in self.steps)
            record.update(channel.round_record(loss_mean, self.channel_stats.get(channel.name)))
        return record


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0
