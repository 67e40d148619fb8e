"""The SDPO channel: hint distillation at tool-error sites (Hübotter et al., arXiv 2601.20802).

A site is an assistant turn that recovers from a failed tool call; the teacher is the same policy with a hint about
the error inserted before that turn (`composer_diloco.channels.hints`). The channel's term is
``alpha_sdpo * JSD_beta(student || stopgrad teacher)`` on the recovery turn's tokens, a mean over those tokens
(`composer_diloco.channels.losses.generalized_jsd`; the JSD family and its beta as TRL GKD, arXiv 2306.13649).

With ``sdpo_peer_demo_reward`` set, the teacher's hint starts with a successful attempt at the same task, the calls
of another episode of the step's GRPO group (`composer_diloco.channels.sdpo_sites.peer_demos`): SDPO's reprompting
with successful peer rollouts, a teacher that knows more than the student.

With ``sdpo_verify_samples`` > 0 a site is kept only where the hinted teacher's sampled recovery beats the student's
when both are replayed in the env (`composer_diloco.channels.sdpo_verify`): on the embedded default the teacher is
not better on average (BENCHMARKS.md, section 1c).

Config: ``[loss] alpha_sdpo`` (the weight; 0 = off), ``sdpo_jsd_beta``, ``sdpo_temperature``, ``sdpo_token_clip``,
``sdpo_top_k``, ``sdpo_verify_samples``, ``sdpo_peer_demo_reward`` (`composer_diloco.config.LossConfig`), and the ``[hints]`` templates;
``[env] max_turn_tokens`` and ``[grpo] temperature`` for the verification samples.
Metrics: ``loss_sdpo``, ``sdpo_sites``, ``sdpo_skipped`` (``{no_hint, empty_recovery, no_recovery, truncated,
unverified}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from composer_diloco.channels.base import (ChannelContext, ChannelMetrics, ChannelPart, Counts, LossChannel, register_channel,
                                           split_rows)
from composer_diloco.channels.losses import generalized_jsd
from composer_diloco.channels.sdpo_verify import verify_sites
from composer_diloco.channels.sdpo_sites import SdpoStats, SiteFinder, peer_demos
from composer_diloco.rollout.episodes import Episode, EnvSession

if TYPE_CHECKING:
    from composer_diloco.config import LossConfig, RunConfig

__all__ = ["SDPO_KEYS", "SdpoChannel", "sdpo_loss", "split_sdpo"]


SDPO_KEYS = ("sdpo_student_ids", "sdpo_student_attention_mask", "sdpo_teacher_ids", "sdpo_teacher_attention_mask",
             "student_response_idx", "teacher_response_idx", "student_response_valid", "teacher_response_valid",
             "sdpo_student_mask", "sdpo_teacher_mask")
"""The SDPO row tensors (`composer_diloco.channels.sdpo_sites.SiteFinder.tensors` documents their shapes)."""


def sdpo_loss(model: nn.Module, t: dict[str, torch.Tensor], cfg: LossConfig) -> torch.Tensor:
    """Generalized JSD between the policy on the student context and the same policy (no grad) on the teacher
    context (hint inserted), on the recovery turn's tokens (SDPO, arXiv 2601.20802; JSD as TRL GKD).

    Args:
        model: the policy being trained (a causal LM: ``input_ids`` (S, L) long -> ``logits`` (S, L, V)).
        t: SDPO tensors of S sites (`SDPO_KEYS`), on the model's device: ``sdpo_student_ids`` (S, Ls) long,
            ``sdpo_teacher_ids`` (S, Lt) long, their attention masks, ``student_response_idx`` /
            ``teacher_response_idx`` (S, R) long (aligned positions of the recovery tokens),
            ``student_response_valid`` (S, R) bool.
        cfg: ``sdpo_jsd_beta``, ``sdpo_temperature``, ``sdpo_token_clip``, ``sdpo_top_k``.
    Returns:
        Scalar fp32 (fp64 for an fp64 model), nats per token: the mean over the sites' valid tokens.
    Raises:
        ValueError: from `generalized_jsd`, on inconsistent shapes or settings out of range.
    """
    rows = torch.arange(t["sdpo_student_ids"].shape[0], device=t["sdpo_student_ids"].device)[:, None]
    # logits[:, i - 1] predict token i: select the positions that predict each response token
    s_pos = (t["student_response_idx"] - 1).clamp_min(0)  # (S, R)
    t_pos = (t["teacher_response_idx"] - 1).clamp_min(0)
    student = model(input_ids=t["sdpo_student_ids"], attention_mask=t["sdpo_student_attention_mask"]).logits
    with torch.no_grad():
        teacher = model(input_ids=t["sdpo_teacher_ids"], attention_mask=t["sdpo_teacher_attention_mask"]).logits
    return generalized_jsd(
        student[rows, s_pos], teacher[rows, t_pos], t["student_response_valid"],  # (S, R, V) each
        beta=cfg.sdpo_jsd_beta, temperature=cfg.sdpo_temperature, token_clip=cfg.sdpo_token_clip, top_k=cfg.sdpo_top_k,
    )


def split_sdpo(t: dict[str, torch.Tensor], parts: int) -> list[ChannelPart]:
    """Cut S SDPO sites into ``parts`` contiguous, near-equal row chunks (``torch.tensor_split``; a chunk may be
    empty), each weighted by its share of the valid response tokens, ``T_c / T``: SDPO is a token mean, so
    ``sum_c (T_c / T) * mean_c`` is the mean over all S sites. Each chunk's tensors are cut to its longest row
    (right padding: nothing a valid position sees), so peak memory follows the micro-batch.

    Args:
        t: SDPO tensors of S >= 1 sites (`SDPO_KEYS`).
        parts: K >= 1.
    Returns:
        K `ChannelPart` s (``rows``: a tensor dict or None, ``count``: sites, ``weight``: T_c / T).
    Raises:
        ValueError: ``parts`` below 1.
    """
    tokens = t["student_response_valid"].sum(dim=1)  # (S,) valid tokens per site
    total = max(int(tokens.sum()), 1)
    return split_rows(int(t["sdpo_student_ids"].shape[0]), parts, lambda rows: _sdpo_rows(t, rows),
                      lambda rows: int(tokens[rows].sum()) / total)


def _sdpo_rows(t: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """SDPO tensors of ``rows``, each width cut to the chunk's longest row (student, teacher, response)."""
    ls = int(t["sdpo_student_attention_mask"][rows].sum(dim=1).max())
    lt = int(t["sdpo_teacher_attention_mask"][rows].sum(dim=1).max())
    r = int(t["student_response_valid"][rows].sum(dim=1).max())
    width = {"sdpo_student_ids": ls, "sdpo_student_attention_mask": ls, "sdpo_student_mask": ls,
             "sdpo_teacher_ids": lt, "sdpo_teacher_attention_mask": lt, "sdpo_teacher_mask": lt}
    return {k: t[k][rows, :width.get(k, r)] for k in SDPO_KEYS}


@register_channel
class SdpoChannel(LossChannel):
    """SDPO as a `LossChannel` (see the module docstring).

    Args:
        weight: alpha_sdpo > 0.
        sites: finds the sites and pads their tensors (its hint registry and ``max_length``).
        loss_config: the ``[loss]`` section (the JSD settings, ``sdpo_verify_samples``).
        session: the env session the verification replays use (needed when ``sdpo_verify_samples`` > 0).
        config: the run config (``env.max_turn_tokens``, ``grpo.temperature`` of the verification samples).
    """

    name = "sdpo"
    metrics = ChannelMetrics(loss_key="loss_sdpo", count_key="sdpo_sites", loss_title="SDPO loss",
                             count_title="sites", plot_label="SDPO loss")
    stats_type = SdpoStats

    def __init__(self, weight: float, sites: SiteFinder, loss_config: LossConfig,
                 session: EnvSession | None = None, config: RunConfig | None = None):
        super().__init__(weight)
        if loss_config.sdpo_verify_samples > 0 and (session is None or config is None):
            raise ValueError("sdpo_verify_samples > 0 needs an env session and the run config to replay sites")
        self.sites, self.loss_config, self.session, self.config = sites, loss_config, session, config

    @classmethod
    def from_context(cls, ctx: ChannelContext) -> SdpoChannel | None:
        """Off when ``[loss] alpha_sdpo`` is 0; sites use ``ctx.hints`` and ``config.max_seq_len``, verification
        replays ``ctx.sessions[0]`` (the session DPO replays; the two channels build one after the other)."""
        cfg = ctx.config.loss
        if cfg.alpha_sdpo <= 0:
            return None
        return cls(cfg.alpha_sdpo, SiteFinder(ctx.tokenizer, hints=ctx.hints, max_length=ctx.config.max_seq_len),
                   cfg, session=ctx.sessions[0] if ctx.sessions else None, config=ctx.config)

    def build(self, model: nn.Module, episodes: Sequence[Episode], stats: Counts) -> dict[str, torch.Tensor] | None:
        """The SDPO tensors of the step's sites (`SDPO_KEYS`), or None without a site. Without verification: no model
        call, no RNG. With ``sdpo_verify_samples`` > 0: samples from the global RNG and replays in the env
        (`verify_sites`); a site that fails moves from ``sdpo_sites`` to ``sdpo_skipped_unverified``."""
        min_reward = self.loss_config.sdpo_peer_demo_reward
        demos = peer_demos(episodes, min_reward) if min_reward is not None else [None] * len(episodes)
        found = [(ep, site) for ep, demo in zip(episodes, demos)
                 for site in self.sites.sites_from_episode(ep, stats, demo)]
        k = self.loss_config.sdpo_verify_samples
        if found and k > 0:
            keep = verify_sites(model, self.sites.tokenizer, found, self.session, samples=k,
                                max_turn_tokens=self.config.env.max_turn_tokens,
                                temperature=self.config.grpo.temperature)
            dropped = keep.count(False)
            stats.sdpo_sites -= dropped
            stats.sdpo_skipped_unverified += dropped
            found = [f for f, ok in zip(found, keep) if ok]
        sites = [site for _, site in found]
        return self.sites.tensors(sites) if sites else None

    def split(self, rows: dict[str, torch.Tensor], parts: int) -> list[ChannelPart]:
        """`split_sdpo`."""
        return split_sdpo(rows, parts)

    def loss(self, model: nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """`sdpo_loss` on one part (a token mean)."""
        return sdpo_loss(model, rows, self.loss_config)

    @classmethod
    def round_record(cls, loss_mean: float, stats: Counts | None) -> dict[str, Any]:
        """``loss_sdpo``, ``sdpo_sites`` and ``sdpo_skipped`` (the skip counts without their ``sdpo_skipped_``)."""
        record = super().round_record(loss_mean, stats)
        counts = (stats if stats is not None else SdpoStats()).as_dict()
        record["sdpo_skipped"] = {k.removeprefix("sdpo_skipped_"): v for k, v in counts.items()
                                  if k.startswith("sdpo_skipped_")}
        return record
