"""WebSocket client of the coding environment.

OpenEnv's ``EnvClient`` is async; for synchronous code use its ``.sync()`` wrapper::

    with CodingEnvClient(base_url="http://127.0.0.1:8001").sync() as env:
        obs = env.reset(seed=0, episode_id="7").observation          # .question, .tools
        result = env.step(CodingAction(tool="run_tests", arguments={}))
        result.observation.content, result.observation.error_kind, result.reward, result.done

Each client is one server-side session, i.e. one episode at a time. A ``run_tests`` or ``submit`` call takes as
long as the sandbox run (up to the server's wall-clock limit, 10 s by default), well inside the client's default
60 s message timeout. Server-side failures (e.g. ``step`` after the episode ended) raise
``RuntimeError("Server error: ...")``.
"""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from .models import CodingAction, CodingObservation, CodingState

__all__ = ["CodingEnvClient"]


class CodingEnvClient(EnvClient[CodingAction, CodingObservation, CodingState]):
    """Client for ``envs.coding_env.server``.

    ``base_url`` is http(s):// or ws(s)://; the client adds the ``/ws`` path.
    """

    def _step_payload(self, action: CodingAction) -> dict[str, Any]:
        """Serialize one tool call for the ``step`` message."""
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[CodingObservation]:
        """Build a ``StepResult`` from a reset/step response."""
        fields = dict(payload.get("observation", {}))
        fields["done"] = payload.get("done", False)
        fields["reward"] = payload.get("reward")
        observation = CodingObservation.model_validate(fields)
        return StepResult(
            observation=observation,
            reward=observation.reward,
            done=observation.done,
            metadata=payload.get("metadata"),
        )

    def _parse_state(self, payload: dict[str, Any]) -> CodingState:
        """Build a ``CodingState`` from a state response."""
        return CodingState.model_validate(payload)
