"""WebSocket client of the coding environment (the shared `envs.protocol.ToolCallEnvClient` on this env's models).

For synchronous code use OpenEnv's ``.sync()`` wrapper::

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

from envs.protocol import ToolCallEnvClient

from .models import CodingAction, CodingObservation, CodingState

__all__ = ["CodingEnvClient"]


class CodingEnvClient(ToolCallEnvClient[CodingAction, CodingObservation, CodingState]):
    """Client for ``envs.coding_env.server``; ``base_url`` is http(s):// or ws(s):// (the client adds ``/ws``)."""

    observation_type = CodingObservation
    state_type = CodingState
