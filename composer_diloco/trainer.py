"""The inner-loop trainer: TRL's `GRPOTrainer`, fed by multi-turn OpenEnv episodes through ``rollout_func``.

This is the one adapter over TRL internals. It touches three of them:
- ``_generate_and_score_completions`` is wrapped to keep the dataset rows of the batch, because TRL hands
  ``rollout_func`` the prompts only and an episode is identified by the row's ``(seed, episode_id)``; after
  TRL has scored the batch, the wrapper builds the SDPO/DPO tensors of the same episodes (`collator`);
- ``_compute_loss`` is wrapped: TRL's GRPO loss, plus ``alpha_sdpo * SDPO + beta_dpo * DPO`` (`composite`);
- ``_get_tool_suffix_ids`` renders tool replies into token ids exactly as TRL's own tool loop does.
Everything else (advantages, the GRPO/DAPO loss, the AdamW step, logging) is TRL's, unchanged.

One optimizer step = one generation batch (``gradient_accumulation_steps=1``, ``steps_per_generation=1``), so
the extra channels' tensors are kept on the trainer for exactly the ``_compute_loss`` call of their step (TRL
shuffles and splits its batch dict along the episode dimension, which the SDPO/DPO rows do not share).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

from composer_diloco.collator import CollatorStats, ComposerBatch, ComposerCollator
from composer_diloco.composite import ChannelLosses, dpo_loss, sdpo_loss
from composer_diloco.config import RunConfig
from composer_diloco.hints import HintRegistry
from composer_diloco.rollout import Episode, EnvSession, play_episodes

log = logging.getLogger(__name__)


def env_reward(prompts: list, completions: list, env_reward: list[float], **_: Any) -> list[float]:
    """Reward function for TRL: the environment's final reward of each episode (1.0 solved, else 0.0)."""
    return [float(r) for r in env_reward]


def episode_dataset(config: RunConfig, peer_name: str, n_rows: int) -> Dataset:
    """Rows ``{"prompt", "seed", "episode_id"}``: one per task; each is played G times (one GRPO group).

    Episode ids carry the peer name, so nodes of one run play different episodes that any peer can replay.
    """
    tag = hashlib.sha256(peer_name.encode()).hexdigest()[:8]
    rows = [
        {"prompt": [{"role": "user", "content": f"episode {tag}-{i}"}], "seed": config.seed, "episode_id": f"{tag}-{i}"}
        for i in range(n_rows)
    ]
    return Dataset.from_list(rows)


def grpo_args(config: RunConfig, *, output_dir: Path, max_steps: int, use_cpu: bool, bf16: bool) -> GRPOConfig:
    """TRL `GRPOConfig` for H inner steps per round: one generation batch (tasks_per_step * G episodes) per
    optimizer step, constant AdamW learning rate, no checkpoints or reporting (DiLoCo owns both)."""
    g = config.grpo
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=1,
        num_generations=g.num_generations,
        max_completion_length=config.max_seq_len,
        learning_rate=config.inner.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=config.inner.weight_decay,
        max_grad_norm=config.inner.max_grad_norm,
        optim="adamw_torch",
        loss_type=g.loss_type,
        beta=g.beta,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high,
        scale_rewards=g.scale_rewards,
        temperature=g.temperature,
        seed=config.seed,
        use_cpu=use_cpu,
        bf16=bf16,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        gradient_checkpointing=False,  # a tiny model gains nothing; large models can turn it on later
        remove_unused_columns=False,
        shuffle_dataset=False,
    )


class ComposerGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose completions are multi-turn tool episodes played against OpenEnv servers.

    Args:
        model: the policy (a `PreTrainedModel`).
        tokenizer: its tokenizer (chat template with tool calling).
        config: the run config.
        sessions: env sessions, at least ``config.batch_size`` of them (one per concurrent episode).
        peer_name: names this peer's episodes (`episode_dataset`).
        args: the TRL config (`grpo_args`).
        callbacks: Trainer callbacks (the DiLoCo round callback).

    Attributes:
        round_episodes: episodes played since the last `take_round_stats` (for the round's metrics).
        round_losses: per-channel losses of the inner steps since the last `take_round_stats`.
        round_collator: the collator's kept/skipped counts since the last `take_round_stats`.
        reference_model: the frozen DPO reference policy (theta of the round's start; `refresh_reference`).
    """

    def __init__(self, *, model: Any, tokenizer: Any, config: RunConfig, sessions: Sequence[EnvSession],
                 peer_name: str, args: GRPOConfig, callbacks: list[TrainerCallback] | None = None):
        if len(sessions) < config.batch_size:
            raise ValueError(f"need {config.batch_size} env sessions (one per episode of a step), got {len(sessions)}")
        self.run_config = config
        self.sessions = list(sessions)
        self.round_episodes: list[Episode] = []
        self.round_losses: list[ChannelLosses] = []
        self.round_collator = CollatorStats()
        self.round_pair_stats: dict[str, int] = {}
        self._rows: list[dict] = []
        self._step_episodes: list[Episode] = []
        self._aux: ComposerBatch | None = None
        self.hints = HintRegistry.from_config(config.hints)
        self.collator = ComposerCollator(tokenizer, hints=self.hints, max_length=config.max_seq_len)
        self.reference_model = None
        if config.loss.beta_dpo > 0:
            self.reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        n_rows = max(1, args.max_steps) * config.grpo.tasks_per_step + 1
        super().__init__(
            model=model,
            reward_funcs=[env_reward],
            args=args,
            train_dataset=episode_dataset(config, peer_name, n_rows),
            processing_class=tokenizer,
            rollout_func=_rollout,
            callbacks=callbacks,
        )
        self.remove_callback(PrinterCallback)  # it prints log dicts to stdout; per-round metrics go to metrics.jsonl
        # TRL applies this rule only when `tools` are passed; our rollout_func renders tool replies the same way,
        # so multi-turn token ids need a prefix-preserving template too (Qwen3's adds a think block otherwise).
        if not is_chat_template_prefix_preserving(tokenizer):
            self.chat_template = get_training_chat_template(tokenizer)

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        self._rows = inputs  # rollout_func receives prompts only; it needs each row's (seed, episode_id)
        output = super()._generate_and_score_completions(inputs)
        self._aux = self._extra_channels(self._step_episodes)
        return output

    def _extra_channels(self, episodes: list[Episode]) -> ComposerBatch | None:
        """SDPO sites and trace-replay DPO pairs of this step's episodes (None when both weights are 0)."""
        cfg = self.run_config
        if cfg.loss.alpha_sdpo <= 0 and cfg.loss.beta_dpo <= 0:
            return None
        pairs = []
        if cfg.loss.beta_dpo > 0:
            from composer_diloco.preference import collect_pairs

            p = cfg.preference
            pairs, stats = collect_pairs(
                self.model, self.processing_class, episodes, self.sessions[0], hints=self.hints,
                teachers=list(p.teachers), mode=p.mode, min_score_diff=p.min_score_diff,
                max_pairs_per_turn=p.max_pairs_per_turn, max_sites=p.max_sites,
                max_turn_tokens=cfg.env.max_turn_tokens, temperature=cfg.grpo.temperature,
            )
            for key, value in vars(stats).items():
                self.round_pair_stats[key] = self.round_pair_stats.get(key, 0) + int(value)
        batch = self.collator(episodes, pairs, reference_model=self.reference_model,
                              with_sdpo=cfg.loss.alpha_sdpo > 0)
        self.round_collator.add(batch.stats)
        return batch

    def _compute_loss(self, model: Any, inputs: dict) -> Any:
        loss = super()._compute_loss(model, inputs)  # TRL's GRPO loss, unchanged
        cfg, aux, self._aux = self.run_config.loss, self._aux, None
        record = ChannelLosses(loss_grpo=float(loss.detach()))
        if aux is not None:
            device = loss.device
            tensors = {k: v.to(device) for k, v in aux.tensors.items()}
            if cfg.alpha_sdpo > 0 and aux.num_sdpo:
                sdpo = sdpo_loss(model, tensors, cfg)
                loss = loss + cfg.alpha_sdpo * sdpo
                record.loss_sdpo, record.sdpo_sites = float(sdpo.detach()), aux.num_sdpo
            if cfg.beta_dpo > 0 and aux.num_dpo:
                dpo = dpo_loss(model, tensors, cfg)
                loss = loss + cfg.beta_dpo * dpo
                record.loss_dpo, record.dpo_pairs = float(dpo.detach()), aux.num_dpo
        mode = "train" if model.training else "eval"
        for key in ("loss_sdpo", "loss_dpo", "sdpo_sites", "dpo_pairs"):
            self._metrics[mode][f"composite/{key}"].append(float(getattr(record, key)))
        self.round_losses.append(record)
        return loss

    @torch.no_grad()
    def refresh_reference(self) -> None:
        """Make the DPO reference policy the current weights (called right after each outer step)."""
        if self.reference_model is not None:
            for ref, cur in zip(self.reference_model.parameters(), self.model.parameters(), strict=True):
                ref.copy_(cur)

    def take_round_stats(self) -> tuple[list[Episode], list[ChannelLosses], CollatorStats, dict[str, int]]:
        """Episodes, per-step channel losses, collator and pair counts since the previous call (then reset)."""
        out = (self.round_episodes, self.round_losses, self.round_collator, self.round_pair_stats)
        self.round_episodes, self.round_losses = [], []
        self.round_collator, self.round_pair_stats = CollatorStats(), {}
        return out


def _rollout(prompts: list, trainer: ComposerGRPOTrainer) -> dict[str, list]:
    """TRL ``rollout_func``: play one episode per row; returns TRL's required keys plus ``env_mask`` (becomes
    TRL's ``tool_mask``: tool replies carry no loss) and ``env_reward`` (read by `env_reward`)."""
    rows = trainer._rows
    if len(rows) != len(prompts):
        raise RuntimeError(f"rollout got {len(prompts)} prompts for {len(rows)} dataset rows")
    cfg = trainer.run_config
    episodes = play_episodes(
        trainer.model,
        trainer.processing_class,
        trainer.sessions,
        [(int(r["seed"]), str(r["episode_id"])) for r in rows],
        tool_suffix_ids=trainer._get_tool_suffix_ids,
        max_tool_calls=cfg.env.max_tool_calls,
        max_turn_tokens=cfg.env.max_turn_tokens,
        max_seq_len=cfg.max_seq_len,
        temperature=cfg.grpo.temperature,
    )
    trainer.round_episodes.extend(episodes)
    trainer._step_episodes = episodes
    return {
        "prompt_ids": [e.prompt_ids for e in episodes],
        "completion_ids": [e.completion_ids for e in episodes],
        "logprobs": [e.logprobs for e in episodes],
        "env_mask": [e.env_mask for e in episodes],
        "env_reward": [e.reward for e in episodes],
    }
