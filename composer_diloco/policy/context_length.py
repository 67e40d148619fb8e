"""The run's ``max_seq_len`` against the positions the policy was built for, checked before any network."""

from __future__ import annotations

from typing import Any

from composer_diloco.config import ConfigError

__all__ = ["check_context_length", "model_positions"]

_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""``transformers`` config fields that name a model's context, in the order they are looked up (Llama/Qwen/Mistral,
GPT-2, a few others)."""


def model_positions(model_config: Any) -> int | None:
    """The context, in tokens, a ``transformers`` model config declares (``max_position_embeddings`` or the first of
    `_POSITION_FIELDS` it has); None when it declares none (such a model is not checked)."""
    text_config = getattr(model_config, "text_config", None)  # multimodal configs nest the language model's
    for config in (model_config, text_config):
        for field in _POSITION_FIELDS:
            value = getattr(config, field, None) if config is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def check_context_length(max_seq_len: int, model_config: Any, model: str | None) -> None:
    """Refuse a run whose episodes may be longer than the policy's context.

    An episode (prompt + completion, ``max_seq_len`` tokens) past the model's positions runs on positions it never
    saw (RoPE) or fails (learned position tables). Called by the coordinator after it loads the policy, and by a
    node with its memory plan, both before the DHT.

    Args:
        max_seq_len: the run's ``max_seq_len`` (tokens).
        model_config: the policy's ``transformers`` config.
        model: ``--model`` as given (None: the embedded default), for the message.

    Raises:
        ConfigError: one line naming both lengths and the fix.
    """
    positions = model_positions(model_config)
    if positions is not None and max_seq_len > positions:
        name = "the embedded default" if model is None else repr(model)
        raise ConfigError(f"max_seq_len = {max_seq_len} tokens is longer than the {positions} positions of "
                          f"{name} (max_position_embeddings): set max_seq_len <= {positions}")
