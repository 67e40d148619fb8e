"""Scripted demonstrations of tool_env: the warm-start data of the embedded default policy.

Episode ``index`` is ``make_task(seed, f"warmstart-{index}")`` played by `solve` with a private RNG; a fraction
``error_rate`` of episodes hold one failed call (unknown tool, invalid arguments, unknown item) and its recovery.
"""

from __future__ import annotations

import random
from typing import Any

from envs.demonstration import Demonstration

from .tasks import TOOL_SCHEMAS, execute, make_task, solve

__all__ = ["ERROR_RATE", "demonstration", "script"]

ERROR_RATE = 0.3
"""Default fraction of demonstrations with one failed call and its recovery."""


def demonstration(seed: int, index: int, error_rate: float = ERROR_RATE) -> Demonstration:
    """Episode ``index`` of the scripted solver under ``seed``; a pure function of its arguments.

    Raises:
        ValueError: if ``error_rate`` is outside [0, 1].
    """
    episode = f"warmstart-{index}"
    task = make_task(seed, episode)
    calls = solve(task, random.Random(f"{seed}:{episode}"), error_rate)
    outcomes = [execute(task, name, args) for name, args in calls]
    return Demonstration(task.question, TOOL_SCHEMAS, calls, [o[0] for o in outcomes],
                         [o[1] is None for o in outcomes], [None if o[1] is None else (o[1], o[2]) for o in outcomes])


def script(seed: int, episode_id: str, question: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The scripted solver's error-free calls for episode ``(seed, episode_id)``, or None when ``question`` is not
    that episode's (the episode was played on another env). The DPO channel's ``"scripted"`` teacher follows it."""
    task = make_task(seed, episode_id)
    return solve(task, random.Random(0), 0.0) if task.question == question else None
