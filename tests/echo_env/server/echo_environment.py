"""Server-side echo env: one instance per WebSocket session."""

from __future__ import annotations

from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment

from ..models import EchoAction, EchoObservation, EchoState
from ..tasks import TOOL_SCHEMAS, execute, question_of, word_of

__all__ = ["EchoEnvironment"]


class EchoEnvironment(Environment[EchoAction, EchoObservation, EchoState]):
    """Echo the episode's word: reward 1.0 and done when echoed; failed calls spend the budget without ending it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._word: str | None = None
        self._state = EchoState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              max_tool_calls: Optional[int] = None, **kwargs: Any) -> EchoObservation:
        """Start episode ``(seed, episode_id)`` (defaults 0 and "0") with a budget of ``max_tool_calls`` (default 4).

        Raises:
            ValueError: on unknown keyword arguments or ``max_tool_calls < 1``.
        """
        if kwargs:
            raise ValueError(f"unknown reset argument(s): {', '.join(sorted(kwargs))}")
        seed, episode_id = seed or 0, "0" if episode_id is None else str(episode_id)
        budget = 4 if max_tool_calls is None else max_tool_calls
        if budget < 1:
            raise ValueError(f"max_tool_calls must be >= 1, got {budget}")
        self._word = word_of(seed, episode_id)
        self._state = EchoState(episode_id=episode_id, seed=seed, max_tool_calls=budget)
        return EchoObservation(question=question_of(seed, episode_id), tools=TOOL_SCHEMAS, reward=None)

    def step(self, action: EchoAction, timeout_s: Optional[float] = None, **kwargs: Any) -> EchoObservation:
        """Run one call.

        Raises:
            RuntimeError: before ``reset`` or after the episode ended.
        """
        if self._word is None or self._state.done:
            raise RuntimeError("step() needs a reset() episode that has not ended")
        content, kind, meta = execute(self._word, action.tool, action.arguments)
        self._state.step_count += 1
        self._state.tool_calls += 1
        solved = kind is None
        self._state.done = solved or self._state.tool_calls >= self._state.max_tool_calls
        return EchoObservation(content=content, error_kind=kind, error_meta=meta, done=self._state.done,
                               reward=1.0 if solved else 0.0)

    @property
    def state(self) -> EchoState:
        """The current episode's state."""
        return self._state
