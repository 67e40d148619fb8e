"""WebSocket client of the echo env (OpenEnv ``EnvClient`` on its models); ``.sync()`` for synchronous code."""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from .models import EchoAction, EchoObservation, EchoState

__all__ = ["EchoEnvClient"]


class EchoEnvClient(EnvClient[EchoAction, EchoObservation, EchoState]):
    """Client for ``echo_env.server``; ``base_url`` is http(s):// or ws(s):// (the client adds ``/ws``)."""

    def _step_payload(self, action: EchoAction) -> dict[str, Any]:
        """Serialize one tool call."""
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[EchoObservation]:
        """Build a ``StepResult`` from a reset/step response."""
        observation = EchoObservation.model_validate(
            {**payload.get("observation", {}), "done": payload.get("done", False), "reward": payload.get("reward")})
        return StepResult(observation=observation, reward=observation.reward, done=observation.done,
                          metadata=payload.get("metadata"))

    def _parse_state(self, payload: dict[str, Any]) -> EchoState:
        """Build the state from a state response."""
        return EchoState.model_validate(payload)
