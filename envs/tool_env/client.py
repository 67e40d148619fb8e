"""WebSocket client of the tool environment.

OpenEnv's ``EnvClient`` is async; for synchronous code use its ``.sync()`` wrapper, which runs the
connection on a private event loop thread::

    with ToolEnvClient(base_url="http://127.0.0.1:8000").sync() as env:
        obs = env.reset(seed=0, episode_id="7").observation       # .question, .tools
        result = env.step(ToolAction(tool="lookup", arguments={"item": "apple"}))
        result.observation.content, result.reward, result.done

Each client (sync or async) is one server-side session, i.e. one episode at a time; use one client
per concurrent episode. Server-side failures (e.g. ``step`` after the episode ended) raise
``RuntimeError("Server error: ...")``.
"""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from .models import ToolAction, ToolObservation, ToolState

__all__ = ["ToolEnvClient"]


class ToolEnvClient(EnvClient[ToolAction, ToolObservation, ToolState]):
    """Client for ``envs.tool_env.server``.

    ``base_url`` is http(s):// or ws(s)://; the client adds the ``/ws`` path.
    """

    def _step_payload(self, action: ToolAction) -> dict[str, Any]:
        """Serialize one tool call for the ``step`` message."""
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[ToolObservation]:
        """Build a ``StepResult`` from a reset/step response."""
        fields = dict(payload.get("observation", {}))
        fields["done"] = payload.get("done", False)
        fields["reward"] = payload.get("reward")
        observation = ToolObservation.model_validate(fields)
        return StepResult(
            observation=observation,
            reward=observation.reward,
            done=observation.done,
            metadata=payload.get("metadata"),
        )

    def _parse_state(self, payload: dict[str, Any]) -> ToolState:
        """Build a ``ToolState`` from a state response."""
        return ToolState.model_validate(payload)
