"""The policy subsystem's exception type."""

from __future__ import annotations

__all__ = ["PolicyLoadError"]


class PolicyLoadError(RuntimeError):
    """A policy (model, tokenizer or warm-start data) named by the user could not be loaded; the one-line message
    names it and says what to do."""
