"""The SDPO and DPO channels (`composer_diloco.channels.losses`) against TRL 1.16's own implementations, on random tensors.

References called directly:
- ``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss`` (staticmethod), labels = -100 where mask is 0,
  ``reduction="batchmean"`` (with labels, TRL divides by the number of unmasked tokens: a per-token mean).
- ``trl.experimental.sdpo.loss_utils.compute_topk_self_distillation_loss`` (per-token, ``distillation_add_tail=False``).
- ``trl.trainer.dpo_trainer.DPOTrainer._compute_loss`` with ``loss_type=["sigmoid"]``, run on a trainer built with
  ``__new__`` and a stand-in model whose "per-token log-probs" are the sequence log-probs we compare.
"""

from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.gkd import GKDTrainer  # noqa: E402
from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402

from composer_diloco.channels.losses import dpo_sigmoid_loss, generalized_jsd, sequence_logprobs  # noqa: E402

B, T, V = 3, 7, 11


def _batch(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Random student/teacher logits (B, T, V) and a random mask whose row 1 is fully masked."""
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    teacher = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0, 0] = True  # at least one valid token
    mask[1] = False  # a fully masked row
    return student, teacher, mask


# --------------------------------------------------------------------------------------------- generalized_jsd


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_jsd_matches_trl_gkd(beta, temperature):
    student, teacher, mask = _batch(seed=int(beta * 10 + temperature * 100))
    labels = torch.where(mask, torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -100))
    ref = GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="batchmean"
    )
    ours = generalized_jsd(student, teacher, mask, beta=beta, temperature=temperature)
    assert ours.shape == ()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_jsd_mask_accepts_0_1_ints_and_ignores_garbage_in_masked_positions():
    student, teacher, mask = _batch()
    clean = generalized_jsd(student, teacher, mask)
    dirty_s, dirty_t = student.clone(), teacher.clone()
    dirty_s[~mask] = float("nan")
    dirty_t[~mask] = float("inf")
    torch.testing.assert_close(generalized_jsd(dirty_s, dirty_t, mask.long()), clean)


def test_jsd_beta_endpoints_are_the_kls():
    student, teacher, mask = _batch(seed=3)
    s_log, t_log = student.log_softmax(-1)[mask], teacher.log_softmax(-1)[mask]
    forward = (t_log.exp() * (t_log - s_log)).sum(-1).mean()  # KL(T || S)
    reverse = (s_log.exp() * (s_log - t_log)).sum(-1).mean()  # KL(S || T)
    torch.testing.assert_close(generalized_jsd(student, teacher, mask, beta=0.0), forward)
    torch.testing.assert_close(generalized_jsd(student, teacher, mask, beta=1.0), reverse)


def test_jsd_gradient_reaches_only_the_student_and_only_masked_positions():
    student, teacher, mask = _batch(seed=4)
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    generalized_jsd(student, teacher, mask, beta=0.5).backward()
    assert teacher.grad is None
    assert student.grad is not None
    assert student.grad[mask].abs().sum() > 0
    assert torch.all(student.grad[~mask] == 0)


def test_jsd_no_valid_token_is_a_connected_zero():
    student, teacher, _ = _batch()
    student.requires_grad_(True)
    loss = generalized_jsd(student, teacher, torch.zeros(B, T, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(student.grad == 0)


def test_jsd_is_zero_for_identical_distributions_and_low_precision_is_computed_in_fp32():
    student, _, mask = _batch(seed=5)
    for beta in (0.0, 0.3, 1.0):
        assert generalized_jsd(student, student.clone(), mask, beta=beta).abs().item() < 1e-6
    s16, t16, _ = _batch(seed=6, dtype=torch.bfloat16)
    loss = generalized_jsd(s16, t16, mask)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, generalized_jsd(s16.float(), t16.float(), mask))


@pytest.mark.parametrize("support", ["student", "teacher"])
def test_jsd_top_k_equal_to_vocab_is_the_full_divergence(support):
    student, teacher, mask = _batch(seed=7)
    for beta in (0.0, 0.5, 1.0):
        full = generalized_jsd(student, teacher, mask, beta=beta)
        for k in (V, V + 5):
            topk = generalized_jsd(student, teacher, mask, beta=beta, top_k=k, top_k_support=support)
            torch.testing.assert_close(topk, full)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_top_k_matches_trl_sdpo_topk(beta):
    student, teacher, mask = _batch(seed=8)
    k, temperature = 4, 2.0
    per_token = compute_topk_self_distillation_loss(
        student / temperature, teacher / temperature,
        distillation_topk=k, distillation_alpha=beta, distillation_add_tail=False,
    )  # (B, T); TRL's SDPOTrainer scales the logits by the temperature before this call
    ref = per_token[mask].mean()
    ours = generalized_jsd(student, teacher, mask, beta=beta, temperature=temperature, top_k=k)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, generalized_jsd(student, teacher, mask, beta=beta, temperature=temperature))


def test_jsd_top_k_teacher_support_by_hand():
    student, teacher, mask = _batch(seed=9)
    k = 3
    idx = teacher.topk(k, dim=-1).indices
    s_log = student.gather(-1, idx).log_softmax(-1)[mask]
    t_log = teacher.gather(-1, idx).log_softmax(-1)[mask]
    reverse = (s_log.exp() * (s_log - t_log)).sum(-1).mean()
    ours = generalized_jsd(student, teacher, mask, beta=1.0, top_k=k, top_k_support="teacher")
    torch.testing.assert_close(ours, reverse)


def test_jsd_token_clip_bounds_each_token():
    student, teacher, mask = _batch(seed=10)
    student = student * 5  # large divergences
    unclipped = generalized_jsd(student, teacher, mask, beta=0.0)
    clip = 0.5 * unclipped.item()
    clipped = generalized_jsd(student, teacher, mask, beta=0.0, token_clip=clip)
    assert clipped.item() <= clip + 1e-6
    assert clipped.item() < unclipped.item()
    torch.testing.assert_close(generalized_jsd(student, teacher, mask, beta=0.0, token_clip=1e9), unclipped)
    # Per-token: the mean of per-token clamps, not a clamp of the mean.
    s_log, t_log = student.log_softmax(-1)[mask], teacher.log_softmax(-1)[mask]
    per_token = (t_log.exp() * (t_log - s_log)).sum(-1)
    torch.testing.assert_close(clipped, per_token.clamp(max=clip).mean())


def test_jsd_shape_and_argument_errors():
    student, teacher, mask = _batch()
    with pytest.raises(ValueError, match=r"\(3, 7, 11\).*\(3, 7, 12\)"):
        generalized_jsd(student, torch.zeros(B, T, V + 1), mask)
    with pytest.raises(ValueError, match=r"\(3, 6\)"):
        generalized_jsd(student, teacher, mask[:, :-1])
    with pytest.raises(ValueError, match="same shape"):
        generalized_jsd(student[0], teacher[0], mask[0])
    for kwargs in ({"beta": 1.5}, {"beta": -0.1}, {"temperature": 0.0}, {"token_clip": 0.0}, {"top_k": 0},
                   {"top_k": 2, "top_k_support": "both"}):
        with pytest.raises(ValueError):
            generalized_jsd(student, teacher, mask, **kwargs)


# ------------------------------------------------------------------------------------------- sequence_logprobs


def test_sequence_logprobs_matches_a_hand_loop():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    response = torch.zeros(B, T, dtype=torch.long)
    response[0, 3:] = 1
    response[1, 5:6] = 1
    # row 2: no response token
    expected = torch.zeros(B)
    for b in range(B):
        for t in range(1, T):
            if response[b, t]:
                expected[b] += torch.log_softmax(logits[b, t - 1].detach(), -1)[ids[b, t]]
    out = sequence_logprobs(logits, ids, response)
    assert out.shape == (B,) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    assert out[2].item() == 0.0
    out.sum().backward()
    assert torch.all(logits.grad[0, :2] == 0) and logits.grad[0, 2:6].abs().sum() > 0
    assert torch.all(logits.grad[:, -1] == 0)  # the last position predicts nothing


def test_sequence_logprobs_ignores_padding_values_and_computes_bf16_in_fp32():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    response = torch.zeros(B, T, dtype=torch.bool)
    response[:, 2:5] = True
    clean = sequence_logprobs(logits, ids, response)
    dirty_logits, dirty_ids = logits.clone(), ids.clone()
    dirty_logits[:, 5:] = float("nan")
    dirty_ids[:, 5:] = -100
    torch.testing.assert_close(sequence_logprobs(dirty_logits, dirty_ids, response), clean)
    low = sequence_logprobs(logits.bfloat16(), ids, response)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, sequence_logprobs(logits.bfloat16().float(), ids, response))


def test_sequence_logprobs_errors():
    logits, ids = torch.zeros(B, T, V), torch.zeros(B, T, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\(3, 6\)"):
        sequence_logprobs(logits, ids[:, 1:], torch.ones(B, T - 1))
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        sequence_logprobs(logits, ids, torch.ones(2, T))
    first = torch.zeros(B, T)
    first[0, 0] = 1
    with pytest.raises(ValueError, match="first token"):
        sequence_logprobs(logits, ids, first)
    bad = ids.clone()
    bad[0, 3] = V
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sequence_logprobs(logits, bad, torch.ones(B, T) * (torch.arange(T) > 0))


# ----------------------------------------------------------------------------------------------------- DPO


class _LogpsAsModel:
    """Stands in for the policy in `DPOTrainer._compute_loss`: its per-token log-probs are given sequence logps."""

    training = False

    def __init__(self, logps: torch.Tensor):
        self.logps = logps  # (2B,): [chosen..., rejected...]

    def __call__(self, **_kwargs):
        n = self.logps.shape[0]
        return SimpleNamespace(
            log_probs=self.logps.unsqueeze(1),  # (2B, 1): one completion token carries the whole sequence logp
            entropy=torch.zeros(n, 1),
            mean_logits=torch.zeros(n, 1),
            is_top1=torch.zeros(n, 1, dtype=torch.bool),
        )


def _trl_dpo_sigmoid(pc, pr, rc, rr, beta):
    """TRL 1.16 DPOTrainer's sigmoid loss on these log-probs, through its real `_compute_loss`."""
    trainer = DPOTrainer.__new__(DPOTrainer)
    model = _LogpsAsModel(torch.cat([pc, pr]))
    ident = lambda x: x  # noqa: E731
    trainer.model = model
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=ident, gather=ident)
    trainer.aux_loss_enabled = False
    trainer.ld_alpha = None
    trainer.precompute_ref_logps = True
    trainer.f_divergence_type = "reverse_kl"
    trainer.loss_types, trainer.loss_weights = ["sigmoid"], [1.0]
    trainer.beta, trainer.label_smoothing, trainer.use_weighting = beta, 0.0, False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens, trainer._tp_size = 0, 1
    n = pc.shape[0]
    inputs = {
        "input_ids": torch.zeros(2 * n, 2, dtype=torch.long),
        "attention_mask": torch.ones(2 * n, 2, dtype=torch.long),
        "completion_mask": torch.tensor([[0, 1]] * (2 * n)),
        "ref_chosen_logps": rc,
        "ref_rejected_logps": rr,
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return loss, trainer._metrics["eval"]


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_dpo_matches_trl_sigmoid(beta):
    g = torch.Generator().manual_seed(13)
    pc, pr, rc, rr = (torch.randn(5, generator=g) * 10 - 30 for _ in range(4))
    ref, metrics = _trl_dpo_sigmoid(pc, pr, rc, rr, beta)
    loss, chosen_rewards, rejected_rewards = dpo_sigmoid_loss(pc, pr, rc, rr, beta=beta)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    assert metrics["rewards/chosen"][0] == pytest.approx(chosen_rewards.mean().item(), abs=1e-6)
    assert metrics["rewards/rejected"][0] == pytest.approx(rejected_rewards.mean().item(), abs=1e-6)
    torch.testing.assert_close(chosen_rewards, beta * (pc - rc))


def test_dpo_label_smoothing_gradients_and_empty_batch():
    g = torch.Generator().manual_seed(14)
    pc, pr = torch.randn(4, generator=g, requires_grad=True), torch.randn(4, generator=g, requires_grad=True)
    rc, rr = torch.randn(4, generator=g, requires_grad=True), torch.randn(4, generator=g, requires_grad=True)
    eps, beta = 0.2, 0.3
    loss, chosen_rewards, _ = dpo_sigmoid_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    h = beta * ((pc - rc) - (pr - rr))
    expected = (-(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)).mean()
    torch.testing.assert_close(loss, expected)
    assert not chosen_rewards.requires_grad
    loss.backward()
    assert pc.grad is not None and pr.grad is not None
    assert rc.grad is None and rr.grad is None  # the reference is frozen
    empty = torch.zeros(0, requires_grad=True)
    loss, chosen_rewards, rejected_rewards = dpo_sigmoid_loss(empty, empty, empty, empty)
    assert loss.item() == 0.0 and chosen_rewards.shape == (0,) and rejected_rewards.shape == (0,)
    loss.backward()


def test_dpo_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"\(3,\), \(2,\)"):
        dpo_sigmoid_loss(x, torch.zeros(2), x, x)
    with pytest.raises(ValueError, match=r"\(3, 1\)"):
        dpo_sigmoid_loss(x[:, None], x[:, None], x[:, None], x[:, None])
    with pytest.raises(ValueError, match="beta"):
        dpo_sigmoid_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_sigmoid_loss(x, x, x, x, label_smoothing=0.7)
