"""WebSocket client of the tool environment (the shared `envs.protocol.ToolCallEnvClient` on this env's models).

For synchronous code use OpenEnv's ``.sync()`` wrapper::

    with ToolEnvClient(base_url="http://127.0.0.1:8000").sync() as env:
        obs = env.reset(seed=0, episode_id="7").observation       # .question, .tools
        result = env.step(ToolAction(tool="lookup", arguments={"item": "apple"}))
        result.observation.content, result.reward, result.done

Each client (sync or async) is one server-side session, i.e. one episode at a time; use one client
per concurrent episode. Server-side failures (e.g. ``step`` after the episode ended) raise
``RuntimeError("Server error: ...")``.
"""

from __future__ import annotations

from envs.protocol import ToolCallEnvClient

from .models import ToolAction, ToolObservation, ToolState

__all__ = ["ToolEnvClient"]


class ToolEnvClient(ToolCallEnvClient[ToolAction, ToolObservation, ToolState]):
    """Client for ``envs.tool_env.server``; ``base_url`` is http(s):// or ws(s):// (the client adds ``/ws``)."""

    observation_type = ToolObservation
    state_type = ToolState
