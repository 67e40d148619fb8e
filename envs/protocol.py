"""The typed tool-call protocol both of this project's envs speak: one tool call in, one tool result out.

A reset observation carries the task (``question``) and the tool schemas (``tools``, OpenAI function format); a step
takes one tool call (``tool``, ``arguments``) and answers its result (``content``) or, when the call failed, the same
text plus a typed ``error_kind`` and its ``error_meta`` (the fields the SDPO hints are filled from). These JSON field
names are the wire protocol that ``composer_diloco.rollout.episodes.OpenEnvSession`` reads (documented in
``composer_diloco/rollout/env_package.py``); an env package may also speak it with models of its own.

Each env keeps OpenEnv's layout: its ``models.py`` subclasses `ToolCallAction`, `ToolCallObservation` and
`ToolCallState` (with its own descriptions and defaults), and its ``client.py`` subclasses `ToolCallEnvClient`
naming those models.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, Literal, TypeVar

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

__all__ = ["ERROR_KINDS", "ErrorKind", "ToolCallAction", "ToolCallEnvClient", "ToolCallObservation", "ToolCallState"]

ErrorKind = Literal["tool_not_found", "invalid_args", "execution_error", "timeout"]
"""Why a tool call failed: the names of OpenEnv's MCP ``ToolErrorType`` (its ``transport_error`` aside)."""

ERROR_KINDS: tuple[str, ...] = ErrorKind.__args__


class ToolCallAction(Action):
    """One tool call. Unknown fields are rejected (``extra="forbid"``, from OpenEnv's base)."""

    tool: str = Field(..., description="Tool name, as listed in the reset observation's tools.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Tool arguments by name.")


class ToolCallObservation(Observation):
    """What the agent sees after reset (``question``, ``tools``) or after one tool call (``content``, and on failure
    ``error_kind`` and ``error_meta``); plus the base's ``done``, ``reward`` and ``metadata``."""

    content: str = Field(
        default="", description="Text of the tool message: the result, or 'error: ...' on failure."
    )
    error_kind: ErrorKind | None = Field(default=None, description="Why the call failed; None when it succeeded.")
    error_meta: dict[str, Any] = Field(
        default_factory=dict,
        description="Failure details for hints: tool, message, and per kind available_tools (tool_not_found), "
        "expected_schema (invalid_args), reason (execution_error) or timeout_s (timeout).",
    )
    question: str = Field(default="", description="The task's question; set on reset only.")
    tools: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Tool schemas in OpenAI function format; set on reset only.",
    )


class ToolCallState(State):
    """Server-side episode state common to tool-call envs (plus the base's ``episode_id`` and ``step_count``)."""

    seed: int = Field(default=0, description="Seed the task was drawn from.")
    tool_calls: int = Field(default=0, ge=0, description="Tool calls made so far, failed ones included.")
    max_tool_calls: int = Field(default=8, ge=1, description="Call budget; the episode ends when it is spent.")
    done: bool = Field(default=False, description="Whether the episode has ended.")


A = TypeVar("A", bound=ToolCallAction)
O = TypeVar("O", bound=ToolCallObservation)
S = TypeVar("S", bound=ToolCallState)


class ToolCallEnvClient(EnvClient[A, O, S], Generic[A, O, S]):
    """WebSocket client of a tool-call env; a subclass names its models in ``observation_type`` and ``state_type``.

    OpenEnv's ``EnvClient`` is async; for synchronous code use its ``.sync()`` wrapper, which runs the connection on
    a private event-loop thread. ``base_url`` is http(s):// or ws(s)://; the client adds the ``/ws`` path. Each client
    (sync or async) is one server-side session, i.e. one episode at a time. Server-side failures (e.g. ``step`` after
    the episode ended) raise ``RuntimeError("Server error: ...")``.
    """

    observation_type: ClassVar[type[ToolCallObservation]] = ToolCallObservation
    state_type: ClassVar[type[ToolCallState]] = ToolCallState

    def _step_payload(self, action: A) -> dict[str, Any]:
        """Serialize one tool call for the ``step`` message."""
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[O]:
        """Build a ``StepResult`` from a reset/step response.

        Raises:
            pydantic.ValidationError: the observation does not fit ``observation_type``.
        """
        fields = dict(payload.get("observation", {}))
        fields["done"] = payload.get("done", False)
        fields["reward"] = payload.get("reward")
        observation = self.observation_type.model_validate(fields)
        return StepResult(
            observation=observation,
            reward=observation.reward,
            done=observation.done,
            metadata=payload.get("metadata"),
        )

    def _parse_state(self, payload: dict[str, Any]) -> S:
        """Build the state from a state response.

        Raises:
            pydantic.ValidationError: the state does not fit ``state_type``.
        """
        return self.state_type.model_validate(payload)
