"""bf16 where it is safe: frozen linear weights stored in bf16, every forward of the policy under bf16 autocast.

A node started with ``--dtype bf16`` trains under mixed precision (Micikevicius et al., "Mixed Precision Training",
arXiv 1710.03740): the weights that train, their gradients and AdamW's moments stay fp32, so no small update is lost
to bf16's 8-bit mantissa; matmuls run in bf16 through ``torch.autocast``. Under autocast every ``nn.Linear`` casts
its fp32 weight to bf16 (round to nearest even) before its matmul, so a *frozen* linear weight stored in bf16 gives
bit-identical outputs at half the bytes. `frozen_linears_to_bf16` stores exactly those in bf16:

* ``[lora]``: the base model's linear layers (peft's ``base_layer`` weights, and an untied ``lm_head``): 2 bytes per
  parameter instead of 4, about half the device's weights;
* full fine-tuning: the DPO reference copy (`composer_diloco.channels.dpo`), whose weights never train.

What stays fp32: every trainable tensor (LoRA adapters; all weights under full fine-tuning), embeddings (an
``nn.Embedding`` lookup is not autocast, so bf16 storage would change its output; a tied ``lm_head`` shares it), and
norms and biases (tiny). `autocast_forward` wraps the model's ``forward`` in ``torch.autocast`` as accelerate's
``prepare_model`` does for the Trainer, so a bf16 weight also meets bf16 inputs in every forward made outside the
Trainer: the rollouts' ``generate``, the SDPO teacher, the DPO reference, evaluations.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["autocast_forward", "bf16_linear_params", "frozen_linears_to_bf16", "is_autocast"]

_WRAPPED = "_composer_autocast"


def _owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Every parameter's owning modules (a tied tensor has several), keyed by ``id(parameter)``."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return owners


def bf16_linear_params(model: nn.Module, *, frozen_only: bool = True) -> list[nn.Parameter]:
    """The parameters safe to store in bf16 under autocast: 2-D weights whose every owner is an ``nn.Linear``
    (so not a tied embedding), frozen ones only unless ``frozen_only`` is False (to count them on a ``meta`` model
    before the run's ``requires_grad`` is known).

    Args:
        model: any module (a ``transformers`` model, a ``peft.PeftModel``), on any device, ``meta`` included.
    Returns:
        the parameters, each once, in ``model.parameters()`` order.
    """
    owners = _owners(model)
    return [p for p in model.parameters()
            if p.dim() == 2 and p.is_floating_point() and (not frozen_only or not p.requires_grad)
            and all(isinstance(m, nn.Linear) for m in owners[id(p)])]


@torch.no_grad()
def frozen_linears_to_bf16(model: nn.Module) -> int:
    """Store every frozen linear weight of ``model`` in bf16, in place (`bf16_linear_params`).

    Under bf16 autocast (`autocast_forward`) the model computes bit-identical outputs, since autocast rounds a linear
    layer's fp32 weight to bf16 for every matmul anyway. Without autocast a bf16 weight meets fp32 inputs and
    ``F.linear`` raises a dtype mismatch: call `autocast_forward` too.

    Returns:
        bytes freed (2 per cast parameter element).
    """
    freed = 0
    for p in bf16_linear_params(model):
        if p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)
            freed += 2 * p.numel()
    return freed


def autocast_forward(model: nn.Module, device_type: str) -> nn.Module:
    """Run every forward of ``model`` under ``torch.autocast(device_type, dtype=torch.bfloat16)`` (idempotent): its
    ``transformers`` model's ``forward`` is wrapped (the base model's, for a ``peft.PeftModel``), which ``__call__``,
    ``generate`` and peft's own forward all reach.

    The same wrapping accelerate's ``Accelerator.prepare_model`` applies for ``mixed_precision="bf16"``, here done
    once at placement so that forwards outside the Trainer (``generate``, references, evaluations) run under it too.
    A ``copy.deepcopy`` of the model keeps the wrapper (the bound method is rebound to the copy).

    Args:
        model: the policy; device_type: ``"cuda"`` or ``"cpu"`` (CPU autocast rehearses a GPU run's precision).
    Returns:
        ``model`` (wrapped in place).
    """
    if is_autocast(model):
        return model
    inner = _innermost(model)
    forward = inner.forward.__func__ if hasattr(inner.forward, "__func__") else inner.forward

    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return forward(self, *args, **kwargs)

    setattr(wrapped, _WRAPPED, device_type)
    inner.forward = wrapped.__get__(inner, type(inner))
    return model


def _innermost(model: nn.Module) -> nn.Module:
    """The ``transformers`` model itself: a ``peft.PeftModel``'s ``forward`` and ``generate`` both end in its base
    model's ``forward`` (``PeftModel.generate`` never calls ``PeftModel.forward``), so that is the one to wrap."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_autocast(model: nn.Module) -> bool:
    """True when `autocast_forward` wrapped ``model``'s forward (a deep copy of such a model included)."""
    forward = getattr(_innermost(model), "forward", None)
    return getattr(getattr(forward, "__func__", forward), _WRAPPED, None) is not None
