"""Server-side coding environment: one instance per WebSocket session."""

from __future__ import annotations

import logging
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment

from ..models import CodingAction, CodingObservation, CodingState
from ..sandbox import SandboxLimits, SandboxPolicy, isolation
from ..tasks import CodingTask, make_task
from ..tools import TOOL_SCHEMAS, ToolOutcome, execute

__all__ = ["DEFAULT_MAX_TOOL_CALLS", "CodingEnvironment"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOOL_CALLS = 12


class CodingEnvironment(Environment[CodingAction, CodingObservation, CodingState]):
    """Write or fix a small Python function; reward at ``submit`` = fraction of hidden tests passed.

    The workspace (``solution.py``, ``test_solution.py``) lives in memory; ``run_tests`` and ``submit`` copy it
    into a fresh sandbox per run (`envs.coding_env.sandbox`). ``submit`` ends the episode; so does spending
    ``max_tool_calls`` calls (failed calls count, and do not end it; reward 0.0 without a submit). Instances
    share no state, so one server runs many sessions at once.

    Args:
        limits: sandbox resource limits (default `SandboxLimits()`: 10 s wall clock, 8 s CPU, 2 s per test,
            512 MiB, 16 processes).
        policy: sandbox isolation layers (default: all that the machine allows).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, limits: SandboxLimits | None = None, policy: SandboxPolicy | None = None) -> None:
        super().__init__()
        self.limits = limits or SandboxLimits()
        self.policy = policy or SandboxPolicy()
        self._task: CodingTask | None = None
        self._files: dict[str, str] = {}
        self._state = CodingState()

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        max_tool_calls: Optional[int] = None,
        source: Optional[str] = None,
        task_id: Optional[str] = None,
        **kwargs: Any,
    ) -> CodingObservation:
        """Start the episode ``(seed, episode_id)``; the same arguments always give the same task.

        Args:
            seed: run-level seed; defaults to 0.
            episode_id: episode identifier; defaults to "0".
            max_tool_calls: call budget; defaults to ``DEFAULT_MAX_TOOL_CALLS`` (12).
            source: "mixed" (default), "handwritten", "generated" or "gen/<family>" (see `make_task`).
            task_id: a hand-written task's id, e.g. "slugify"; overrides ``source``.

        Raises:
            ValueError: on unknown keyword arguments, ``max_tool_calls < 1``, or an unknown source or task id.
        """
        if kwargs:
            raise ValueError(f"unknown reset argument(s): {', '.join(sorted(kwargs))}")
        seed = 0 if seed is None else seed
        episode_id = "0" if episode_id is None else str(episode_id)
        budget = DEFAULT_MAX_TOOL_CALLS if max_tool_calls is None else max_tool_calls
        if budget < 1:
            raise ValueError(f"max_tool_calls must be >= 1, got {budget}")
        self._task = make_task(seed, episode_id, source or "mixed", task_id)
        self._files = self._task.files()
        self._state = CodingState(episode_id=episode_id, seed=seed, task_id=self._task.task_id,
                                  max_tool_calls=budget)
        metadata = {"task_id": self._task.task_id, "family": self._task.family, "kind": self._task.kind,
                    "sandbox": isolation(self.policy)}
        return CodingObservation(question=self._task.question, tools=TOOL_SCHEMAS, reward=None, metadata=metadata)

    def step(
        self, action: CodingAction, timeout_s: Optional[float] = None, **kwargs: Any
    ) -> CodingObservation:
        """Execute one tool call (``run_tests``/``submit`` block for the sandbox run).

        A failure inside the server while running the call (e.g. the sandbox's temporary directory cannot be
        created) is logged and returned as an ``execution_error`` with reason ``internal_error``; the call counts.

        Raises:
            RuntimeError: if called before ``reset`` or after the episode ended.
        """
        if self._task is None:
            raise RuntimeError("step() called before reset()")
        if self._state.done:
            raise RuntimeError(f"episode {self._state.episode_id!r} is over; call reset()")
        try:
            outcome = execute(self._task, self._files, action.tool, action.arguments, self.limits, self.policy)
        except Exception as exc:  # noqa: BLE001 - one call's failure must not end the session with a server error
            logger.exception("episode %s (%s): tool %r failed inside the server", self._state.episode_id,
                             self._task.task_id, action.tool)
            message = f"the environment could not run {action.tool}: {type(exc).__name__}: {str(exc)[:200]}"
            outcome = ToolOutcome(f"error: {message}", "execution_error",
                                  {"tool": action.tool, "message": message, "reason": "internal_error"})
        self._state.step_count += 1
        self._state.tool_calls += 1
        reward, end_reason = 0.0, None
        metadata: dict[str, Any] = {"tool_calls": self._state.tool_calls}
        if outcome.submitted:
            reward = outcome.reward or 0.0
            end_reason = "submitted"
            self._state.hidden_passed, self._state.hidden_total = outcome.hidden_passed, outcome.hidden_total
            metadata.update(hidden_passed=outcome.hidden_passed, hidden_total=outcome.hidden_total)
        elif self._state.tool_calls >= self._state.max_tool_calls:
            end_reason = "max_tool_calls"
        self._state.done = end_reason is not None
        if end_reason is not None:
            metadata["end_reason"] = end_reason
            logger.debug("episode %s (%s) ended (%s), reward %.2f", self._state.episode_id, self._task.task_id,
                         end_reason, reward)
        return CodingObservation(
            content=outcome.content, error_kind=outcome.error_kind, error_meta=outcome.error_meta,
            done=self._state.done, reward=reward, metadata=metadata,
        )

    @property
    def state(self) -> CodingState:
        """The current episode's state."""
        return self._state
