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
``sdpo_top_k``, ``sdpo_verify_samples``, ``sdpo_peer_demo_reward`` (`SdpoSettings`, declared here), and the ``[hints]``
templates; ``[env] max_turn_tokens`` and ``[grpo] temperature`` for the verification samples.
Memory: one student row per episode of a micro-batch, with the student's and teacher's logits and the divergence's
vocab-sized tensors per response token (`SdpoChannel.memory`, the ``K_SDPO_*`` counts).
Metrics: ``loss_sdpo``, ``sdpo_sites``, ``sdpo_skipped`` (``{no_hint, empty_recovery, no_recovery, truncated,
unverified}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field
from torch import nn

from composer_diloco.channels.base import (ChannelContext, ChannelMemory, ChannelMetrics, ChannelPart, ChannelSettings,
                                           Counts, LossChannel, register_channel, split_rows)
from composer_diloco.channels.losses import generalized_jsd
from composer_diloco.channels.sdpo_verify import verify_sites
from composer_diloco.channels.sdpo_sites import SdpoStats, SiteFinder, peer_demos
from composer_diloco.rollout.episodes import Episode, EnvSession

if TYPE_CHECKING:
    from composer_diloco.config import RunConfig
    from composer_diloco.policy.memory_sizes import StepShape

__all__ = ["K_SDPO_MIXTURE", "K_SDPO_PEAK", "K_SDPO_SAVED", "SDPO_KEYS", "SdpoChannel", "SdpoSettings", "sdpo_loss",
           "split_sdpo"]


class SdpoSettings(ChannelSettings):
    """SDPO's ``[loss]`` keys. Off by default: on tool_env no variant beat GRPO alone beyond noise, the published SDPO
    lowered the held-out gain and SDPO alone collapsed 2 of 3 runs (BENCHMARKS.md 1b, 1c, 1a item 4); 0.2 is the
    weight those rows used."""

    weight_key = "alpha_sdpo"
    omit_at_default = ("sdpo_peer_demo_reward",)  # added after runs were published (issue 40)

    alpha_sdpo: float = Field(0.0, ge=0, description="Weight of SDPO hint distillation at tool-error sites (0 = off; "
                                                     "off by default, BENCHMARKS.md 1c).")
    sdpo_jsd_beta: float = Field(
        1.0, ge=0, le=1, description="Generalized JSD beta (TRL GKD): 0 forward KL(T||S), 1 reverse KL(S||T), SDPO's."
    )
    sdpo_temperature: float = Field(1.0, gt=0, description="Softmax temperature of the SDPO divergence.")
    sdpo_token_clip: float | None = Field(None, gt=0, description="Clamp each token's divergence at this value.")
    sdpo_top_k: int | None = Field(None, ge=1, description="Restrict the divergence to the top-k tokens.")
    sdpo_verify_samples: int = Field(
        0, ge=0, le=64,
        description="Replay-verified SDPO: at each site sample this many recovery turns from the student and from the "
                    "hinted teacher, score them in the env, and keep the site only if the teacher scores higher "
                    "(0 = off, every site kept). BENCHMARKS.md 1c: the warm start's teacher is not better on average.",
    )
    sdpo_peer_demo_reward: float | None = Field(
        None,
        description="SDPO's teacher also sees a successful attempt at the same task: the calls of another episode of "
                    "the step's GRPO group whose reward is at least this, before the error hint (SDPO's reprompting "
                    "with successful peer rollouts, arXiv 2601.20802). None = the error hint only. A teacher that "
                    "knows more than the student (issue 40); the warm start shows the same hints with "
                    "[warmstart] hint_rate.",
    )


K_SDPO_PEAK = 9.0
"""fp32 vocab-sized tensors per SDPO response token while the divergence is computed (`sdpo_loss`: the student's and
the teacher's selected logits and their copies, both log-softmaxes, the KL terms; `generalized_jsd` with beta 0 or 1;
measured on CPU)."""
K_SDPO_SAVED = 3.0
"""Of those, what SDPO keeps for backward (both log-softmaxes, the KL's input)."""
K_SDPO_MIXTURE = (13.0, 6.0)
"""`K_SDPO_PEAK` and `K_SDPO_SAVED` for 0 < ``sdpo_jsd_beta`` < 1: the mixture's log-probabilities and both KL terms
(measured on CPU)."""


SDPO_KEYS = ("sdpo_student_ids", "sdpo_student_attention_mask", "sdpo_teacher_ids", "sdpo_teacher_attention_mask",
             "student_response_idx", "teacher_response_idx", "student_response_valid", "teacher_response_valid",
             "sdpo_student_mask", "sdpo_teacher_mask")
"""The SDPO row tensors (`composer_diloco.channels.sdpo_sites.SiteFinder.tensors` documents their shapes)."""


def sdpo_loss(model: nn.Module, t: dict[str, torch.Tensor], cfg: SdpoSettings) -> torch.Tensor:
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
        settings: its ``[loss]`` keys (the JSD settings, ``sdpo_verify_samples``, ``sdpo_peer_demo_reward``).
        session: the env session the verification replays use (needed when ``sdpo_verify_samples`` > 0).
        config: the run config (``env.max_turn_tokens``, ``grpo.temperature`` of the verification samples).
    """

    name = "sdpo"
    metrics = ChannelMetrics(loss_key="loss_sdpo", count_key="sdpo_sites", loss_title="SDPO loss",
                             count_title="sites", plot_label="SDPO loss")
    stats_type = SdpoStats
    settings_type = SdpoSettings

    def __init__(self, weight: float, sites: SiteFinder, settings: SdpoSettings,
                 session: EnvSession | None = None, config: RunConfig | None = None):
        super().__init__(weight)
        if settings.sdpo_verify_samples > 0 and (session is None or config is None):
            raise ValueError("sdpo_verify_samples > 0 needs an env session and the run config to replay sites")
        self.sites, self.settings, self.session, self.config = sites, settings, session, config

    @classmethod
    def from_context(cls, ctx: ChannelContext) -> SdpoChannel | None:
        """Off when ``[loss] alpha_sdpo`` is 0; sites use ``ctx.hints`` and ``config.max_seq_len``, verification
        replays ``ctx.sessions[0]`` (the session DPO replays; the two channels build one after the other)."""
        cfg = SdpoSettings.of(ctx.config.loss)
        if cfg.alpha_sdpo <= 0:
            return None
        return cls(cfg.alpha_sdpo, SiteFinder(ctx.tokenizer, hints=ctx.hints, max_length=ctx.config.max_seq_len),
                   cfg, session=ctx.sessions[0] if ctx.sessions else None, config=ctx.config)

    def build(self, model: nn.Module, episodes: Sequence[Episode], stats: Counts) -> dict[str, torch.Tensor] | None:
        """The SDPO tensors of the step's sites (`SDPO_KEYS`), or None without a site. Without verification: no model
        call, no RNG. With ``sdpo_verify_samples`` > 0: samples from the global RNG and replays in the env
        (`verify_sites`); a site that fails moves from ``sdpo_sites`` to ``sdpo_skipped_unverified``."""
        min_reward = self.settings.sdpo_peer_demo_reward
        demos = peer_demos(episodes, min_reward) if min_reward is not None else [None] * len(episodes)
        found = [(ep, site) for ep, demo in zip(episodes, demos)
                 for site in self.sites.sites_from_episode(ep, stats, demo)]
        k = self.settings.sdpo_verify_samples
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
        return sdpo_loss(model, rows, self.settings)

    @classmethod
    def memory(cls, settings: SdpoSettings, config: RunConfig, step: StepShape) -> ChannelMemory:
        """One student row per episode of the micro-batch (an episode averages one site or fewer; a round with more
        sites than episodes warns), each holding the student's and the teacher's logits and, per response token,
        `K_SDPO_PEAK` vocab-sized fp32 tensors at the divergence's peak, `K_SDPO_SAVED` of them kept for backward
        (`K_SDPO_MIXTURE` for 0 < ``sdpo_jsd_beta`` < 1)."""
        rows = step.micro_batch
        peak, kept = K_SDPO_MIXTURE if 0 < settings.sdpo_jsd_beta < 1 else (K_SDPO_PEAK, K_SDPO_SAVED)
        return ChannelMemory(
            name=cls.name, label="SDPO", rows=rows, backward_rows=rows,
            peak=rows * (2 * step.seq_len * step.shape.vocab * step.logit_bytes + peak * step.vocab_row),
            kept=kept * step.vocab_row * rows, count_key="sdpo_sites")

    @classmethod
    def round_record(cls, loss_mean: float, stats: Counts | None) -> dict[str, Any]:
        """``loss_sdpo``, ``sdpo_sites`` and ``sdpo_skipped`` (the skip counts without their ``sdpo_skipped_``)."""
        record = super().round_record(loss_mean, stats)
        counts = (stats if stats is not None else SdpoStats()).as_dict()
        record["sdpo_skipped"] = {k.removeprefix("sdpo_skipped_"): v for k, v in counts.items()
                                  if k.startswith("sdpo_skipped_")}
        return record
