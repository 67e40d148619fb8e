"""Wire models of the echo env: the tool-call protocol's field names, in models of its own."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

__all__ = ["EchoAction", "EchoObservation", "EchoState"]


class EchoAction(Action):
    """One tool call (``extra="forbid"`` from OpenEnv's base)."""

    tool: str = Field(..., description="Tool name: 'echo'.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Tool arguments, e.g. {'text': 'apple'}.")


class EchoObservation(Observation):
    """Reset: ``question`` and ``tools``; a call: ``content``, and on failure ``error_kind`` and ``error_meta``.

    ``reward`` is None after reset, 1.0 after echoing the episode's word, else 0.0."""

    content: str = Field(default="", description="The tool message.")
    error_kind: str | None = Field(default=None, description="'tool_not_found', 'invalid_args', 'execution_error'.")
    error_meta: dict[str, Any] = Field(default_factory=dict, description="tool, message, and the kind's details.")
    question: str = Field(default="", description="The task; set on reset only.")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="Tool schemas; set on reset only.")


class EchoState(State):
    """Server-side episode state (plus the base's ``episode_id`` and ``step_count``)."""

    seed: int = Field(default=0, description="Seed the word was drawn from.")
    tool_calls: int = Field(default=0, ge=0, description="Tool calls made so far.")
    max_tool_calls: int = Field(default=4, ge=1, description="Call budget.")
    done: bool = Field(default=False, description="Whether the episode has ended.")
