"""The SDPO and DPO channels of the composite inner loss (GRPO itself stays TRL's).

The inner loss of a node is ``GRPO + alpha_sdpo * SDPO + beta_dpo * DPO``. This module holds the two extra
channels as pure tensor functions (no model, no trainer), so they can be checked against TRL on their own:

- `generalized_jsd`: the token-level divergence between the policy (student) and the same policy with a hint in
  its context (teacher), at error sites. SDPO: Hübotter et al., "Reinforcement Learning via Self-Distillation",
  arXiv 2601.20802 (TRL: ``trl.experimental.sdpo.SDPOTrainer``). The divergence family and its ``beta`` convention
  are GKD's: Agarwal et al., "On-Policy Distillation of Language Models", arXiv 2306.13649, Eq. (1)
  (TRL: ``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss``).
- `sequence_logprobs` + `dpo_sigmoid_loss`: trace-replay DPO. Rafailov et al., "Direct Preference Optimization",
  arXiv 2305.18290, Eq. (7); with label smoothing, conservative DPO (Mitchell, "A note on DPO with noisy
  preferences and relationship to IPO", 2023).

All three compute in fp32 (fp64 when the inputs are fp64), whatever the input dtype, and return fp32 (fp64).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["dpo_sigmoid_loss", "generalized_jsd", "sequence_logprobs"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64; every other float dtype (bf16, fp16, fp32) is computed in fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) summed over the last dim, from log-probabilities; ``(..., V) -> (...)``.

    ``F.kl_div(input=log Q, target=log P, log_target=True)`` is ``P * (log P - log Q)``: torch puts the
    distributions in the opposite order to the maths, as TRL's GKD/SDPO code notes.
    """
    return F.kl_div(q_log, p_log, reduction="none", log_target=True).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    token_clip: float | None = None,
    top_k: int | None = None,
    top_k_support: Literal["student", "teacher"] = "student",
) -> torch.Tensor:
    """Mean per-token generalized Jensen-Shannon divergence between student and teacher (the SDPO channel).

    With S = softmax(student_logits / temperature) and T = softmax(teacher_logits / temperature) at each position,
    the per-token divergence is (GKD, arXiv 2306.13649, Eq. (1); TRL's convention):

    - ``beta == 0``: forward KL(T || S);
    - ``beta == 1``: reverse KL(S || T) (the SDPO paper's objective, arXiv 2601.20802: KL(student || stopgrad
      teacher));
    - otherwise ``beta * KL(T || M) + (1 - beta) * KL(S || M)`` with the mixture ``M = beta * T + (1 - beta) * S``.

    Each divergence is summed over the vocabulary; the result is the mean over the tokens where ``mask`` is set.
    That equals ``GKDTrainer.generalized_jsd_loss(..., labels, reduction="batchmean")`` with ``labels = -100`` where
    ``mask`` is 0 (TRL's "batchmean" divides by the number of unmasked tokens when labels are given, by the batch
    size otherwise). TRL's SDPOTrainer instead averages per sequence, then over sequences; a per-token mean weighs
    every error-site token equally, however many share a sequence.

    The teacher is detached: gradients reach ``student_logits`` only. Masked positions are never computed, so
    padding there may hold any value (even inf/NaN).

    Args:
        student_logits: ``(B, T, V)`` float logits of the policy on its own context (any float dtype).
        teacher_logits: ``(B, T, V)`` float logits of the same policy with the hint in its context, aligned
            position by position with ``student_logits``.
        mask: ``(B, T)`` bool or 0/1 tensor; nonzero = this position is distilled (the error-site tokens).
        beta: interpolation coefficient in [0, 1] (TRL GKD's ``beta``, TRL SDPO's ``distillation_alpha``).
        temperature: > 0; both logits are divided by it before the softmax (and before the top-k selection).
        token_clip: if set (> 0), each token's divergence is clamped at this maximum before the mean, so a few
            tokens with a huge divergence cannot dominate the step (their gradient is then zero).
        top_k: if set, both distributions are restricted to a k-token support at each position and renormalised
            over it (the divergence of the top-k conditionals). This is TRL's ``distillation_mode="topk_logits"``
            with ``distillation_add_tail=False`` (``trl.experimental.sdpo.loss_utils.
            compute_topk_self_distillation_loss``). ``top_k >= V`` is the full vocabulary.
        top_k_support: whose top-k tokens form the support. ``"student"`` (default) is what TRL's SDPOTrainer
            does. ``"teacher"`` is the classic distillation choice: at an error site the hinted teacher's preferred
            token may lie outside the student's top-k, and only a teacher support can pull it up.

    Returns:
        Scalar tensor (fp32, or fp64 for fp64 inputs) in nats per token. With no valid token it is
        ``student_logits.sum() * 0``: zero, but attached to the graph so ``backward()`` still works.

    Raises:
        ValueError: if the logits are not 3-D floats of the same shape, if ``mask`` is not ``(B, T)``, or if
            ``beta``, ``temperature``, ``token_clip``, ``top_k`` or ``top_k_support`` is out of range.
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise ValueError(
            "student_logits and teacher_logits must both be (B, T, V) with the same shape, got "
            f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)}"
        )
    if mask.shape != student_logits.shape[:2]:
        raise ValueError(
            f"mask must be (B, T) = {tuple(student_logits.shape[:2])} to match logits "
            f"{tuple(student_logits.shape)}, got mask {tuple(mask.shape)}"
        )
    if not (student_logits.is_floating_point() and teacher_logits.is_floating_point()):
        raise ValueError(
            f"logits must be floating point, got student {student_logits.dtype} and teacher {teacher_logits.dtype}"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if token_clip is not None and not token_clip > 0.0:
        raise ValueError(f"token_clip must be > 0 or None, got {token_clip}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_k_support not in ("student", "teacher"):
        raise ValueError(f"top_k_support must be 'student' or 'teacher', got {top_k_support!r}")

    valid = mask != 0  # (B, T) bool
    if not bool(valid.any()):
        return student_logits.sum() * 0

    dtype = _compute_dtype(student_logits)
    # Only the valid positions are computed: (N, V), N = number of valid tokens.
    student = student_logits[valid].to(dtype) / temperature
    teacher = teacher_logits.detach()[valid].to(dtype) / temperature
    vocab = student.size(-1)
    if top_k is not None and top_k < vocab:
        ranked = student if top_k_support == "student" else teacher
        support = ranked.detach().topk(top_k, dim=-1).indices  # (N, k)
        student = student.gather(-1, support)
        teacher = teacher.gather(-1, support)
    # log_softmax over the (possibly top-k) support is the renormalised distribution on it.
    s_log = F.log_softmax(student, dim=-1)
    t_log = F.log_softmax(teacher, dim=-1)

    if beta == 0.0:
        per_token = _kl(t_log, s_log)
    elif beta == 1.0:
        per_token = _kl(s_log, t_log)
    else:
        # log M = logsumexp(log S + log(1 - beta), log T + log beta), stable for peaked distributions.
        m_log = torch.logaddexp(s_log + math.log1p(-beta), t_log + math.log(beta))
        per_token = beta * _kl(t_log, m_log) + (1.0 - beta) * _kl(s_log, m_log)  # (N,)

    if token_clip is not None:
        per_token = per_token.clamp(max=token_clip)
    return per_token.mean()


def sequence_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Sum of the response tokens' log-probabilities, log p(y | x), per sequence (DPO's sequence score).

    ``logits[:, t]`` predicts ``input_ids[:, t + 1]`` (a causal LM's output on ``input_ids``). Position ``t`` of
    ``input_ids`` is scored when ``response_mask[:, t]`` is nonzero, as ``log_softmax(logits[:, t - 1])[input_ids[:,
    t]]``; prompt and padding positions (mask 0) add nothing and are never computed, so padding logits may hold any
    value. This is the reduction TRL's DPOTrainer uses (``per_token_logps.sum(dim=1)`` over completion tokens).

    Args:
        logits: ``(B, T, V)`` float logits (any float dtype; computed in fp32).
        input_ids: ``(B, T)`` integer token ids the logits were computed on.
        response_mask: ``(B, T)`` bool or 0/1, in ``input_ids`` coordinates; nonzero marks response tokens.

    Returns:
        ``(B,)`` fp32 (fp64 for fp64 logits) log-probabilities in nats, differentiable w.r.t. ``logits``; 0.0 for a
        row with no response token.

    Raises:
        ValueError: on shape mismatches (naming the shapes), if ``response_mask[:, 0]`` is set (the first token
            has no logits that predict it), or if a scored token id is outside ``[0, V)``.
    """
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be a (B, T, V) float tensor, got {tuple(logits.shape)} {logits.dtype}")
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"input_ids must be (B, T) = {tuple(logits.shape[:2])} to match logits {tuple(logits.shape)}, "
            f"got input_ids {tuple(input_ids.shape)}"
        )
    if response_mask.shape != input_ids.shape:
        raise ValueError(
            f"response_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got response_mask {tuple(response_mask.shape)}"
        )
    batch, _, vocab = logits.shape
    dtype = _compute_dtype(logits)
    scored = response_mask != 0  # (B, T)
    if bool(scored[:, 0].any()):
        raise ValueError("response_mask[:, 0] must be 0: the first token of a sequence has no logits predicting it")
    target_mask = scored[:, 1:]  # (B, T-1): logits[:, t] scores input_ids[:, t + 1]
    targets = input_ids[:, 1:][target_mask]  # (N,)
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        bad = targets[(targets < 0) | (targets >= vocab)][0].item()
        raise ValueError(f"response token id {bad} is outside the vocabulary [0, {vocab})")
    rows = logits[:, :-1][target_mask].to(dtype)  # (N, V)
    token_logps = rows.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(rows, dim=-1)  # (N,)
    # Scatter back to (B, T-1) and sum each row: deterministic, unlike an atomic index_add on GPU.
    per_position = token_logps.new_zeros(target_mask.shape).masked_scatter(target_mask, token_logps)
    return per_position.sum(dim=-1).reshape(batch)


def dpo_sigmoid_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss on sequence log-probabilities (Rafailov et al. 2023, arXiv 2305.18290, Eq. (7)).

    With ``h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)``, the per-pair loss is
    ``-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)`` (``eps = label_smoothing``; ``eps = 0`` is
    plain DPO, ``eps > 0`` is conservative DPO for labels flipped with probability eps), averaged over pairs. At
    ``eps = 0`` it equals TRL 1.16's DPOTrainer with ``loss_type="sigmoid"`` (whose sigmoid loss ignores
    ``label_smoothing``; TRL's ``"robust"`` loss is a different, unbiased estimator).

    The reference log-probabilities are detached (the reference policy is frozen).

    Args:
        policy_chosen: ``(B,)`` float, log pi_theta(y_w | x) summed over the chosen response (`sequence_logprobs`).
        policy_rejected: ``(B,)`` float, log pi_theta(y_l | x).
        ref_chosen: ``(B,)`` float, log pi_ref(y_w | x).
        ref_rejected: ``(B,)`` float, log pi_ref(y_l | x).
        beta: > 0, DPO's beta (the strength of the implicit KL to the reference).
        label_smoothing: in [0, 0.5], cDPO's assumed label-flip probability.

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)``: ``loss`` a scalar (fp32, or fp64 for fp64 inputs; 0.0
        attached to the graph for an empty batch), the rewards ``(B,)`` detached implicit rewards
        ``beta * (policy - ref)``.

    Raises:
        ValueError: if the four inputs are not 1-D of one shape (naming the shapes), or ``beta`` /
            ``label_smoothing`` is out of range.
    """
    shapes = [tuple(t.shape) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)]
    if len(set(shapes)) != 1 or len(shapes[0]) != 1:
        raise ValueError(
            "policy_chosen, policy_rejected, ref_chosen, ref_rejected must all be (B,), got "
            f"{shapes[0]}, {shapes[1]}, {shapes[2]}, {shapes[3]}"
        )
    if not beta > 0.0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    dtype = _compute_dtype(policy_chosen)
    chosen_logratios = policy_chosen.to(dtype) - ref_chosen.detach().to(dtype)  # (B,)
    rejected_logratios = policy_rejected.to(dtype) - ref_rejected.detach().to(dtype)
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    if policy_chosen.numel() == 0:
        return (policy_chosen.sum() + policy_rejected.sum()).to(dtype) * 0, chosen_rewards, rejected_rewards
    margin = beta * (chosen_logratios - rejected_logratios)
    losses = -F.logsigmoid(margin)
    if label_smoothing > 0.0:
        losses = (1.0 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-margin)
    return losses.mean(), chosen_rewards, rejected_rewards
