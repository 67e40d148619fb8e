"""The DPO channel: trace-replay preference pairs (Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290).

At the step's tool-error sites, candidate actions are replayed in the environment and paired by score
(`composer_diloco.channels.dpo_pairs.collect_pairs`); the channel's term is ``beta_dpo * DPO`` (sigmoid loss, Eq. (7),
`composer_diloco.channels.losses.dpo_sigmoid_loss`), a mean over pairs, against the reference log-probs of the
round's frozen global model theta_r (refreshed after every outer step, so every peer shares the trust region). In a
``[lora]`` run the reference is the base model instead: the policy itself with its adapters disabled (peft's
``disable_adapter()``), no copy, the same on every peer for the whole run.

Config: ``[loss] beta_dpo`` (the weight; 0 = off), ``dpo_beta`` (DPO's beta) and ``dpo_score`` (what a candidate's
replay is worth: any accepted call, or only a call of the env's script, `dpo_teachers.script_progress`; or
``"recovery"``: one pair per site whose chosen is the env's whole scripted recovery, `dpo_recovery.recovery_pairs`),
declared here (`DpoSettings`); the ``[preference]`` section (`composer_diloco.config.PreferenceConfig`), ``[env]
max_turn_tokens`` and ``[grpo] temperature`` for the samples.
Teachers come from the env contract (`composer_diloco.rollout.env_package.EnvPackage.script` for ``"scripted"``).
Metrics: ``loss_dpo``, ``dpo_pairs`` (pairs collated), ``pair_stats`` (`PairStats` by name; ``{}`` when off).
Memory: the reference copy (full fine-tuning), the reference pass over the step's pairs, and per micro-batch the
pairs' chosen and rejected rows with their logits (`DpoChannel.memory`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import nn

from composer_diloco.channels.base import (ChannelContext, ChannelMemory, ChannelMetrics, ChannelPart, ChannelSettings,
                                           Counts, LossChannel, pad_id, register_channel, split_rows)
from composer_diloco.channels.dpo_pairing import PairStats
from composer_diloco.channels.dpo_pairs import collect_pairs
from composer_diloco.channels.dpo_recovery import recovery_pairs
from composer_diloco.channels.dpo_teachers import ProgressFn, TeacherFn, make_teachers, script_progress
from composer_diloco.channels.losses import dpo_sigmoid_loss, sequence_logprobs
from composer_diloco.channels.dpo_rows import dpo_rows
from composer_diloco.rollout.env_package import ScriptFn
from composer_diloco.rollout.episodes import Episode, EnvSession

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig
    from composer_diloco.policy.memory_sizes import ModelShape, StepShape

__all__ = ["DPO_KEYS", "K_DPO_VOCAB", "K_REFERENCE_LOGITS", "DpoChannel", "DpoSettings", "DpoStats", "dpo_loss",
           "reference_pass_bytes", "split_dpo"]


class DpoSettings(ChannelSettings):
    """DPO's ``[loss]`` keys (its pairing settings are the ``[preference]`` section,
    `composer_diloco.config.PreferenceConfig`). Off by default: the published DPO lowered the held-out gain on
    tool_env (BENCHMARKS.md 1c) and broke the coding env (README, "The coding env": greedy 0.40 -> 0.02)."""

    weight_key = "beta_dpo"

    beta_dpo: float = Field(0.0, ge=0, description="Weight of trace-replay DPO (0 = off; off by default, BENCHMARKS.md "
                                                   "1c).")
    dpo_beta: float = Field(0.1, gt=0, description="DPO's beta (Rafailov et al. 2023).")
    dpo_score: Literal["accepted", "script_progress", "recovery"] = Field(
        "accepted",
        description="A DPO candidate's score: 'accepted' = 1 for any call the env runs without error; "
                    "'script_progress' = 1 only for a call of the env package's script still to make (0 like an error "
                    "otherwise; envs without a script score as 'accepted'). BENCHMARKS.md 1c: 22% of the warm "
                    "start's chosen calls under 'accepted' are off-script, e.g. arithmetic on made-up numbers. "
                    "'recovery': one pair per error site, chosen = the env's scripted remainder played to the "
                    "episode's end (its replies masked out), scored by the episode's reward, rejected = the failed "
                    "call (channels/dpo_recovery.py: on the coding env single-call pairs teach a writer that never "
                    "submits); needs an env with a scripted solver.",
    )


K_DPO_VOCAB = 2.0
"""fp32 vocab-sized tensors DPO keeps per response token for backward (the selected rows and their logsumexp's
input: `sequence_logprobs`; measured on CPU)."""
K_REFERENCE_LOGITS = 2.5
"""fp32 ``(pairs, row, vocab)`` logits alive at DPO's reference pass's peak: the chosen rows' kept while the rejected
rows' are computed, and half a copy more (measured on CPU at Qwen3-0.6B's size: 2.47); under bf16 a quarter more for
the bf16 logits before their fp32 copy."""


def reference_pass_bytes(shape: ModelShape, pairs: int, seq_len: int, *, bf16: bool = False,
                         response_tokens: int | None = None) -> int:
    """Bytes of DPO's reference log-probs over ``pairs`` pairs of ``seq_len``-token rows, all at once
    (`composer_diloco.channels.dpo_rows.dpo_rows`): the chosen rows' fp32 logits, the rejected rows' fp32 logits and,
    under bf16, their bf16 logits before the copy, plus half a row of logits of the forward's own
    (`K_REFERENCE_LOGITS`); the no-grad forward's per-layer temporaries (``(4 * hidden + 3 * intermediate) * 4`` bytes
    a token) and `sequence_logprobs`' two fp32 copies of the response rows."""
    response = seq_len if response_tokens is None else min(response_tokens, seq_len)
    logits = pairs * seq_len * shape.vocab * 4 * K_REFERENCE_LOGITS * (1.25 if bf16 else 1.0)
    forward = pairs * seq_len * (4 * shape.hidden + 3 * shape.intermediate) * 4
    return int(logits + forward + 2 * pairs * response * shape.vocab * 4)

log = logging.getLogger(__name__)


DPO_KEYS = ("dpo_chosen_ids", "dpo_chosen_attention_mask", "dpo_chosen_response_mask", "dpo_rejected_ids",
            "dpo_rejected_attention_mask", "dpo_rejected_response_mask", "dpo_ref_chosen_logps",
            "dpo_ref_rejected_logps")
"""The DPO row tensors (`composer_diloco.channels.dpo_rows.dpo_rows` documents their shapes)."""


@dataclass
class DpoStats(Counts):
    """What the DPO channel built in a step (summed over a round).

    Attributes:
        dpo_pairs: pairs collated (trained on).
        dpo_skipped_truncated: pairs whose response alone is longer than ``max_seq_len``.
        pair_stats: what pair collection saw and dropped (`PairStats`).
    """

    dpo_pairs: int = 0
    dpo_skipped_truncated: int = 0
    pair_stats: PairStats = field(default_factory=PairStats)


def dpo_loss(model: nn.Module, t: dict[str, torch.Tensor], cfg: DpoSettings) -> torch.Tensor:
    """DPO sigmoid loss (arXiv 2305.18290, Eq. (7)) of the policy's summed response log-probs against the reference
    log-probs `dpo_rows` computed with the round's frozen global model.

    Args:
        model: the policy being trained (causal LM: ``input_ids`` (P, L) long -> ``logits`` (P, L, V)).
        t: DPO tensors of P pairs (`DPO_KEYS`), on the model's device: ``dpo_{chosen,rejected}_ids`` (P, L) long,
            their attention and response masks (P, L), ``dpo_ref_{chosen,rejected}_logps`` (P,) float32 nats.
        cfg: ``dpo_beta`` (DPO's beta).
    Returns:
        Scalar fp32, nats: the mean over pairs.
    Raises:
        ValueError: from `sequence_logprobs` / `dpo_sigmoid_loss`, on inconsistent shapes.
    """
    logps = {}
    for name in ("chosen", "rejected"):
        ids, att = t[f"dpo_{name}_ids"], t[f"dpo_{name}_attention_mask"]
        logits = model(input_ids=ids, attention_mask=att).logits
        logps[name] = sequence_logprobs(logits, ids, t[f"dpo_{name}_response_mask"])
    loss, _, _ = dpo_sigmoid_loss(logps["chosen"], logps["rejected"], t["dpo_ref_chosen_logps"],
                                  t["dpo_ref_rejected_logps"], beta=cfg.dpo_beta)
    return loss


def split_dpo(t: dict[str, torch.Tensor], parts: int) -> list[ChannelPart]:
    """Cut P DPO pairs into ``parts`` contiguous, near-equal row chunks, each weighted by ``P_c / P`` (DPO is a mean
    over pairs); (P, L) tensors are cut to the chunk's longest chosen / rejected sequence.

    Args:
        t: DPO tensors of P >= 1 pairs (`DPO_KEYS`).
        parts: K >= 1.
    Returns:
        K `ChannelPart` s (``rows``: a tensor dict or None, ``count``: pairs, ``weight``: P_c / P).
    Raises:
        ValueError: ``parts`` below 1.
    """
    n = int(t["dpo_chosen_ids"].shape[0])
    return split_rows(n, parts, lambda rows: _dpo_rows(t, rows), lambda rows: len(rows) / n)


def _dpo_rows(t: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """DPO tensors of ``rows``; (P, L) tensors cut to the chunk's longest chosen / rejected sequence."""
    out = {}
    for name in ("chosen", "rejected"):
        width = int(t[f"dpo_{name}_attention_mask"][rows].sum(dim=1).max())
        for k in (f"dpo_{name}_ids", f"dpo_{name}_attention_mask", f"dpo_{name}_response_mask"):
            out[k] = t[k][rows, :width]
        out[f"dpo_ref_{name}_logps"] = t[f"dpo_ref_{name}_logps"][rows]
    return out


@register_channel
class DpoChannel(LossChannel):
    """Trace-replay DPO as a `LossChannel` (see the module docstring).

    Args:
        weight: beta_dpo > 0.
        config: the run config (``[preference]``, ``[loss] dpo_beta``, ``env.max_turn_tokens``, ``grpo.temperature``).
        reference_model: the frozen reference policy pi_ref (a copy of the policy; `after_outer_step` refreshes it),
            or with LoRA the policy with its adapters disabled (`composer_diloco.policy.lora.AdaptersDisabled`).
        session: the env session every replay uses.
        tokenizer: the policy's tokenizer (the pairs' sampler; its pad id pads the rows, `dpo_rows`).
        hints: the SDPO hint registry (the ``"policy+hint"`` candidates).
        teachers: ``{name: TeacherFn}`` (`make_teachers`).
        policy: the trained policy whose weights the reference copies.
        progress: with ``[loss] dpo_score = "script_progress"``, the env's `script_progress` (an accepted call off
            the env's script scores 0.0); None scores every accepted call 1.0.
        recovery: with ``[loss] dpo_score = "recovery"``, the env's scripted solver: the pairs are
            `dpo_recovery.recovery_pairs` (chosen = the scripted recovery, rejected = the failed call) instead of
            `collect_pairs`'s single calls.
    """

    name = "dpo"
    metrics = ChannelMetrics(loss_key="loss_dpo", count_key="dpo_pairs", loss_title="DPO loss",
                             count_title="pairs", plot_label="DPO loss")
    stats_type = DpoStats
    settings_type = DpoSettings

    def __init__(self, weight: float, *, config: RunConfig, reference_model: nn.Module, session: EnvSession,
                 tokenizer: Any, hints: Any, teachers: dict[str, TeacherFn], policy: nn.Module,
                 progress: ProgressFn | None = None, recovery: ScriptFn | None = None):
        super().__init__(weight)
        self.config, self.reference_model, self.session = config, reference_model, session
        self.tokenizer, self.hints, self.teachers, self.policy = tokenizer, hints, teachers, policy
        self.progress, self.recovery = progress, recovery
        self.settings = DpoSettings.of(config.loss)

    @classmethod
    def from_context(cls, ctx: ChannelContext) -> DpoChannel | None:
        """Off when ``[loss] beta_dpo`` is 0. Copies the policy as the reference (no RNG is drawn; under bf16 autocast
        its linear weights are stored in bf16, `composer_diloco.policy.precision`); a LoRA policy (``peft.PeftModel``)
        is its own reference with its adapters disabled (`AdaptersDisabled`: the base, no copy).

        Raises:
            ValueError: an unknown ``[preference] teachers`` name (`make_teachers`); ``dpo_score = "recovery"`` with
                an env package that has no scripted solver.
        """
        cfg, settings = ctx.config, DpoSettings.of(ctx.config.loss)
        if settings.beta_dpo <= 0:
            return None
        recovery = None
        if settings.dpo_score == "recovery":
            recovery = ctx.env.script
            if recovery is None:
                raise ValueError(f"[loss] dpo_score = 'recovery' plays the env's scripted solver, and env package "
                                 f"{ctx.env.package!r} has none (expected a script() in its demos.py)")
        from composer_diloco.policy.lora import AdaptersDisabled, is_lora
        from composer_diloco.policy.precision import frozen_linears_to_bf16, is_autocast

        # LoRA: the reference is the base, i.e. the policy with its adapters disabled (no copy); else a frozen copy,
        # whose linear weights a bf16 node stores in bf16 (bit-identical under its autocast, half their bytes)
        if is_lora(ctx.model):
            reference = AdaptersDisabled(ctx.model)
        else:
            reference = copy.deepcopy(ctx.model).eval().requires_grad_(False)
            if is_autocast(ctx.model):
                log.info("DPO reference: a frozen copy of the policy, its linear weights in bf16 (%.1f MB saved)",
                         frozen_linears_to_bf16(reference) / 1e6)
        return cls(settings.beta_dpo, config=cfg, reference_model=reference,
                   session=ctx.sessions[0], hints=ctx.hints, policy=ctx.model,
                   tokenizer=ctx.tokenizer,
                   teachers=make_teachers(cfg.preference.teachers, ctx.env),
                   progress=script_progress(ctx.env) if settings.dpo_score == "script_progress" else None,
                   recovery=recovery)

    def build(self, model: nn.Module, episodes: Sequence[Episode], stats: Counts) -> dict[str, torch.Tensor] | None:
        """Collect the step's pairs (samples from the global RNG, replays in the env), then their tensors with the
        reference log-probs; None when no pair survives."""
        cfg, p = self.config, self.config.preference
        if self.recovery is not None:
            pairs, pair_stats = recovery_pairs(self.tokenizer, episodes, self.session, self.recovery,
                                               max_sites=p.max_sites, min_score_diff=p.min_score_diff,
                                               max_tool_reply_tokens=cfg.env.max_tool_reply_tokens)
        else:
            pairs, pair_stats = collect_pairs(
                model, self.tokenizer, episodes, self.session, hints=self.hints, teachers=self.teachers,
                mode=p.mode, min_score_diff=p.min_score_diff, max_pairs_per_turn=p.max_pairs_per_turn,
                max_sites=p.max_sites, max_turn_tokens=cfg.env.max_turn_tokens, temperature=cfg.grpo.temperature,
                progress=self.progress,
            )
        stats.pair_stats.add(pair_stats)
        if not pairs:
            return None
        return dpo_rows(pairs, self.reference_model, pad_token_id=pad_id(self.tokenizer), max_length=cfg.max_seq_len,
                        stats=stats) or None

    def split(self, rows: dict[str, torch.Tensor], parts: int) -> list[ChannelPart]:
        """`split_dpo`."""
        return split_dpo(rows, parts)

    def loss(self, model: nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """`dpo_loss` on one part (a mean over pairs)."""
        return dpo_loss(model, rows, self.settings)

    @torch.no_grad()
    def after_outer_step(self) -> None:
        """Make the reference policy the current weights (theta of the new round); a LoRA run's reference, the
        base, never changes."""
        if not isinstance(self.reference_model, nn.Module):  # `AdaptersDisabled`: nothing to copy
            return
        for ref, cur in zip(self.reference_model.parameters(), self.policy.parameters(), strict=True):
            ref.copy_(cur)

    @classmethod
    def memory(cls, settings: DpoSettings, config: RunConfig, step: StepShape) -> ChannelMemory:
        """Pairs per step at most ``[preference] max_sites * max_pairs_per_turn`` (`collect_pairs` keeps no more),
        dealt over the micro-batches: ``2 * ceil(pairs / grad_accum)`` rows each (chosen and rejected), whose logits
        are alive at its peak with `K_DPO_VOCAB` vocab-sized tensors per response token; the reference, a frozen copy
        of the policy under full fine-tuning (``4 P``, ``4 P - 2 L`` with its linear weights in bf16) and none with
        ``[lora]`` (the base); and the reference pass over all the step's pairs (`reference_pass_bytes`)."""
        pref, shape = config.preference, step.shape
        pairs = pref.max_sites * pref.max_pairs_per_turn
        rows = 2 * math.ceil(pairs / step.grad_accum)
        return ChannelMemory(
            name=cls.name, label="DPO", rows=rows, backward_rows=rows // 2,
            peak=step.vocab_row * rows * K_DPO_VOCAB + rows * step.seq_len * shape.vocab * step.logit_bytes,
            kept=step.vocab_row * rows * K_DPO_VOCAB,
            copy=0 if shape.lora else 4 * shape.params_total - (2 * shape.linear if step.bf16 else 0),
            phase=reference_pass_bytes(shape, pairs, step.seq_len, bf16=step.bf16,
                                       response_tokens=step.response_tokens),
            phase_label="DPO reference pass")

    @classmethod
    def round_record(cls, loss_mean: float, stats: Counts | None) -> dict[str, Any]:
        """``loss_dpo``, ``dpo_pairs`` and ``pair_stats`` (``{}`` when the channel was off)."""
        record = super().round_record(loss_mean, stats)
        record["pair_stats"] = {k: int(v) for k, v in stats.pair_stats.as_dict().items()} if stats is not None else {}
        return record
