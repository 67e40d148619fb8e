"""The two extra channels of the inner loss, on the collator's tensors: total = GRPO + alpha * SDPO + beta * DPO.

GRPO stays TRL's own ``GRPOTrainer._compute_loss`` (called by `trainer.ComposerGRPOTrainer`); these functions
add the forward passes of the other two channels. Each costs nothing when its weight is 0 or the step holds
nothing for it (the trainer does not call it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from composer_diloco.config import LossConfig
from composer_diloco.channels.losses import dpo_sigmoid_loss, generalized_jsd, sequence_logprobs


@dataclass
class ChannelLosses:
    """One inner step's loss values (floats, for metrics) and counts."""

    loss_grpo: float = 0.0
    loss_sdpo: float = 0.0
    loss_dpo: float = 0.0
    sdpo_sites: int = 0
    dpo_pairs: int = 0


def sdpo_loss(model: nn.Module, t: dict[str, torch.Tensor], cfg: LossConfig) -> torch.Tensor:
    """Generalized JSD between the policy on the student context and the same policy (no grad) on the teacher
    context (hint inserted), on the recovery turn's tokens (SDPO, arXiv 2601.20802; JSD as TRL GKD).

    Args:
        model: the policy being trained.
        t: the collator's SDPO tensors (`collator.ComposerBatch`), on the model's device.
        cfg: ``sdpo_jsd_beta``, ``sdpo_temperature``, ``sdpo_token_clip``, ``sdpo_top_k``.
    Returns:
        Scalar: mean over the sites' valid tokens.
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


def dpo_loss(model: nn.Module, t: dict[str, torch.Tensor], cfg: LossConfig) -> torch.Tensor:
    """DPO sigmoid loss (Rafailov et al., arXiv 2305.18290) of the policy's summed response log-probs against the
    reference log-probs the collator computed with the round's frozen global model.

    Args:
        t: the collator's DPO tensors, on the model's device.
    Returns:
        Scalar: mean over pairs.
    """
    logps = {}
    for name in ("chosen", "rejected"):
        ids, att = t[f"dpo_{name}_ids"], t[f"dpo_{name}_attention_mask"]
        logits = model(input_ids=ids, attention_mask=att).logits
        logps[name] = sequence_logprobs(logits, ids, t[f"dpo_{name}_response_mask"])
    loss, _, _ = dpo_sigmoid_loss(logps["chosen"], logps["rejected"], t["dpo_ref_chosen_logps"],
                                  t["dpo_ref_rejected_logps"], beta=cfg.dpo_beta)
    return loss
