"""A node's memory plan: the bytes it will hold on its device and in host RAM, computed before it joins a run.

The figures follow what this code allocates (read from it, then checked against measurements,
`measure_training_bytes` and ``tests/test_memory_plan.py``). With P the policy's parameters and T those that train
(T = P with full fine-tuning, the adapter tensors with ``[lora]``):

Device (the policy's device: a GPU, or host RAM for ``--device cpu``)
    weights      4 P   fp32 master weights; ``--dtype bf16`` (autocast) stores the frozen linear weights in bf16
                       (`composer_diloco.policy.precision`): with ``[lora]`` the base's, 4 P - 2 L_frozen
    gradients    4 T   fp32 ``.grad`` of every trainable tensor
    optimizer    8 T   torch AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32, like the parameters)
    reference    4 P   full fine-tuning with ``[loss] beta_dpo > 0``: the DPO reference is a frozen deep copy of the
                       policy (`composer_diloco.channels.dpo`), 4 P - 2 L under bf16 (L: the linear-only weights,
                       stored in bf16); ``[grpo] beta > 0`` adds TRL's own reference, another 4 P. With ``[lora]``
                       both are the base with adapters disabled: 0 bytes.
                       The SDPO teacher is the policy itself (no copy) in either mode.
    activations  the tensors autograd keeps for backward during one micro-batch (see `activation_bytes`).

Gradients and activations do not add up in full: backward frees a layer's activations as it creates its gradients,
and AdamW's step (``foreach=False``) runs after backward with every gradient plus two temporaries of one tensor. The
plan takes the step's peak as ``max(activations + gradients / 4, gradients + 8 * largest trainable tensor)``
(`MemoryPlan.training_peak`; measured on CPU within 5 % where the gradients dominate, e.g. Qwen3-0.6B's architecture
with full fine-tuning, and within 10 % where the activations do).

Host RAM (`composer_diloco.outer`: always CPU, fp32)
    theta 4 T + pseudo-gradient buffer 4 T + outer optimizer state (4 T per state tensor: SGD momentum 1, Adam 2,
    none for parameter averaging; ``compression = "sparse-2bit"`` adds 8 T: the error feedback and its next value,
    `composer_diloco.outer.sparse.ErrorFeedback`) + 8 T transient (a state download at join or resync: theta and the outer
    state pass through hivemind's averager process; the outer step itself copies nothing, `GlobalModel.outer_step`),
    plus the policy as loaded: ``from_pretrained`` builds it in fp32 on the CPU (4 P) before
    it moves to a GPU; on a CPU node that copy *is* the device's weights.

Activations (an approximation, calibrated on CPU by `measure_training_bytes`): per token of a micro-batch row,
``layers * (K_HIDDEN * hidden + K_Q * q_dim + K_KV * kv_dim + K_FFN * intermediate) * 4`` for the decoder layers
(``BF16_DECODER_SHARE`` of it under bf16 autocast) plus ``K_LOGITS * vocab * 4`` for the fp32 logits (the logits, their
temperature-scaled copy and their gradient). Gradient checkpointing keeps only each layer's input (``hidden * 4`` per
layer and token) plus one layer's full activations while it is recomputed. With ``[lora]`` the decoder's share is
``LORA_DECODER_SHARE`` of that. A micro-batch's rows are its ``--batch-size`` episodes, as many SDPO student rows
(``alpha_sdpo > 0``: at most one site row per episode is the bound used) and ``2 * ceil(max_sites * max_pairs_per_turn
/ grad_accum)`` DPO rows (``beta_dpo > 0``), each ``max_seq_len`` tokens long: an upper bound, since real episodes are
shorter. The rollout's KV cache (``2 * layers * kv_heads * head_dim * 4`` bytes per token) is freed before the
training pass and is far smaller, so it is not added.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from composer_diloco.config import LoraSection, RunConfig

__all__ = ["DEVICE_MEMORY_ENV", "DeviceMemoryError", "MemoryPlan", "ModelShape", "activation_bytes", "check_plan",
           "device_free_bytes", "measure_training_bytes", "model_shape", "plan_for_run", "plan_memory", "refusal"]

GB = 1e9
DEVICE_MEMORY_ENV = "COMPOSER_DILOCO_DEVICE_MEMORY_BYTES"
"""Caps the device bytes a node believes it has (e.g. to rehearse a 24 GB GPU on a bigger one, or in tests)."""

K_HIDDEN = 6
"""Hidden-sized tensors a Qwen3/Llama decoder layer keeps per token for backward: the two RMSNorms' inputs and
outputs, the residual sums (counted from the code, then checked on CPU by `measure_training_bytes`)."""
K_Q = 6
"""Query-sized (heads x head_dim) tensors per token: q, its norm, its rotation's inputs and output, the attention
output."""
K_KV = 6
"""Key/value-sized (kv_heads x head_dim) tensors per token: k with its norm and rotation, v."""
K_FFN = 4
"""Intermediate-sized tensors a SwiGLU MLP keeps per token: gate, up, SiLU(gate), their product."""
K_LOGITS = 3
"""Vocab-sized fp32 tensors alive per token at the logits: the logits, the temperature-scaled copy, their gradient."""
BF16_DECODER_SHARE = 0.8
"""Under bf16 autocast the decoder keeps about 80 % of fp32's activation bytes, not half: the residual stream and the
norms stay fp32 and autocast saves a bf16 copy of each linear layer's fp32 input for backward (measured on CPU
autocast, 0.75 to 0.87 over the embedded default and a 5.2M random model, full and LoRA; CUDA autocast casts the
same ops)."""
LORA_DECODER_SHARE = 0.65
"""With frozen base weights autograd keeps no input of a frozen linear layer for its weight gradient: the decoder's
activations shrink to about 65 % (measured 0.60 at 28 layers to 0.71 at 4 on CPU)."""


def _size(n: int | float) -> str:
    """``2.24 GB`` from 1 GB up, else ``3.6 MB``."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


class DeviceMemoryError(RuntimeError):
    """The plan does not fit the device: the message is one line naming the need, the free memory and what fits."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes the plan needs, read from a model config (built on the ``meta`` device: no memory, no download).

    Attributes:
        params_total: parameters of the policy, tied tensors once (P).
        params_trainable: parameters that train (T): all of them, or the LoRA adapters.
        layers, hidden, intermediate, vocab: the decoder's sizes.
        q_dim, kv_dim: heads x head_dim and kv_heads x head_dim (hidden and hidden when the config has no such field).
        largest_trainable: elements of the largest trainable tensor (the embedding with full fine-tuning).
        lora: whether ``params_trainable`` counts adapters.
        linear: elements of the weights only linear layers use (not a tied embedding): what a bf16 node stores in
            bf16 when they are frozen (`composer_diloco.policy.precision.bf16_linear_params`).
        frozen_linear: those of them frozen in this mode (the LoRA base's; 0 with full fine-tuning).
    """

    params_total: int
    params_trainable: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    q_dim: int = 0
    kv_dim: int = 0
    largest_trainable: int = 0
    lora: bool = False
    linear: int = 0
    frozen_linear: int = 0


_SHAPES: dict[tuple[str, str | None], ModelShape] = {}  # model_shape's results by (config JSON, [lora] JSON)


def model_shape(model_config: Any, lora: LoraSection | None = None) -> ModelShape:
    """Count a model's parameters from its ``transformers`` config, built on the ``meta`` device (and wrapped with
    peft's LoRA when ``lora`` is given, so the adapter count is peft's own).

    Building an 8B model on ``meta`` takes seconds, and a refusal plans several alternatives of one model, so the
    result is kept per (config, ``lora``) for the process.

    Args:
        model_config: a ``transformers.PretrainedConfig`` of a causal LM.
        lora: the run's ``[lora]`` section, or None for full fine-tuning.
    Raises:
        composer_diloco.policy.lora.LoraError: ``lora.target_modules`` matches no module.
    """
    key = (model_config.to_json_string(use_diff=False), None if lora is None else lora.model_dump_json())
    if key not in _SHAPES:
        _SHAPES[key] = _count_shape(model_config, lora)
    return _SHAPES[key]


def _count_shape(model_config: Any, lora: LoraSection | None) -> ModelShape:
    """`model_shape` without the cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from composer_diloco.policy.precision import bf16_linear_params

    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # no memory, and the caller's RNG untouched
        model = AutoModelForCausalLM.from_config(model_config)
        total = sum(p.numel() for p in model.parameters())
        trainable = total
        largest = max(p.numel() for p in model.parameters())
        linear = sum(p.numel() for p in bf16_linear_params(model, frozen_only=False))
        frozen_linear = 0
        if lora is not None:
            from composer_diloco.policy.lora import apply_lora

            model = apply_lora(model, lora)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            largest = max(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            frozen_linear = sum(p.numel() for p in bf16_linear_params(model))
    text = getattr(model_config, "text_config", None) or model_config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0))
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    return ModelShape(total, trainable, int(text.num_hidden_layers), hidden,
                      int(getattr(text, "intermediate_size", 4 * hidden)), int(text.vocab_size),
                      q_dim=heads * head_dim or hidden, kv_dim=kv_heads * head_dim or hidden, largest_trainable=largest,
                      lora=lora is not None, linear=linear, frozen_linear=frozen_linear)


def activation_bytes(shape: ModelShape, rows: int, seq_len: int, *, bf16: bool = False,
                     gradient_checkpointing: bool = False) -> int:
    """Estimated bytes autograd keeps for one forward/backward over ``rows`` x ``seq_len`` tokens (module docstring).

    Args:
        shape: the model's sizes.
        rows, seq_len: the micro-batch's rows and their padded length in tokens.
        bf16: bf16 autocast (the decoder's share is ``BF16_DECODER_SHARE`` of fp32's; the logits stay fp32).
        gradient_checkpointing: keep only each layer's input, recompute the rest in backward.
    """
    tokens = rows * seq_len
    q_dim, kv_dim = shape.q_dim or shape.hidden, shape.kv_dim or shape.hidden
    layer = (K_HIDDEN * shape.hidden + K_Q * q_dim + K_KV * kv_dim + K_FFN * shape.intermediate) * 4
    decoder = (shape.layers * shape.hidden * 4 + layer) if gradient_checkpointing else shape.layers * layer
    if shape.lora:
        decoder *= LORA_DECODER_SHARE
    if bf16:
        decoder *= BF16_DECODER_SHARE
    return int(tokens * (decoder + K_LOGITS * shape.vocab * 4))


@dataclass(frozen=True)
class MemoryPlan:
    """One node's memory plan, all figures in bytes (module docstring for the formulas).

    Attributes:
        shape: the model's sizes.
        device: where the policy trains (``cpu`` or ``cuda:N (name)``).
        micro_batch, grad_accum, seq_len: ``--batch-size``, ``--grad-accum``, the run's ``max_seq_len`` (tokens).
        bf16, gradient_checkpointing: the node's ``--dtype bf16`` and ``--gradient-checkpointing``.
        weights, gradients, optimizer, reference, activations: device bytes by item.
        step_transient: AdamW's temporaries at the optimizer step: two of the largest trainable tensor.
        host: host bytes of the outer loop (theta, pseudo-gradient, outer state, a state download's transients).
        host_model: host bytes of the policy as loaded (fp32, before it moves to a GPU; the device's own weights on
            a CPU node, already counted there).
        free: device bytes free when planned (None: unknown); for ``--device cpu`` the host's available RAM.
        free_source: where ``free`` came from (``torch.cuda.mem_get_info``, ``/proc/meminfo``, the env cap ...).
    """

    shape: ModelShape
    device: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    rows: int
    bf16: bool
    gradient_checkpointing: bool
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    step_transient: int
    host: int
    host_model: int
    free: int | None = None
    free_source: str = ""

    @property
    def on_cpu(self) -> bool:
        """True when the device is the host (one pool of RAM for everything)."""
        return self.device.startswith("cpu")

    @property
    def device_bytes(self) -> int:
        """Bytes the training state and one micro-batch's activations need on the device."""
        return self.weights + self.optimizer + self.reference + self.training_peak

    @property
    def training_peak(self) -> int:
        """Bytes of one step's peak over the persistent state: ``max(activations + gradients / 4, gradients +
        step_transient)``. Backward frees a layer's activations as it creates its gradients, so the two never
        add up in full (measured: a quarter of the gradients or less on top of the activations); AdamW's step
        (``foreach=False``) holds every gradient plus two temporaries of one tensor."""
        return max(self.activations + self.gradients // 4, self.gradients + self.step_transient)

    @property
    def need(self) -> int:
        """Bytes that must fit in ``free``: the device bytes, plus the host bytes on a CPU node (same RAM)."""
        return self.device_bytes + (self.host if self.on_cpu else 0)

    @property
    def host_bytes(self) -> int:
        """Host RAM at its peak: the outer loop's buffers, plus the model as loaded (GPU node) or the device bytes
        (CPU node)."""
        return self.host + (self.device_bytes if self.on_cpu else self.host_model)

    def fits(self) -> bool:
        """True when ``free`` is unknown or at least `need`."""
        return self.free is None or self.need <= self.free

    def describe(self) -> str:
        """One log line with every figure, e.g. ``memory plan on cuda:0: 12.3 GB device = weights 2.4 + ...``."""
        mode = f"LoRA ({self.shape.params_trainable:,} of {self.shape.params_total:,} parameters train)" \
            if self.shape.lora else f"full fine-tuning ({self.shape.params_total:,} parameters)"
        free = "free unknown" if self.free is None else f"{_size(self.free)} free ({self.free_source})"
        return (f"memory plan on {self.device}, {mode}: device {_size(self.device_bytes)} = weights "
                f"{_size(self.weights)} + AdamW {_size(self.optimizer)} + reference {_size(self.reference)} + step "
                f"peak {_size(self.training_peak)} (gradients {_size(self.gradients)}, activations "
                f"{_size(self.activations)} for {self.rows} rows x "
                f"{self.seq_len} tokens, micro-batch {self.micro_batch}, "
                f"{'bf16' if self.bf16 else 'fp32'}{', gradient checkpointing' if self.gradient_checkpointing else ''})"
                f"; host {_size(self.host_bytes)} (outer loop {_size(self.host)}); {free}")


def _rows(micro_batch: int, grad_accum: int, *, sdpo: bool, dpo_pairs: int) -> int:
    return micro_batch * (2 if sdpo else 1) + (2 * math.ceil(dpo_pairs / grad_accum) if dpo_pairs else 0)


def plan_memory(shape: ModelShape, *, micro_batch: int, grad_accum: int = 1, seq_len: int, device: str = "cpu",
                bf16: bool = False, gradient_checkpointing: bool = False, sdpo: bool = True, dpo_pairs: int = 0,
                dpo_reference: bool = True, grpo_reference: bool = False, outer_state_tensors: int = 1,
                free: int | None = None, free_source: str = "") -> MemoryPlan:
    """The plan for one node (module docstring for each formula).

    Args:
        shape: the model's sizes (`model_shape`).
        micro_batch: episodes per forward/backward (``--batch-size``); grad_accum: micro-batches per step.
        seq_len: tokens per row (the run's ``max_seq_len``).
        device: the device's name, for the log; ``cpu...`` makes host and device one pool.
        bf16, gradient_checkpointing: the node's precision and checkpointing.
        sdpo: SDPO is on (adds up to one student row per episode); dpo_pairs: DPO pairs per step at most (0: off).
        dpo_reference: DPO keeps a reference policy (full fine-tuning: a copy; LoRA: none).
        grpo_reference: TRL keeps a GRPO KL reference (``[grpo] beta > 0``; full fine-tuning: another copy).
        outer_state_tensors: tensors of theta's size the outer optimizer keeps (SGD momentum 1, Adam 2, averaging 0).
        free, free_source: the device's free bytes and where they came from (`device_free_bytes`).
    Raises:
        ValueError: a non-positive micro_batch, grad_accum or seq_len.
    """
    if micro_batch < 1 or grad_accum < 1 or seq_len < 1:
        raise ValueError(f"micro_batch {micro_batch}, grad_accum {grad_accum}, seq_len {seq_len}: expected >= 1")
    p, t = shape.params_total, shape.params_trainable
    # bf16 (`composer_diloco.policy.precision`): frozen linear weights take 2 bytes, the LoRA base's and the DPO
    # reference copy's; TRL's own GRPO reference is loaded by TRL (4 P)
    weights = 4 * p - (2 * shape.frozen_linear if bf16 else 0)
    dpo_copy = 0 if shape.lora or not dpo_reference else 4 * p - (2 * shape.linear if bf16 else 0)
    grpo_copy = 0 if shape.lora or not grpo_reference else 4 * p
    rows = _rows(micro_batch, grad_accum, sdpo=sdpo, dpo_pairs=dpo_pairs)
    return MemoryPlan(
        shape=shape, device=device, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len, rows=rows,
        bf16=bf16, gradient_checkpointing=gradient_checkpointing,
        weights=weights, gradients=4 * t, optimizer=8 * t, reference=dpo_copy + grpo_copy,
        activations=activation_bytes(shape, rows, seq_len, bf16=bf16, gradient_checkpointing=gradient_checkpointing),
        step_transient=2 * 4 * shape.largest_trainable,
        host=4 * t * (2 + outer_state_tensors + 2), host_model=4 * p, free=free, free_source=free_source)


def _outer_state_tensors(config: RunConfig) -> int:
    """Theta-sized tensors of the run's outer optimizer state, counted on the optimizer itself (any torch.optim class
    or dotted path: `composer_diloco.outer.global_model.state_tensors_per_parameter`)."""
    from composer_diloco.outer.global_model import optimizer_factory, state_tensors_per_parameter

    return state_tensors_per_parameter(optimizer_factory(config.outer))


def plan_for_run(config: RunConfig, model_config: Any, *, micro_batch: int, grad_accum: int, device: str,
                 bf16: bool, gradient_checkpointing: bool, free: int | None, free_source: str = "",
                 lora: LoraSection | None | bool = True) -> MemoryPlan:
    """`plan_memory` for a run config and a model config (what a node knows before it builds the model).

    Args:
        lora: True = the run's own ``[lora]``; a `LoraSection` or None to plan another choice (the refusal's hints).
    """
    section = config.lora if lora is True else (lora or None)
    shape = model_shape(model_config, section)
    pref = config.preference
    return plan_memory(
        shape, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=config.max_seq_len, device=device, bf16=bf16,
        gradient_checkpointing=gradient_checkpointing, sdpo=config.loss.alpha_sdpo > 0,
        dpo_pairs=pref.max_sites * pref.max_pairs_per_turn if config.loss.beta_dpo > 0 else 0,
        dpo_reference=config.loss.beta_dpo > 0, grpo_reference=config.grpo.beta > 0,
        outer_state_tensors=_outer_state_tensors(config) + (2 if config.compression == "sparse-2bit" else 0),
        free=free, free_source=free_source)


def refusal(plan: MemoryPlan, alternatives: list[tuple[str, MemoryPlan]]) -> str:
    """The one-line refusal: the need by item, the free memory, and the alternatives that would fit.

    Args:
        plan: the plan that does not fit.
        alternatives: ``(option text, plan)`` pairs; those whose plan fits are named with their need.
    """
    fitting = [f"{text} ({_size(alt.need)})" for text, alt in alternatives if alt.fits()]
    hint = ("would fit: " + "; ".join(fitting)) if fitting else \
        "nothing tried fits (--batch-size 1 with --gradient-checkpointing and [lora] r = 16 included): use a " \
        "device with more memory or a smaller model"
    where = "host RAM" if plan.on_cpu else "device memory"
    return (f"not enough {where} on {plan.device}: the memory plan needs {_size(plan.need)} (weights "
            f"{_size(plan.weights)} + AdamW {_size(plan.optimizer)} + reference {_size(plan.reference)} + step peak "
            f"{_size(plan.training_peak)} (gradients {_size(plan.gradients)}, activations {_size(plan.activations)} at "
            f"--batch-size {plan.micro_batch} x {plan.seq_len} tokens)"
            f"{' + outer loop ' + _size(plan.host) if plan.on_cpu else ''}), "
            f"{_size(plan.free)} free ({plan.free_source}); {hint}")


def check_plan(config: RunConfig, model_config: Any, *, micro_batch: int, grad_accum: int, device: str, bf16: bool,
               gradient_checkpointing: bool, free: int | None, free_source: str = "",
               host_free: int | None = None) -> MemoryPlan:
    """Plan the node's memory and refuse, before it joins, a plan that does not fit ``free``.

    Args:
        config: the run config; model_config: its policy's ``transformers`` config.
        micro_batch, grad_accum: the node's batch (`nodes.device.NodeBatch`).
        device, bf16, gradient_checkpointing, free, free_source: as `plan_for_run`.
        host_free: available host RAM of a GPU node (None: not checked); a CPU node's ``free`` is its host RAM.
    Returns:
        the plan (it fits, or ``free`` is unknown).
    Raises:
        DeviceMemoryError: one line (`refusal`) naming the need, the free bytes, and which of a smaller
            ``--batch-size`` (with ``--grad-accum`` keeping the episodes per step), ``--gradient-checkpointing`` and
            ``[lora] r = 16`` would fit; or, on a GPU node, one line naming the host bytes (the outer loop's fp32
            buffers and the model as loaded) and the available host RAM.
    """
    kw = dict(device=device, bf16=bf16, free=free, free_source=free_source)
    plan = plan_for_run(config, model_config, micro_batch=micro_batch, grad_accum=grad_accum,
                        gradient_checkpointing=gradient_checkpointing, **kw)
    if not plan.on_cpu and host_free is not None and plan.host_bytes > host_free:
        raise DeviceMemoryError(
            f"not enough host RAM beside {plan.device}: the memory plan needs {_size(plan.host_bytes)} on the host "
            f"(the model as loaded {_size(plan.host_model)} + the outer loop's fp32 theta, pseudo-gradient and "
            f"optimizer state {_size(plan.host)}), {_size(host_free)} available; [lora] shrinks the outer loop to the "
            "adapters' size")
    if plan.fits():
        return plan
    episodes = micro_batch * grad_accum
    alternatives = []
    for b in range(micro_batch - 1, 0, -1):  # the largest smaller micro-batch that keeps whole steps
        if episodes % b == 0:
            alt = plan_for_run(config, model_config, micro_batch=b, grad_accum=episodes // b,
                               gradient_checkpointing=gradient_checkpointing, **kw)
            if alt.fits():
                alternatives.append((f"--batch-size {b} --grad-accum {episodes // b}", alt))
                break
    if not gradient_checkpointing:
        alternatives.append(("--gradient-checkpointing", plan_for_run(
            config, model_config, micro_batch=micro_batch, grad_accum=grad_accum, gradient_checkpointing=True, **kw)))
    from composer_diloco.config import LoraSection

    lora_16 = LoraSection(r=16, lora_alpha=32, target_modules="all-linear")
    if config.lora is None:
        alternatives.append(("[lora] r = 16 (all-linear)", plan_for_run(
            config, model_config, micro_batch=micro_batch, grad_accum=grad_accum,
            gradient_checkpointing=gradient_checkpointing, lora=lora_16, **kw)))
    if not any(a.fits() for _, a in alternatives):  # the most frugal combination, as the last resort
        alt = plan_for_run(config, model_config, micro_batch=1, grad_accum=episodes, gradient_checkpointing=True,
                           lora=config.lora or lora_16, **kw)
        alternatives.append((f"--batch-size 1 --grad-accum {episodes} --gradient-checkpointing"
                             f"{' with [lora] r = 16' if config.lora is None else ''}", alt))
    raise DeviceMemoryError(refusal(plan, alternatives))


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_free_bytes(device: str) -> tuple[int | None, str]:
    """Free bytes on the node's device, and where the figure came from.

    ``$COMPOSER_DILOCO_DEVICE_MEMORY_BYTES`` (an integer) caps it (simulates a smaller device); otherwise CUDA:
    ``torch.cuda.mem_get_info()[0]`` of the current device; CPU: the host's available RAM (psutil's
    ``virtual_memory().available``, else ``MemAvailable`` of ``/proc/meminfo``; None when neither is readable).

    Raises:
        ValueError: the environment variable is not a positive integer (one line naming its value).
    """
    cap_text = os.environ.get(DEVICE_MEMORY_ENV, "").strip()
    cap = None
    if cap_text:
        try:
            cap = int(float(cap_text))  # "24000000000" or "24e9"
        except ValueError:
            cap = 0
        if cap <= 0:
            raise ValueError(f"${DEVICE_MEMORY_ENV}={cap_text!r}: expected a positive number of bytes")
    free, source = None, ""
    if device.startswith("cuda"):
        import torch

        free, source = int(torch.cuda.mem_get_info()[0]), "torch.cuda.mem_get_info"
    else:
        try:
            import psutil

            free, source = int(psutil.virtual_memory().available), "available host RAM (psutil)"
        except ImportError:
            free, source = _meminfo_available(), "available host RAM (/proc/meminfo)"
    if cap is not None and (free is None or cap < free):
        return cap, f"capped by ${DEVICE_MEMORY_ENV}"
    return free, source


def measure_training_bytes(model: Any, *, rows: int, seq_len: int, reference: bool, lora: bool = False,
                           gradient_checkpointing: bool = False, temperature: float = 1.0,
                           bf16: bool = False) -> dict[str, int]:
    """Measure on CPU what one inner step of ``model`` allocates: the peak resident-set growth (``VmHWM`` after
    resetting it through ``/proc/self/clear_refs``) over the state built here and one forward/backward + AdamW step.

    Run it in a fresh process started with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every tensor of 64 KiB or
    more on its own and returns it at free, so the resident set follows the allocations). A forward/backward over 16
    tokens runs before the baseline, so what a process allocates once, on its first forward/backward (~9 MB on a Xeon;
    ~14 MB more on one CI machine's CPU), is not counted as the step's. The pass is a proxy of the
    GRPO loss (logits of ``rows`` x ``seq_len`` random tokens divided by the temperature, TRL's
    ``selective_log_softmax``, a masked mean), with the DPO reference's no-grad forward first.

    Args:
        model: the policy (fp32, CPU), with adapters already applied when ``lora``.
        rows, seq_len: the micro-batch (token ids ``(rows, seq_len)`` long).
        reference: build the DPO reference (a frozen deep copy; with ``lora`` the policy with adapters disabled).
        lora: the model is a ``peft.PeftModel``.
        gradient_checkpointing: ``model.gradient_checkpointing_enable()`` first.
        temperature: the sampling temperature the logits are divided by.
        bf16: as a ``--dtype bf16`` node: frozen linear weights (a LoRA base, the reference copy) stored in bf16 and
            every forward under CPU bf16 autocast (`composer_diloco.policy.precision`).
    Returns:
        ``{"state": measured bytes of the AdamW moments and the reference copy; "peak": measured peak bytes over the
        whole step (state, the gradients backward creates, activations, transients); "gradients": the trainable
        parameters' bytes (computed, as ``zero_grad(set_to_none=True)`` leaves them to backward); "activations":
        peak - state - gradients}``, each relative to the resident set when the call starts (the weights, faulted in
        first, are not counted).
    """
    import copy
    import ctypes

    import torch
    from trl.trainer.utils import selective_log_softmax

    def rss(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {field}")

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
    gradients = sum(p.numel() * p.element_size() for p in params)
    with torch.no_grad():  # the reference's log-probs (the DPO collator computes them before the loss)
        if lora and reference:
            with model.disable_adapter():
                model(input_ids=ids[:1], attention_mask=mask[:1])
        elif ref is not None:
            ref(input_ids=ids[:1], attention_mask=mask[:1])
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature  # fp32 as accelerate returns it
    logps = selective_log_softmax(logits[:, :-1], ids[:, 1:])
    loss = -logps.mean()
    del logits, logps
    loss.backward()
    opt.step()
    peak = rss("VmHWM:") - base
    return {"state": state, "gradients": gradients, "peak": peak, "activations": peak - state - gradients}

