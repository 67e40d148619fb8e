"""Wire models of the coding environment: the shared tool-call protocol (`envs.protocol`) with this env's details.

The field names are the protocol's (``tool``/``arguments`` in; ``content``, ``error_kind``, ``error_meta``,
``question``, ``tools`` out), so a client of either environment parses the other's messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from envs.protocol import ToolCallAction, ToolCallObservation, ToolCallState

__all__ = ["CodingAction", "CodingObservation", "CodingState"]


class CodingAction(ToolCallAction):
    """One tool call. Unknown fields are rejected (``extra="forbid"``, from OpenEnv's base)."""

    tool: str = Field(..., description="Tool name, e.g. 'read_file', 'run_tests', 'submit'.")
    arguments: dict[str, Any] = Field(
        default_factory=dict, description="Tool arguments by name, e.g. {'path': 'solution.py'}."
    )


class CodingObservation(ToolCallObservation):
    """What the agent sees after reset or after one tool call.

    Also carries the base's ``done``, ``reward`` and ``metadata``: after reset ``task_id``, ``family``, ``kind``
    and ``sandbox`` (the active isolation layers); after a call ``tool_calls``, and once done ``end_reason``
    ("submitted" | "max_tool_calls") and, after submit, ``hidden_passed`` and ``hidden_total``.

    ``reward`` is None after reset, the fraction of hidden tests passed after ``submit``, else 0.0.
    """

    error_meta: dict[str, Any] = Field(
        default_factory=dict,
        description="Failure details for hints: tool, message, and per kind available_tools, expected_schema, "
        "or reason with path/test/failed_tests/stderr_tail/timeout_s (see envs.coding_env.tools).",
    )
    question: str = Field(default="", description="The task and how to work on it; set on reset only.")


class CodingState(ToolCallState):
    """Server-side episode state (plus the base's episode_id and step_count)."""

    task_id: str = Field(default="", description="The task, e.g. 'hw/slugify' or 'gen/clamp_fix/1a2b3c4d'.")
    max_tool_calls: int = Field(default=12, ge=1, description="Call budget; the episode ends when it is spent.")
    hidden_passed: int | None = Field(default=None, description="Hidden tests passed at submit.")
    hidden_total: int | None = Field(default=None, description="Hidden tests run at submit.")
