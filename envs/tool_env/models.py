"""Wire models of the tool environment: the shared tool-call protocol (`envs.protocol`) with this env's details."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from envs.protocol import ToolCallAction, ToolCallObservation, ToolCallState

__all__ = ["ToolAction", "ToolObservation", "ToolState"]


class ToolAction(ToolCallAction):
    """One tool call. Unknown fields are rejected (``extra="forbid"``, from OpenEnv's base)."""

    tool: str = Field(..., description="Tool name, e.g. 'lookup', 'add', 'submit'.")
    arguments: dict[str, Any] = Field(
        default_factory=dict, description="Tool arguments by name, e.g. {'item': 'apple'}."
    )


class ToolObservation(ToolCallObservation):
    """What the agent sees after reset or after one tool call.

    Also carries the base's ``done``, ``reward`` and ``metadata`` (``tool_calls``, and
    ``end_reason`` = "submitted" | "max_tool_calls" once done). This env never reports ``error_kind="timeout"``.

    ``reward`` is None after reset, 1.0 after a correct ``submit``, else 0.0.
    """


class ToolState(ToolCallState):
    """Server-side episode state (plus the base's episode_id and step_count)."""

    submitted_answer: int | None = Field(
        default=None, description="Answer given to submit, if any."
    )
