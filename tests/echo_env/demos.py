"""Scripted demonstrations of the echo env, its scripted teacher and its reason hints (the env contract's
``demos`` entries, see ``composer_diloco.rollout.env_package``)."""

from __future__ import annotations

import random
from typing import Any

from envs.demonstration import Demonstration

from .tasks import TOOL_SCHEMAS, WORDS, execute, question_of, word_of

__all__ = ["ERROR_RATE", "REASON_HINTS", "demonstration", "script"]

ERROR_RATE = 0.5
"""Default fraction of demonstrations that first echo a wrong word, then the right one."""

REASON_HINTS = {"wrong_word": "You echoed '{said}'; echo exactly the word the question names."}
"""Hint templates by ``error_meta["reason"]`` (filled from ``error_meta``)."""


def demonstration(seed: int, index: int, error_rate: float = ERROR_RATE) -> Demonstration:
    """Episode ``index`` of the scripted solver under ``seed``; a pure function of its arguments.

    Raises:
        ValueError: if ``error_rate`` is outside [0, 1].
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    episode = f"warmstart-{index}"
    word = word_of(seed, episode)
    rng = random.Random(f"{seed}:{episode}:solver")
    calls: list[tuple[str, dict[str, Any]]] = [("echo", {"text": word})]
    if rng.random() < error_rate:
        calls.insert(0, ("echo", {"text": rng.choice([w for w in WORDS if w != word])}))
    outcomes = [execute(word, tool, args) for tool, args in calls]
    return Demonstration(question_of(seed, episode), TOOL_SCHEMAS, calls, [o[0] for o in outcomes],
                         [o[1] is None for o in outcomes])


def script(seed: int, episode_id: str, question: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The solver's call for episode ``(seed, episode_id)``, or None when ``question`` is not that episode's."""
    if question != question_of(seed, episode_id):
        return None
    return [("echo", {"text": word_of(seed, episode_id)})]
