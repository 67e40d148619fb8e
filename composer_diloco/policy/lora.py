"""LoRA DiLoCo: the policy wrapped with Hugging Face ``peft`` adapters (Hu et al., "LoRA", arXiv 2106.09685).

With a ``[lora]`` section in the run config (`composer_diloco.config.LoraSection`) every peer loads the same base
weights, wraps them with ``peft.get_peft_model(model, LoraConfig(...))`` (`apply_lora`), and from then on only the
adapter tensors require a gradient. Everything DiLoCo moves is built from the parameters that require a gradient
(`composer_diloco.outer.global_model.GlobalModel`), so theta, the pseudo-gradient, the all-reduce, the outer step,
the state a late joiner downloads and ``global_sha256`` cover the adapters only; the base weights never change.

Because the base is not part of theta, every peer must hold the same base: `base_sha256` hashes it, the peers publish
it with their state (`composer_diloco.outer.peer.DiLoCoPeer`) and a peer whose base differs is refused at join.

A LoRA checkpoint folder is a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``):
``PeftModel.from_pretrained(base, folder)`` loads it, `load_adapters` resumes a run from it, and `merge_adapters`
(``python -m composer_diloco.policy merge-lora``) writes base + adapters as one ``save_pretrained`` model
(``merge_and_unload``).

The DPO reference of a LoRA run is the policy with its adapters disabled (`AdaptersDisabled`): the base, no copy.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from composer_diloco.policy.errors import PolicyLoadError

if TYPE_CHECKING:
    from composer_diloco.config import LoraSection

__all__ = ["AdaptersDisabled", "LoraError", "apply_lora", "base_sha256", "is_lora", "load_adapters",
           "merge_adapters"]

ADAPTER_FILE = "adapter_model.safetensors"


class LoraError(PolicyLoadError):
    """A ``[lora]`` section that does not fit the model, or an adapter folder that does not fit the run (one line)."""


def is_lora(model: Any) -> bool:
    """True when ``model`` is a ``peft.PeftModel`` (False without importing peft when it was never imported)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _is_adapter(name: str) -> bool:
    return "lora_" in name  # lora_A, lora_B, lora_embedding_A/B, lora_magnitude_vector (peft's LoRA tensor names)


def base_sha256(model: nn.Module) -> str:
    """SHA-256 (hex) of a policy's base weights: the fp32 little-endian bytes of every parameter that is not a LoRA
    adapter tensor, in ``named_parameters`` order (a tied tensor once). The same value for a plain model and for the
    same model wrapped by `apply_lora` (peft keeps each adapted layer's weight in place as ``base_layer``).

    Args:
        model: a ``transformers`` model or a ``peft.PeftModel`` on any device and dtype (hashed as fp32 on CPU).
    """
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not _is_adapter(name):
                h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _linear_names(model: nn.Module) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})


def apply_lora(model: nn.Module, section: LoraSection) -> nn.Module:
    """Wrap ``model`` with LoRA adapters: ``peft.get_peft_model(model, LoraConfig(r, lora_alpha, lora_dropout,
    target_modules, task_type="CAUSAL_LM"))`` (peft). The base weights are frozen, the adapters (``lora_A`` (r, in)
    Kaiming-uniform, ``lora_B`` (out, r) zeros, fp32 like the base) are the only trainable parameters, so the wrapped
    model computes exactly what ``model`` did. peft's init draws from torch's global RNG: peers that wrap the same
    base under the same seed get the same adapters (and a joiner adopts the run's theta anyway).

    Args:
        model: a causal LM (``transformers.PreTrainedModel``), its base weights already loaded or warm-started.
        section: the run config's ``[lora]`` section.
    Returns:
        the ``peft.PeftModel`` (train/eval mode as ``model``).
    Raises:
        LoraError: ``target_modules`` (or one entry of a list) matches no module of the model (one line naming it
            and the model's linear layer names).
    """
    from peft import LoraConfig, get_peft_model

    if isinstance(section.target_modules, list):  # peft refuses only a list of which no entry matches: name each typo
        names = [n for n, _ in model.named_modules()]
        for key in section.target_modules:
            if not any(n == key or n.endswith(f".{key}") for n in names):
                raise LoraError(f"[lora] target_modules entry {key!r} matches no module of the model (its linear "
                                f"layers are named {', '.join(_linear_names(model))})")
    config = LoraConfig(r=section.r, lora_alpha=section.lora_alpha, lora_dropout=section.lora_dropout,
                        target_modules=section.target_modules, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise LoraError(f"[lora] target_modules={section.target_modules!r} does not fit the model "
                        f"({str(e).splitlines()[0]}); its linear layers are named "
                        f"{', '.join(_linear_names(model))}") from None


def load_adapters(model: nn.Module, folder: str | Path) -> None:
    """Load a PEFT adapter folder's ``adapter_model.safetensors`` into ``model``'s adapters (to resume a run).

    The run config's ``[lora]`` built ``model`` (`apply_lora`); the folder must hold exactly its adapter tensors
    with their shapes (peft's ``set_peft_model_state_dict``).

    Raises:
        LoraError: no adapter file, or adapter tensors missing, extra or of another shape than the run's ``[lora]``.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_FILE
    if not path.is_file():
        raise LoraError(f"checkpoint {str(folder)!r} holds no {ADAPTER_FILE} (expected a PEFT adapter folder, the "
                        "checkpoint of a [lora] run)")
    saved = load_file(str(path))
    ours = {n: p for n, p in model.named_parameters() if p.requires_grad}
    want = sum(1 for _ in ours)
    if len(saved) != want:
        raise LoraError(f"checkpoint {str(folder)!r} holds {len(saved)} adapter tensors, the run's [lora] has {want}")
    try:
        result = set_peft_model_state_dict(model, saved)
    except RuntimeError as e:  # a shape mismatch (another r)
        raise LoraError(f"checkpoint {str(folder)!r} does not fit the run's [lora]: {str(e).splitlines()[0]}") from None
    missing = [k for k in result.missing_keys if _is_adapter(k)]
    if missing or result.unexpected_keys:
        bad = (missing or result.unexpected_keys)[0]
        raise LoraError(f"checkpoint {str(folder)!r} does not fit the run's [lora]: tensor {bad!r} "
                        f"{'missing' if missing else 'unexpected'}")


class AdaptersDisabled:
    """The reference policy of a LoRA run: calling it runs ``policy`` inside ``policy.disable_adapter()`` (peft) and
    without gradients, i.e. the base model, with no copy of any weight.

    Args:
        policy: the ``peft.PeftModel`` being trained.

    Calling it takes the policy's keyword arguments (``input_ids`` (B, L) long, ``attention_mask`` (B, L)) and
    returns its output (``.logits`` (B, L, V) in the policy's dtype). `parameters` yields the policy's (their device
    is the reference's device).
    """

    def __init__(self, policy: nn.Module):
        self.policy = policy

    def parameters(self):
        """The policy's parameters (the reference holds none of its own)."""
        return self.policy.parameters()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def merge_adapters(base: nn.Module, adapter_dir: str | Path, out_dir: str | Path) -> nn.Module:
    """``PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()`` saved with ``save_pretrained(out_dir)``
    (peft): W <- W + (lora_alpha / r) * B @ A in every adapted layer; the result is a plain ``transformers`` model.

    Args:
        base: the run's base model (fp32), e.g. from ``load_policy``.
        adapter_dir: a PEFT adapter folder (a LoRA run's checkpoint).
        out_dir: written (created) with the merged model's ``save_pretrained`` files.
    Returns:
        the merged model.
    Raises:
        LoraError: ``adapter_dir`` is not a PEFT adapter folder.
    """
    from peft import PeftModel

    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise LoraError(f"{str(adapter_dir)!r} is not a PEFT adapter folder (no adapter_config.json): expected the "
                        "checkpoint of a [lora] run")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir)
    return merged
