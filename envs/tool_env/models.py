"""Wire models of the tool environment: one tool call in, one tool result out."""

from __future__ import annotations

from typing import Any, Literal

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

__all__ = ["ToolAction", "ToolObservation", "ToolState"]


class ToolAction(Action):
    """One tool call. Unknown fields are rejected (``extra="forbid"``, from OpenEnv's base)."""

    tool: str = Field(..., description="Tool name, e.g. 'lookup', 'add', 'submit'.")
    arguments: dict[str, Any] = Field(
        default_factory=dict, description="Tool arguments by name, e.g. {'item': 'apple'}."
    )


class ToolObservation(Observation):
    """What the agent sees after reset or after one tool call.

    Also carries the base's ``done``, ``reward`` and ``metadata`` (``tool_calls``, and
    ``end_reason`` = "submitted" | "max_tool_calls" once done).

    ``reward`` is None after reset, 1.0 after a correct ``submit``, else 0.0.
    """

    content: str = Field(
        default="", description="Text of the tool message: the result, or 'error: ...' on failure."
    )
    error_kind: Literal["tool_not_found", "invalid_args", "execution_error", "timeout"] | None = Field(
        default=None,
        description="Why the call failed; None when it succeeded. This environment never reports 'timeout'; the "
        "kind is accepted so that this client (the rollout's) also parses envs.coding_env's observations.",
    )
    error_meta: dict[str, Any] = Field(
        default_factory=dict,
        description="Failure details for hints: tool, message, and available_tools "
        "(tool_not_found) or expected_schema (invalid_args).",
    )
    question: str = Field(default="", description="The task's question; set on reset only.")
    tools: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Tool schemas in OpenAI function format; set on reset only.",
    )


class ToolState(State):
    """Server-side episode state (plus the base's episode_id and step_count)."""

    seed: int = Field(default=0, description="Seed the task was generated from.")
    tool_calls: int = Field(
        default=0, ge=0, description="Tool calls made so far, failed ones included."
    )
    max_tool_calls: int = Field(
        default=8, ge=1, description="Call budget; the episode ends when it is spent."
    )
    submitted_answer: int | None = Field(
        default=None, description="Answer given to submit, if any."
    )
    done: bool = Field(default=False, description="Whether the episode has ended.")
