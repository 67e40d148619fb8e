"""Server-side tool environment: one instance per WebSocket session."""

from __future__ import annotations

import logging
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment

from ..models import ToolAction, ToolObservation, ToolState
from ..tasks import TOOL_SCHEMAS, Task, execute, make_task

__all__ = ["DEFAULT_MAX_TOOL_CALLS", "ToolEnvironment"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOOL_CALLS = 8


class ToolEnvironment(Environment[ToolAction, ToolObservation, ToolState]):
    """Price-arithmetic episodes solved with lookup/add/subtract/multiply/submit tools.

    Reward 1.0 when ``submit`` gets the correct answer, else 0.0. ``submit`` ends the episode; so
    does spending ``max_tool_calls`` calls (failed calls count, and do not end the episode).
    Instances hold no shared state, so one server can run many sessions at once.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._task: Task | None = None
        self._state = ToolState()

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        max_tool_calls: Optional[int] = None,
        **kwargs: Any,
    ) -> ToolObservation:
        """Start the episode ``(seed, episode_id)``; the same pair always gives the same task.

        Args:
            seed: run-level seed; defaults to 0.
            episode_id: episode identifier; defaults to "0".
            max_tool_calls: call budget; defaults to ``DEFAULT_MAX_TOOL_CALLS`` (8).

        Raises:
            ValueError: on unknown keyword arguments or ``max_tool_calls < 1``.
        """
        if kwargs:
            raise ValueError(f"unknown reset argument(s): {', '.join(sorted(kwargs))}")
        seed = 0 if seed is None else seed
        episode_id = "0" if episode_id is None else str(episode_id)
        budget = DEFAULT_MAX_TOOL_CALLS if max_tool_calls is None else max_tool_calls
        if budget < 1:
            raise ValueError(f"max_tool_calls must be >= 1, got {budget}")
        self._task = make_task(seed, episode_id)
        self._state = ToolState(episode_id=episode_id, seed=seed, max_tool_calls=budget)
        return ToolObservation(question=self._task.question, tools=TOOL_SCHEMAS, reward=None)

    def step(
        self, action: ToolAction, timeout_s: Optional[float] = None, **kwargs: Any
    ) -> ToolObservation:
        """Execute one tool call.

        Raises:
            RuntimeError: if called before ``reset`` or after the episode ended.
        """
        if self._task is None:
            raise RuntimeError("step() called before reset()")
        if self._state.done:
            raise RuntimeError(f"episode {self._state.episode_id!r} is over; call reset()")
        content, error_kind, error_meta = execute(self._task, action.tool, action.arguments)
        self._state.step_count += 1
        self._state.tool_calls += 1
        reward, end_reason = 0.0, None
        if action.tool == "submit" and error_kind is None:
            self._state.submitted_answer = action.arguments["answer"]
            reward = 1.0 if self._state.submitted_answer == self._task.answer else 0.0
            end_reason = "submitted"
        elif self._state.tool_calls >= self._state.max_tool_calls:
            end_reason = "max_tool_calls"
        self._state.done = end_reason is not None
        metadata: dict[str, Any] = {"tool_calls": self._state.tool_calls}
        if end_reason is not None:
            metadata["end_reason"] = end_reason
            logger.debug("episode %s ended (%s), reward %.1f",
                         self._state.episode_id, end_reason, reward)
        return ToolObservation(
            content=content, error_kind=error_kind, error_meta=error_meta,
            done=self._state.done, reward=reward, metadata=metadata,
        )

    @property
    def state(self) -> ToolState:
        """The current episode's state."""
        return self._state
