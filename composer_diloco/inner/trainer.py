"""The inner-loop trainer: TRL's `GRPOTrainer`, fed by multi-turn OpenEnv episodes through ``rollout_func``.

This is the one adapter over TRL internals. It touches three of them:
- ``_generate_and_score_completions`` is wrapped to keep the dataset rows of the batch, because TRL hands
  ``rollout_func`` the prompts only and an episode is identified by the row's ``(seed, episode_id)``; after
  TRL has scored the batch, the wrapper builds the SDPO/DPO tensors of the same episodes (`collator`);
- ``_compute_loss`` is wrapped: TRL's GRPO loss, plus ``alpha_sdpo * SDPO + beta_dpo * DPO`` (`composite`);
- ``_get_tool_suffix_ids`` renders tool replies into token ids exactly as TRL's own tool loop does.
Everything else (advantages, the GRPO/DAPO loss, the AdamW step, logging) is TRL's, unchanged.

One optimizer step = one generation batch of ``micro_batch * K`` episodes (``gradient_accumulation_steps = K =
steps_per_generation``, the node's ``--grad-accum``): TRL shuffles it, splits it into K micro-batches of
``micro_batch`` episodes and calls ``_compute_loss`` once per micro-batch, each GRPO term already scaled so that
the K terms add up to the loss of the whole batch (DAPO/CISPO divide by the generation batch's token count
``num_items_in_batch``; grpo/dr_grpo/sapo divide by K a mean over equal-sized micro-batches; bnpo's per-micro-batch
token mean is TRL's own approximation). The SDPO sites and DPO pairs of the generation batch do not share TRL's
episode dimension, so `split_channels` cuts them into K row chunks of their own, one per ``_compute_loss`` call,
each weighted by its share of the channel's denominator (valid SDPO tokens, DPO pairs): the K weighted chunk
losses add up to the channel's loss on the whole batch, and the composite loss of one optimizer step is the same
whatever K is (up to float rounding; `tests/test_heterogeneous.py`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

from composer_diloco.inner.collator import CollatorStats, ComposerBatch, ComposerCollator
from composer_diloco.inner.composite import ChannelLosses, dpo_loss, sdpo_loss
from composer_diloco.config import RunConfig
from composer_diloco.channels.sdpo_hints import HintRegistry
from composer_diloco.rollout.episodes import Episode, EnvSession, play_episodes

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


def grpo_args(config: RunConfig, *, output_dir: Path, max_steps: int, use_cpu: bool, bf16: bool,
              micro_batch: int | None = None, grad_accum: int = 1) -> GRPOConfig:
    """TRL `GRPOConfig` for H inner steps per round: one generation batch (``micro_batch * grad_accum`` episodes)
    per optimizer step, constant AdamW learning rate, no checkpoints or reporting (DiLoCo owns both).

    Args:
        config: the run config.
        output_dir: TRL's scratch folder (nothing is saved there).
        max_steps: optimizer (inner) steps of the whole ``train()`` call.
        use_cpu, bf16: the node's placement (`nodes.device.Placement`); bf16 = bf16 autocast, fp32 master weights.
        micro_batch: episodes per forward/backward pass (TRL ``per_device_train_batch_size``); None =
            ``config.batch_size`` (tasks_per_step * G).
        grad_accum: micro-batches per optimizer step, K (TRL ``gradient_accumulation_steps`` and
            ``steps_per_generation``: one generation batch per optimizer step).
    Raises:
        ValueError: ``micro_batch`` or ``grad_accum`` below 1, or ``micro_batch * grad_accum`` not a multiple of
            ``config.grpo.num_generations`` (GRPO groups must be whole).
    """
    g = config.grpo
    micro_batch = config.batch_size if micro_batch is None else micro_batch
    if micro_batch < 1 or grad_accum < 1 or (micro_batch * grad_accum) % g.num_generations:
        raise ValueError(f"micro_batch {micro_batch} x grad_accum {grad_accum}: expected positive values whose "
                         f"product is a multiple of num_generations {g.num_generations}")
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=grad_accum,
        steps_per_generation=grad_accum,
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


SDPO_KEYS = ("sdpo_student_ids", "sdpo_student_attention_mask", "sdpo_teacher_ids", "sdpo_teacher_attention_mask",
             "student_response_idx", "teacher_response_idx", "student_response_valid", "teacher_response_valid",
             "sdpo_student_mask", "sdpo_teacher_mask")
DPO_KEYS = ("dpo_chosen_ids", "dpo_chosen_attention_mask", "dpo_chosen_response_mask", "dpo_rejected_ids",
            "dpo_rejected_attention_mask", "dpo_rejected_response_mask", "dpo_ref_chosen_logps",
            "dpo_ref_rejected_logps")


@dataclass
class ChannelPart:
    """The SDPO/DPO rows one micro-batch trains on, and the weights that make the parts add up to the whole.

    Attributes:
        tensors: a row chunk of `ComposerBatch.tensors` (same keys, first dim cut to the chunk, right padding
            trimmed to the chunk's longest row); a channel with no row in this chunk has no keys.
        num_sdpo: S_c, SDPO sites in the chunk.
        num_dpo: P_c, DPO pairs in the chunk.
        sdpo_weight: T_c / T, the chunk's valid SDPO tokens over the batch's (SDPO is a mean over tokens).
        dpo_weight: P_c / P (DPO is a mean over pairs).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_sdpo: int = 0
    num_dpo: int = 0
    sdpo_weight: float = 0.0
    dpo_weight: float = 0.0


def split_channels(batch: ComposerBatch | None, parts: int) -> list[ChannelPart]:
    """Cut the SDPO sites and DPO pairs of one generation batch into ``parts`` row chunks, one per micro-batch.

    Rows are dealt in contiguous, near-equal chunks (``torch.tensor_split``; a chunk may be empty when there are
    fewer rows than parts). With ``mean_c`` the channel's loss on chunk c, ``sum_c weight_c * mean_c`` is the
    channel's loss on the whole batch: SDPO's token mean has ``weight_c = T_c / T`` (valid response tokens), DPO's
    pair mean ``weight_c = P_c / P``. So each micro-batch adds ``alpha * weight_c * SDPO_c + beta * weight_c *
    DPO_c`` to TRL's GRPO term, and the K gradients accumulated before the AdamW step are those of the one-batch
    loss. Padding columns beyond a chunk's longest row are dropped (right padding: nothing a valid position sees),
    so peak memory follows the micro-batch.

    Args:
        batch: the collator's output for the generation batch, or None (both channels off).
        parts: K >= 1, micro-batches per optimizer step.
    Returns:
        ``parts`` `ChannelPart` s, in micro-batch order; all empty when ``batch`` is None.
    Raises:
        ValueError: ``parts`` below 1.
    """
    if parts < 1:
        raise ValueError(f"parts {parts}: expected a number of micro-batches >= 1")
    out = [ChannelPart() for _ in range(parts)]
    if batch is None:
        return out
    t = batch.tensors
    if batch.num_sdpo:
        tokens = t["student_response_valid"].sum(dim=1)  # (S,) valid tokens per site
        total = max(int(tokens.sum()), 1)
        for part, rows in zip(out, torch.arange(batch.num_sdpo).tensor_split(parts), strict=True):
            if len(rows):
                part.tensors.update(_sdpo_rows(t, rows))
                part.num_sdpo, part.sdpo_weight = len(rows), int(tokens[rows].sum()) / total
    if batch.num_dpo:
        for part, rows in zip(out, torch.arange(batch.num_dpo).tensor_split(parts), strict=True):
            if len(rows):
                part.tensors.update(_dpo_rows(t, rows))
                part.num_dpo, part.dpo_weight = len(rows), len(rows) / batch.num_dpo
    return out


def _sdpo_rows(t: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """SDPO tensors of ``rows``, each width cut to the chunk's longest row (student, teacher, response)."""
    ls = int(t["sdpo_student_attention_mask"][rows].sum(dim=1).max())
    lt = int(t["sdpo_teacher_attention_mask"][rows].sum(dim=1).max())
    r = int(t["student_response_valid"][rows].sum(dim=1).max())
    width = {"sdpo_student_ids": ls, "sdpo_student_attention_mask": ls, "sdpo_student_mask": ls,
             "sdpo_teacher_ids": lt, "sdpo_teacher_attention_mask": lt, "sdpo_teacher_mask": lt}
    return {k: t[k][rows, :width.get(k, r)] for k in SDPO_KEYS}


def _dpo_rows(t: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """DPO tensors of ``rows``; (P, L) tensors cut to the chunk's longest chosen / rejected sequence."""
    out = {}
    for name in ("chosen", "rejected"):
        width = int(t[f"dpo_{name}_attention_mask"][rows].sum(dim=1).max())
        for k in (f"dpo_{name}_ids", f"dpo_{name}_attention_mask", f"dpo_{name}_response_mask"):
            out[k] = t[k][rows, :width]
        out[f"dpo_ref_{name}_logps"] = t[f"dpo_ref_{name}_logps"][rows]
    return out


class ComposerGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose completions are multi-turn tool episodes played against OpenEnv servers.

    Args:
        model: the policy (a `PreTrainedModel`).
        tokenizer: its tokenizer (chat template with tool calling).
        config: the run config.
        sessions: env sessions, at least ``episodes_per_step`` of them (one per concurrent episode).
        peer_name: names this peer's episodes (`episode_dataset`).
        args: the TRL config (`grpo_args`): ``per_device_train_batch_size`` episodes per micro-batch,
            ``gradient_accumulation_steps`` = ``steps_per_generation`` micro-batches per optimizer step.
        callbacks: Trainer callbacks (the DiLoCo round callback).

    Raises:
        ValueError: too few sessions, or ``steps_per_generation != gradient_accumulation_steps`` or
            ``num_iterations != 1`` (one generation batch must be exactly one optimizer step).

    Attributes:
        episodes_per_step: episodes generated per optimizer (inner) step: micro-batch x K.
        round_episodes: episodes played since the last `take_round_stats` (for the round's metrics).
        round_losses: per-channel losses since the last `take_round_stats`, one record per optimizer step
            (the sum of its K micro-batches' contributions).
        round_collator: the collator's kept/skipped counts since the last `take_round_stats`.
        reference_model: the frozen DPO reference policy (theta of the round's start; `refresh_reference`).
    """

    def __init__(self, *, model: Any, tokenizer: Any, config: RunConfig, sessions: Sequence[EnvSession],
                 peer_name: str, args: GRPOConfig, callbacks: list[TrainerCallback] | None = None):
        if args.steps_per_generation != args.gradient_accumulation_steps or args.num_iterations != 1:
            raise ValueError(f"steps_per_generation {args.steps_per_generation}, gradient_accumulation_steps "
                             f"{args.gradient_accumulation_steps}, num_iterations {args.num_iterations}: expected "
                             "equal steps and 1 iteration (one generation batch per optimizer step)")
        self.episodes_per_step = args.per_device_train_batch_size * args.steps_per_generation
        if len(sessions) < self.episodes_per_step:
            raise ValueError(f"need {self.episodes_per_step} env sessions (one per episode of a step), "
                             f"got {len(sessions)}")
        self.run_config = config
        self.sessions = list(sessions)
        self.round_episodes: list[Episode] = []
        self.round_losses: list[ChannelLosses] = []
        self.round_collator = CollatorStats()
        self.round_pair_stats: dict[str, int] = {}
        self._rows: list[dict] = []
        self._step_episodes: list[Episode] = []
        self._parts: list[ChannelPart] = []  # SDPO/DPO chunks of the current step, one per micro-batch left
        self._micro_left = 0  # micro-batches of the current optimizer step not yet through `_compute_loss`
        self._step_record = ChannelLosses()
        self.hints = HintRegistry.from_config(config.hints)
        self.collator = ComposerCollator(tokenizer, hints=self.hints, max_length=config.max_seq_len)
        self.reference_model = None
        if config.loss.beta_dpo > 0:
            self.reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        # one row per task (GRPO group); TRL's sampler drops a trailing incomplete generation batch, hence + 1
        n_rows = max(1, args.max_steps) * (self.episodes_per_step // config.grpo.num_generations) + 1
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
        self._parts = split_channels(self._extra_channels(self._step_episodes), self.args.steps_per_generation)
        self._micro_left = self.args.steps_per_generation
        return output

    def _extra_channels(self, episodes: list[Episode]) -> ComposerBatch | None:
        """SDPO sites and trace-replay DPO pairs of this step's episodes (None when both weights are 0)."""
        cfg = self.run_config
        if cfg.loss.alpha_sdpo <= 0 and cfg.loss.beta_dpo <= 0:
            return None
        pairs = []
        if cfg.loss.beta_dpo > 0:
            from composer_diloco.channels.dpo_pairs import collect_pairs

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
        # TRL's GRPO loss of this micro-batch, unchanged: already scaled so the K micro-batches add up to the step's
        loss = super()._compute_loss(model, inputs)
        cfg, record = self.run_config.loss, self._step_record
        part = self._parts.pop(0) if self._parts else None
        record.loss_grpo += float(loss.detach())
        if part is not None and part.tensors:
            tensors = {k: v.to(loss.device) for k, v in part.tensors.items()}
            if cfg.alpha_sdpo > 0 and part.num_sdpo:
                sdpo = sdpo_loss(model, tensors, cfg)  # mean over this chunk's tokens
                loss = loss + cfg.alpha_sdpo * part.sdpo_weight * sdpo
                record.loss_sdpo += part.sdpo_weight * float(sdpo.detach())
                record.sdpo_sites += part.num_sdpo
            if cfg.beta_dpo > 0 and part.num_dpo:
                dpo = dpo_loss(model, tensors, cfg)  # mean over this chunk's pairs
                loss = loss + cfg.beta_dpo * part.dpo_weight * dpo
                record.loss_dpo += part.dpo_weight * float(dpo.detach())
                record.dpo_pairs += part.num_dpo
        self._micro_left = max(0, self._micro_left - 1)
        if self._micro_left == 0:  # the optimizer step's last micro-batch (or a call outside `train`)
            mode = "train" if model.training else "eval"
            for key in ("loss_sdpo", "loss_dpo", "sdpo_sites", "dpo_pairs"):
                self._metrics[mode][f"composite/{key}"].append(float(getattr(record, key)))
            self.round_losses.append(record)
            self._step_record, self._parts = ChannelLosses(), []
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
    episodes, out = play_rollout(trainer, trainer.sessions, trainer.run_config,
                                 [(int(r["seed"]), str(r["episode_id"])) for r in rows])
    trainer.round_episodes.extend(episodes)
    trainer._step_episodes = episodes
    return out


def play_rollout(trainer, sessions: list, config: RunConfig, keys: list[tuple[int, str]]) -> tuple[list, dict]:
    """Play one episode per ``(seed, episode_id)`` with ``trainer``'s model and tokenizer (any TRL `GRPOTrainer`).

    Returns:
        ``(episodes, outputs)``: the `Episode` list and TRL's ``rollout_func`` keys (``prompt_ids``,
        ``completion_ids``, ``logprobs``) plus ``env_mask`` and ``env_reward``, one entry per episode.
    """
    episodes = play_episodes(
        trainer.model, trainer.processing_class, sessions, keys, tool_suffix_ids=trainer._get_tool_suffix_ids,
        max_tool_calls=config.env.max_tool_calls, max_turn_tokens=config.env.max_turn_tokens,
        max_seq_len=config.max_seq_len, temperature=config.grpo.temperature,
    )
    return episodes, {
        "prompt_ids": [e.prompt_ids for e in episodes],
        "completion_ids": [e.completion_ids for e in episodes],
        "logprobs": [e.logprobs for e in episodes],
        "env_mask": [e.env_mask for e in episodes],
        "env_reward": [e.reward for e in episodes],
    }
