"""The loss-channel contract (`composer_diloco.channels.base`): a channel defined in this file alone (SFT on the
step's successful episodes, with its own ``[loss]`` keys) is registered and trains in one real inner step of
`ComposerGRPOTrainer.train()`, shows up in the metrics line, the round table and the plots, has its keys checked by the
run config and its rows counted by the memory plan, with no production file edited. Also: the one counting pattern
(`Counts`) and the registry's rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from pydantic import Field, ValidationError
from test_heterogeneous import PEER, LocalSession, group_scripts, scripted_sampler

from composer_diloco.channels.base import (
    ChannelContext,
    ChannelMetrics,
    ChannelPart,
    ChannelSettings,
    Counts,
    LossChannel,
    register_channel,
    registered_channels,
    unregister_channel,
)
from composer_diloco.config import ConfigError, LossConfig, RunConfig, load_config
from composer_diloco.inner.trainer import ComposerGRPOTrainer, episode_dataset, grpo_args
from composer_diloco.metrics import format_table, round_table, table_columns
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.rollout import episodes as rollout
from composer_diloco.rollout.episodes import Episode


@dataclass
class SftStats(Counts):
    sft_episodes: int = 0
    sft_skipped_failed: int = 0


class SftSettings(ChannelSettings):
    """The channel's ``[loss]`` keys: its weight and the reward an episode needs to be imitated."""

    weight_key = "sft_weight"
    sft_weight: float = Field(0.0, ge=0)
    sft_min_reward: float = Field(1.0, le=1)


class SftChannel(LossChannel):
    """Supervised fine-tuning on the policy tokens of the step's solved episodes: mean token NLL (nats)."""

    name = "sft"
    metrics = ChannelMetrics(loss_key="loss_sft", count_key="sft_episodes", loss_title="SFT loss",
                             count_title="sft eps", plot_label="SFT loss")
    stats_type = SftStats
    settings_type = SftSettings
    calls: list[int] = []

    @classmethod
    def from_context(cls, ctx: ChannelContext) -> SftChannel | None:
        settings = SftSettings.of(ctx.config.loss)
        if settings.sft_weight <= 0:
            return None
        channel = cls(weight=settings.sft_weight)
        channel.min_reward = settings.sft_min_reward
        return channel

    def build(self, model: torch.nn.Module, episodes: Sequence[Episode], stats: Counts) -> dict | None:
        rows = []
        for ep in episodes:
            if ep.reward < self.min_reward:
                stats.sft_skipped_failed += 1
                continue
            stats.sft_episodes += 1
            rows.append((ep.prompt_ids + ep.completion_ids, [0] * len(ep.prompt_ids) + list(ep.env_mask)))
        if not rows:
            return None
        width = max(len(ids) for ids, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        att, target = torch.zeros_like(ids), torch.zeros_like(ids)
        for i, (seq, mask) in enumerate(rows):
            ids[i, :len(seq)], att[i, :len(seq)], target[i, :len(seq)] = torch.tensor(seq), 1, torch.tensor(mask)
        target[:, 0] = 0  # the first token has no prediction
        return {"ids": ids, "attention_mask": att, "target": target}

    def split(self, rows: dict, parts: int) -> list[ChannelPart]:
        tokens = rows["target"].sum(dim=1)  # (N,) loss tokens per row
        total = int(tokens.sum())
        out = []
        for chunk in torch.arange(rows["ids"].shape[0]).tensor_split(parts):
            if len(chunk) == 0:
                out.append(ChannelPart())
            else:
                out.append(ChannelPart({k: v[chunk] for k, v in rows.items()}, len(chunk),
                                       int(tokens[chunk].sum()) / total))
        return out

    def loss(self, model: torch.nn.Module, rows: dict) -> torch.Tensor:
        type(self).calls.append(int(rows["ids"].shape[0]))
        logits = model(input_ids=rows["ids"], attention_mask=rows["attention_mask"]).logits[:, :-1]  # (N, T-1, V)
        logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, rows["ids"][:, 1:, None]).squeeze(-1)
        mask = rows["target"][:, 1:].bool()
        return -logps[mask].mean()


@pytest.fixture
def sft_registered():
    SftChannel.calls = []
    register_channel(SftChannel)
    try:
        yield SftChannel
    finally:
        unregister_channel("sft")


@pytest.mark.timeout(300)
def test_a_channel_defined_in_a_test_trains_one_real_inner_step(tmp_path, monkeypatch, sft_registered):
    assert registered_channels()[-1] is SftChannel
    tok = load_default_tokenizer()
    model = build_tiny_model(tok, seed=0)
    config = RunConfig(loss=LossConfig(alpha_sdpo=0.0, beta_dpo=0.0, sft_weight=0.3))  # GRPO + the new channel only
    args = grpo_args(config, output_dir=tmp_path, max_steps=1, use_cpu=True, bf16=False, micro_batch=4, grad_accum=2)
    rows = episode_dataset(config, PEER, 2)
    scripts = [s for row in rows for s in group_scripts(config.seed, row["episode_id"])]
    trainer = ComposerGRPOTrainer(model=model, tokenizer=tok, config=config, peer_name=PEER, args=args,
                                  sessions=[LocalSession(config.env.max_tool_calls) for _ in range(8)])
    assert [c.name for c in trainer.channels] == ["sft"]  # SDPO and DPO are off (weight 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with monkeypatch.context() as m:
        m.setattr(rollout, "generate_turns", scripted_sampler(tok, scripts))
        trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())

    stats = trainer.take_round_stats()
    (step,) = stats.steps
    assert SftChannel.calls == [2, 2]  # the 4 solved episodes, cut in K=2 parts, one per micro-batch
    assert step.sft_episodes == 4 and step.loss_sft > 0
    record = stats.record()
    assert record["loss_sft"] == pytest.approx(step.loss_sft) and record["sft_episodes"] == 4
    assert (record["loss_sdpo"], record["sdpo_sites"], record["loss_dpo"], record["dpo_pairs"], record["pair_stats"]) \
        == (0.0, 0, 0.0, 0, {})  # channels that were off keep their keys

    # the round table and the plots pick it up
    assert ("loss_sft", "SFT loss", "{:.4f}") in table_columns()
    line = {"round": 0, "role": "node", "peers": 2, "samples": 8, **record}
    table = format_table(round_table({"node-0": [line]}))
    assert "SFT loss" in table.splitlines()[0] and f"{record['loss_sft']:.4f}" in table.splitlines()[1]
    from coordinator.plot import losses_figure

    assert len(losses_figure({"node-0": [line]}).axes) == 4  # GRPO, SDPO, DPO, SFT


def test_a_channels_keys_and_memory_rows_are_declared_by_the_channel_alone(tmp_path, sft_registered):
    """A registered channel's ``[loss]`` keys are checked with the run config's one-line errors, published with it,
    and its rows enter the memory plan (the default `LossChannel.memory`: one row per episode with its logits)."""
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config
    from composer_diloco.policy.memory_plan import plan_for_run

    path = tmp_path / "c.toml"
    path.write_text("[loss]\nsft_weight = -1\n")
    with pytest.raises(ConfigError, match=r"field 'loss.sft_weight': Input should be greater than or equal to 0"):
        load_config(path)
    path.write_text("[loss]\nsft_weight = 0.3\nsft_min_reward = 0.5\n")
    config = load_config(path)
    assert (SftSettings.of(config.loss).sft_weight, SftSettings.of(config.loss).sft_min_reward) == (0.3, 0.5)
    assert RunConfig.from_json(config.to_json()) == config and '"sft_min_reward": 0.5' in config.to_json()
    assert LossConfig(sft_weight=0.0) == LossConfig()  # a key at its default is the table without it

    model_config = tiny_model_config(load_default_tokenizer(), 0)
    kw = dict(micro_batch=4, grad_accum=2, device="cpu", bf16=False, gradient_checkpointing=False, free=None)
    with_sft, without = plan_for_run(config, model_config, **kw), plan_for_run(RunConfig(), model_config, **kw)
    assert (with_sft.rows, without.rows) == (8, 4) and "4 GRPO + 4 SFT rows" in with_sft.describe()
    assert with_sft.activations > without.activations and with_sft.weights == without.weights

    unregister_channel("sft")  # no channel declares the key any more
    with pytest.raises(ConfigError, match=r"field 'loss.sft_weight': Extra inputs are not permitted"):
        load_config(path)
    register_channel(SftChannel)


def test_two_channels_cannot_declare_one_key(sft_registered):
    class Clash(SftChannel):
        name = "sft2"

    with pytest.raises(ValueError, match="'sft_min_reward' is already declared by channel 'sft'"):
        register_channel(Clash)
    with pytest.raises(ValidationError, match="sft_min_reward"):
        LossConfig(sft_min_reward=2)


def test_counts_add_merge_and_refuse_other_types():
    a, b = SftStats(1, 2), SftStats(3, 4)
    assert a + b == SftStats(4, 6) and a == SftStats(1, 2)
    a.add(b)
    assert a.as_dict() == {"sft_episodes": 4, "sft_skipped_failed": 6}
    from composer_diloco.channels.dpo import DpoStats
    from composer_diloco.channels.dpo_pairing import PairStats

    d = DpoStats(1, 0, PairStats(sites=2))
    d.add(DpoStats(2, 1, PairStats(sites=1, pairs=1)))
    assert (d.dpo_pairs, d.dpo_skipped_truncated, d.pair_stats) == (3, 1, PairStats(sites=3, pairs=1))
    with pytest.raises(TypeError, match="cannot add a DpoStats to a SftStats"):
        a.add(d)


def test_registry_rules(sft_registered):
    assert [c.name for c in registered_channels()] == ["sdpo", "dpo", "sft"]
    register_channel(SftChannel)  # the same class again: a no-op

    class Other(SftChannel):
        pass

    with pytest.raises(ValueError, match="loss channel 'sft' is already registered"):
        register_channel(Other)
    with pytest.raises(TypeError, match="expected a LossChannel subclass"):
        register_channel(int)


def test_round_stats_record_keeps_the_metrics_keys_of_before():
    """The keys `composer_diloco.diloco.DiLoCoRounds` wrote by hand before the channels were modules, with the same values."""
    from composer_diloco.channels.dpo import DpoStats
    from composer_diloco.channels.dpo_pairing import PairStats
    from composer_diloco.channels.sdpo_sites import SdpoStats
    from composer_diloco.inner.step import RoundStats, StepLosses

    channels = registered_channels()
    stats = RoundStats(channels, episodes_per_step=2)
    stats.add_episodes([Episode(0, f"e{i}", [], [], [], reward=r) for i, r in enumerate((1.0, 0.0, 0.5, 1.0))])
    for loss_grpo, sdpo in ((0.5, 0.25), (-0.25, 0.0)):
        step = StepLosses(channels)
        step.add("loss_grpo", loss_grpo)
        step.add("loss_sdpo", sdpo)
        stats.add_step(step)
    stats.add_channel_stats("sdpo", SdpoStats(sdpo_sites=3, sdpo_skipped_no_hint=1))
    stats.add_channel_stats("sdpo", SdpoStats(sdpo_sites=1, sdpo_skipped_truncated=2))
    stats.add_channel_stats("dpo", DpoStats(dpo_pairs=2, pair_stats=PairStats(sites=2, pairs=2)))
    assert stats.record() == {
        "samples": 4, "mean_reward": 0.625, "success_rate": 0.5, "step_rewards": [0.5, 0.75],
        "step_success": [0.5, 0.5], "frac_reward_zero_std": 1.0,  # four "groups" of one episode: no variance
        "tool_errors_per_episode": 0.0, "loss_grpo": 0.125, "loss_sdpo": 0.125,
        "loss_dpo": 0.0, "sdpo_sites": 4, "dpo_pairs": 2, "episodes_without_tool_call": 4,  # no turns: no call
        "episodes_env_error": 0, "generated_tokens": 0,  # no completion tokens
        "sdpo_skipped": {"no_hint": 1, "empty_recovery": 0, "no_recovery": 0, "truncated": 2, "unverified": 0},
        "pair_stats": {**PairStats().as_dict(), "sites": 2, "pairs": 2},
    }


def test_frac_reward_zero_std_counts_the_groups_whose_rewards_are_all_equal():
    """A group is one step's episodes of one task; equal rewards (all 0, all 1, or all 0.5) give GRPO no advantage."""
    from composer_diloco.inner.step import RoundStats

    def group(task: str, *rewards: float) -> list[Episode]:
        return [Episode(0, task, [], [], [], reward=r) for r in rewards]

    stats = RoundStats((), episodes_per_step=8)  # two groups of G = 4 per step
    stats.add_episodes(group("a", 0, 0, 0, 0) + group("b", 0, 1, 0, 0))  # step 0: one flat group of 2
    stats.add_episodes(group("a", 0.5, 0.5, 0.5, 0.5) + group("c", 1, 1, 1, 0.75))  # step 1: the same task id
    assert stats.frac_reward_zero_std == 2 / 4  # "a" counts once per step: it is a new group in each step
    assert stats.record()["frac_reward_zero_std"] == 0.5
    assert RoundStats((), episodes_per_step=8).frac_reward_zero_std == 0.0
