"""The embedded default policy's architecture: a ~0.9M-parameter ``Qwen3ForCausalLM`` sized for CPU warm starts."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

__all__ = ["build_tiny_model", "tiny_model_config"]


def tiny_model_config(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **overrides: Any) -> Qwen3Config:
    """Config of the embedded default policy: a ~0.9M-parameter Qwen3 sized for CPU warm starts.

    Hidden 128, 4 layers, 4 attention heads of 32, 2 key/value heads (GQA), SwiGLU 384, tied
    embeddings, RoPE theta 10000, 2048 positions (tokens; coding episodes reach ~1,150), fp32. ``seed`` is recorded as
    ``config.init_seed`` (provenance only; :func:`build_tiny_model` seeds the initialisation).

    Args:
        tokenizer: gives the vocabulary size and the pad/eos ids.
        seed: the initialisation seed to record.
        **overrides: any ``Qwen3Config`` field, e.g. ``hidden_size=192``.

    Returns:
        The config (``vocab_size = len(tokenizer)``).

    Raises:
        TypeError / ValueError: from ``Qwen3Config`` on an invalid override.
    """
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
        init_seed=seed,
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int, **overrides: Any) -> PreTrainedModel:
    """A freshly initialised ``Qwen3ForCausalLM`` from :func:`tiny_model_config`, fp32 on CPU.

    Initialisation runs under ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng``, so the same
    seed gives the same weights and the caller's global RNG is left untouched.

    Args:
        tokenizer: gives the vocabulary size and the pad/eos ids (also set on ``generation_config``).
        seed: the initialisation seed.
        **overrides: any ``Qwen3Config`` field (see :func:`tiny_model_config`).

    Returns:
        The model (fp32, CPU, training mode as ``from_config`` leaves it); logits are ``(B, T, len(tokenizer))``.
    """
    config = tiny_model_config(tokenizer, seed, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model.to("cpu")
