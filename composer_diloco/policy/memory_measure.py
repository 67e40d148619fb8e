"""What one inner step really allocates on a CPU: the measurement the memory plan's counts were calibrated against
(`composer_diloco.policy.memory_plan`; ``tests/test_memory_plan.py`` and ``bench/real_arch.py measure`` compare the
two). It runs the built-in channels' own losses (SDPO's `sdpo_loss`, DPO's `dpo_loss`) on synthetic rows; a new
channel's rows are planned by its `LossChannel.memory` and measured by its own test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_diloco.policy.memory_plan import proc_status_bytes

__all__ = ["measure_training_bytes"]


def measure_training_bytes(model: Any, *, rows: int, seq_len: int, reference: bool, lora: bool = False,
                           gradient_checkpointing: bool = False, temperature: float = 1.0,
                           bf16: bool = False, sdpo_rows: int = 0, dpo_pairs: int = 0,
                           response_tokens: int = 16, sdpo_beta: float = 1.0) -> dict[str, int]:
    """Measure on CPU what one inner step of ``model`` allocates: the peak resident-set growth (``VmHWM`` after
    resetting it through ``/proc/self/clear_refs``) over the state built here, one DPO reference pass, and one
    forward/backward + AdamW step.

    Run it in a fresh process started with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every tensor of 64 KiB or
    more on its own and returns it at free, so the resident set follows the allocations). A forward/backward over 16
    tokens runs before the baseline, so what a process allocates once, on its first forward/backward (~9 MB on a Xeon;
    ~14 MB more on one CI machine's CPU), is not counted as the step's. The step is the trainer's composite loss on
    random tokens: GRPO's log-probs through TRL's fused LM head (``add_fused_lm_head``, as ``GRPOTrainer`` computes
    them: temperature-scaled, with the entropy), SDPO's `sdpo_loss` over ``sdpo_rows`` student/teacher rows, DPO's
    `dpo_loss` over ``dpo_pairs`` pairs, summed, then one backward.

    Args:
        model: the policy (fp32, CPU), with adapters already applied when ``lora``.
        rows, seq_len: the GRPO micro-batch (token ids ``(rows, seq_len)`` long); every SDPO/DPO row has ``seq_len``
            tokens too.
        reference: build the DPO reference (a frozen deep copy; with ``lora`` the policy with adapters disabled) and
            run its pass over the ``dpo_pairs`` pairs (or one row) before the step.
        lora: the model is a ``peft.PeftModel``.
        gradient_checkpointing: ``model.gradient_checkpointing_enable()`` first.
        temperature: the sampling temperature the logits are divided by.
        bf16: as a ``--dtype bf16`` node: frozen linear weights (a LoRA base, the reference copy) stored in bf16 and
            every forward under CPU bf16 autocast (`composer_diloco.policy.precision`).
        sdpo_rows, dpo_pairs: SDPO sites and DPO pairs in the micro-batch (0: the channel is off).
        response_tokens: the response tokens of each SDPO/DPO row (its last ones).
        sdpo_beta: the generalized JSD's beta (1: SDPO's reverse KL; between 0 and 1: the mixture).
    Returns:
        ``{"state": measured bytes of the AdamW moments and the reference copy; "reference_pass": measured peak bytes
        of the DPO reference pass over the state; "peak": measured peak bytes over the training step (state, the
        gradients backward creates, activations, transients); "gradients": the trainable parameters' bytes (computed,
        as ``zero_grad(set_to_none=True)`` leaves them to backward); "activations": peak - state - gradients}``, each
        relative to the resident set when the call starts (the weights, faulted in first, are not counted).
    """
    import copy
    import ctypes

    import torch
    from trl.trainer.utils import add_fused_lm_head

    from composer_diloco.channels.dpo import dpo_loss
    from composer_diloco.channels.sdpo import sdpo_loss
    from composer_diloco.channels.losses import sequence_logprobs
    from composer_diloco.channels.dpo import DpoSettings
    from composer_diloco.channels.sdpo import SdpoSettings

    def rss(field: str) -> int:
        value = proc_status_bytes(field)
        if value is None:
            raise RuntimeError(f"/proc/self/status has no {field}")
        return value

    def reset_peak() -> None:
        Path("/proc/self/clear_refs").write_text("5")

    gen = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    mask = torch.ones(rows, seq_len, dtype=torch.long)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model.enable_input_require_grads()
    model.train()
    if bf16:
        from composer_diloco.policy.precision import autocast_forward, frozen_linears_to_bf16

        frozen_linears_to_bf16(model)
        autocast_forward(model, "cpu")
    # TRL's GRPOTrainer patches the (base) model so that its GRPO forward returns log-probs, not logits
    add_fused_lm_head(model.get_base_model() if lora else model, temperature=temperature,
                      outputs=("log_probs", "entropy"))
    with torch.no_grad():  # from_pretrained may map the safetensors file: fault the weights in before the baseline
        for p in model.parameters():
            p.sum()
    # one tiny forward/backward first: what a process allocates once on its first pass depends on the CPU, not on the
    # step, and is left out of the baseline
    model(input_ids=ids[:1, :16], attention_mask=mask[:1, :16]).logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the small tensors it freed go back too, or the moments would reuse them
    base = rss("VmRSS:")
    reset_peak()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=False)
    for p in params:  # the moments as the first step allocates them; .grad is left to backward (zero_grad(None))
        opt.state[p]["step"] = torch.tensor(0.0)
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)
    ref = None
    if reference and not lora:
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        if bf16:
            frozen_linears_to_bf16(ref)
    state = rss("VmRSS:") - base

    def rows_of(n: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row_ids = torch.randint(0, vocab, (n, width), generator=gen)
        response = torch.zeros(n, width, dtype=torch.long)
        response[:, width - response_tokens:] = 1
        return row_ids, torch.ones(n, width, dtype=torch.long), response

    gradients = sum(p.numel() * p.element_size() for p in params)
    reset_peak()
    with torch.no_grad():  # the DPO reference log-probs, all pairs at once as `channels.dpo_rows.dpo_rows` does
        pair_ids, pair_mask, pair_response = rows_of(max(dpo_pairs, 1), seq_len)
        for _ in ("chosen", "rejected"):
            if lora and reference:
                with model.disable_adapter():
                    logits = model(input_ids=pair_ids, attention_mask=pair_mask).logits.float()
            elif ref is not None:
                logits = ref(input_ids=pair_ids, attention_mask=pair_mask).logits.float()
            else:
                break
            sequence_logprobs(logits, pair_ids, pair_response)
        logits = None
    reference_pass = rss("VmHWM:") - base - state
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset_peak()
    labels = ids.clone()
    labels[:, : max(1, seq_len // 8)] = -100  # the prompt: no log-probs
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # TRL's `accelerator.autocast()` around it
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    loss = -out.log_probs.sum() / labels.ne(-100).sum()
    del out
    if sdpo_rows:
        s_ids, s_mask, _ = rows_of(sdpo_rows, seq_len)
        t_ids, t_mask, _ = rows_of(sdpo_rows, seq_len)
        idx = torch.arange(seq_len - response_tokens, seq_len).repeat(sdpo_rows, 1)
        loss = loss + sdpo_loss(model, {"sdpo_student_ids": s_ids, "sdpo_student_attention_mask": s_mask,
                                        "sdpo_teacher_ids": t_ids, "sdpo_teacher_attention_mask": t_mask,
                                        "student_response_idx": idx, "teacher_response_idx": idx,
                                        "student_response_valid": torch.ones_like(idx, dtype=torch.bool)},
                                SdpoSettings(sdpo_jsd_beta=sdpo_beta))
    if dpo_pairs:
        c_ids, c_mask, c_resp = rows_of(dpo_pairs, seq_len)
        r_ids, r_mask, r_resp = rows_of(dpo_pairs, seq_len)
        loss = loss + dpo_loss(model, {"dpo_chosen_ids": c_ids, "dpo_chosen_attention_mask": c_mask,
                                       "dpo_chosen_response_mask": c_resp, "dpo_rejected_ids": r_ids,
                                       "dpo_rejected_attention_mask": r_mask, "dpo_rejected_response_mask": r_resp,
                                       "dpo_ref_chosen_logps": torch.zeros(dpo_pairs),
                                       "dpo_ref_rejected_logps": torch.zeros(dpo_pairs)}, DpoSettings())
    loss.backward()
    opt.step()
    peak = rss("VmHWM:") - base
    return {"state": state, "gradients": gradients, "peak": peak, "activations": peak - state - gradients,
            "reference_pass": reference_pass}
