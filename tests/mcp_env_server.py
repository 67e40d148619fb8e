"""A small OpenEnv MCP tool environment, served as its own process: what `tests/test_mcp_env.py` trains against.

It is built the way OpenEnv documents MCP environments (``openenv.core.env_server.mcp_environment``): a
`MCPEnvironment` subclass owning a FastMCP server whose ``@mcp.tool`` functions are the agent's tools, served by
OpenEnv's ``create_app(Env, CallToolAction, CallToolObservation)`` under uvicorn. Nothing in it comes from this
project, so a node that plays it plays "any" OpenEnv MCP server.

The task: "What is the price of X plus the price of Y?" over a hidden catalogue of 4 items (prices 1..9), drawn
from ``(seed, episode_id)``, so that a replayed episode is the same episode. The tools are ``envs/tool_env``'s, with
the same descriptions, so the embedded default policy (warm-started on tool_env's prompt) can play it. Tools:

- ``lookup(item: str) -> int``: the price; an unknown item raises FastMCP's ``ToolError`` (OpenEnv types it
  ``execution_error``).
- ``add(a: int, b: int) -> int``: ``a + b``; arguments of the wrong type are refused by FastMCP's validation
  (``invalid_args``); ``subtract`` and ``multiply`` likewise.
- ``submit(answer: int) -> str``: the final tool: the episode ends (``done``) with reward 1.0 for the right answer,
  else 0.0.

Calling a tool that does not exist gives ``tool_not_found``; a call slower than ``--tool-timeout-s`` gives
``timeout``. Reward and done follow OpenEnv's conventions: they are the observation's ``reward`` and ``done``. The
question is the reset observation's ``metadata["question"]``, unless the reset is given a task (a dataset row's
``items``, ``prices`` and ``ask``, TRL's ``reset(**row)``): then it carries no task text and the prompt is the row's.
``configs/mcp_prices_tasks.jsonl`` is such a dataset (`task_row`), for ``configs/mcp_prices.toml``.

Pitfall (OpenEnv 0.10.0): the WebSocket route awaits ``step_async`` whenever the environment overrides it, and
`MCPEnvironment` does; so reward logic must go into ``step_async`` (this file does it in both ``step`` and
``step_async``), an override of ``step`` alone never runs for WebSocket clients.

Run: ``python tests/mcp_env_server.py --host 127.0.0.1 --port 8010 [--tool-timeout-s 5] [--max-concurrent-envs N]``.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Annotated, Any
from uuid import uuid4

from fastmcp import FastMCP
from fastmcp.exceptions import ToolError
from pydantic import Field
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

__all__ = ["ITEMS", "PriceMCPEnvironment", "answer_of", "build_app", "main", "question_of", "task_row"]

A = Annotated[int, Field(description="First number.")]
B = Annotated[int, Field(description="Second number.")]

ITEMS = ("apple", "pear", "plum", "fig", "kiwi", "lime", "lemon", "mango")
"""Item vocabulary the hidden catalogues are drawn from."""


def _task(seed: int | None, episode_id: str | None) -> tuple[dict[str, int], str, str]:
    """The episode's catalogue (item -> price 1..9) and the two items asked about; pure in (seed, episode_id)."""
    rng = random.Random(f"{seed}:{episode_id}")
    items = rng.sample(ITEMS, 4)
    catalogue = {item: rng.randint(1, 9) for item in items}
    x, y = rng.sample(items, 2)
    return catalogue, x, y


def question_of(seed: int, episode_id: str) -> str:
    """The question of episode ``(seed, episode_id)``, e.g. ``"What is the price of fig plus the price of kiwi?"``."""
    _, x, y = _task(seed, episode_id)
    return f"What is the price of {x} plus the price of {y}?"


def answer_of(seed: int, episode_id: str) -> int:
    """The right answer of episode ``(seed, episode_id)`` (the sum of the two prices)."""
    catalogue, x, y = _task(seed, episode_id)
    return catalogue[x] + catalogue[y]


def task_row(seed: int, episode_id: str) -> dict[str, Any]:
    """Episode ``(seed, episode_id)`` as a dataset row for a run with ``[tasks]``: ``prompt`` (the question),
    ``items`` and ``prices`` (the catalogue) and ``ask`` (the two items), what `PriceMCPEnvironment.reset` takes."""
    catalogue, x, y = _task(seed, episode_id)
    return {"prompt": f"What is the price of {x} plus the price of {y}?", "items": list(catalogue),
            "prices": list(catalogue.values()), "ask": [x, y]}


class PriceMCPEnvironment(MCPEnvironment):
    """The price-arithmetic task as an OpenEnv MCP environment (see the module docstring).

    Attributes:
        tool_timeout_s: seconds a tool call may take before OpenEnv answers it with a ``timeout`` error (class-wide;
            ``main`` sets it from ``--tool-timeout-s``).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True
    tool_timeout_s: float = 10.0

    def __init__(self) -> None:
        mcp = FastMCP("prices")
        self._catalogue: dict[str, int] = {}
        self._answer = 0
        self._submitted: int | None = None

        @mcp.tool
        def lookup(item: Annotated[str, Field(description="Item name, e.g. apple.")]) -> int:
            """Look up the price of an item."""
            if item not in self._catalogue:
                raise ToolError(f"no item {item!r} in the catalogue; items: {', '.join(sorted(self._catalogue))}")
            return self._catalogue[item]

        @mcp.tool
        def add(a: A, b: B) -> int:
            """Return a + b."""
            return a + b

        @mcp.tool
        def subtract(a: A, b: B) -> int:
            """Return a - b."""
            return a - b

        @mcp.tool
        def multiply(a: A, b: B) -> int:
            """Return a * b."""
            return a * b

        @mcp.tool
        def submit(answer: Annotated[int, Field(description="The final answer.")]) -> str:
            """Submit the final answer. Ends the episode."""
            self._submitted = answer
            return "submitted"

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, items: list[str] | None = None,
              prices: list[int] | None = None, ask: list[str] | None = None, **kwargs: Any) -> Observation:
        """Start an episode.

        Without task keywords the env draws the task from ``(seed, episode_id)`` and puts the question in
        ``metadata["question"]``. With them (a dataset row's columns, TRL's ``reset(**row)``: ``items``, ``prices``
        and the two ``ask``ed items), the catalogue is the row's and the reset carries no task text: the prompt is
        the dataset's, as for an env whose tasks are the user's. Reward None, not done.

        Raises:
            ValueError: task keywords that do not describe a task (lengths differ, an asked item not in ``items``).
        """
        if items is None and prices is None and ask is None:
            self._catalogue, x, y = _task(seed, episode_id)
            metadata = {"question": f"What is the price of {x} plus the price of {y}?"}
        else:
            if not (items and prices and ask) or len(items) != len(prices) or len(ask) != 2 \
                    or not set(ask) <= set(items):
                raise ValueError(f"task keywords items={items!r} prices={prices!r} ask={ask!r}: expected equal-length "
                                 "items and prices and two asked items among them")
            self._catalogue = {str(i): int(p) for i, p in zip(items, prices)}
            x, y = ask
            metadata = {}
        self._answer = self._catalogue[x] + self._catalogue[y]
        self._submitted = None
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation(done=False, reward=None, metadata=metadata)

    def _score(self, action: Action, obs: Observation) -> Observation:
        """Set ``done``/``reward`` of a tool call's observation: a successful ``submit`` ends the episode."""
        if not isinstance(action, CallToolAction):
            return obs
        self._state.step_count += 1
        if action.tool_name == "submit" and getattr(obs, "error", None) is None and self._submitted is not None:
            obs.done = True
            obs.reward = 1.0 if self._submitted == self._answer else 0.0
        else:
            obs.reward = 0.0
        return obs

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """The synchronous path (HTTP ``/step``): OpenEnv's MCP routing, then the reward."""
        timeout = self.tool_timeout_s if timeout_s is None else timeout_s
        return self._score(action, super().step(action, timeout_s=timeout, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """The WebSocket path: OpenEnv's MCP routing, then the reward (see the pitfall in the module docstring)."""
        timeout = self.tool_timeout_s if timeout_s is None else timeout_s
        return self._score(action, await super().step_async(action, timeout_s=timeout, **kwargs))

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """Non-MCP actions are not part of this environment."""
        return Observation(done=False, reward=0.0,
                           metadata={"error": f"unsupported action {type(action).__name__}; use CallToolAction"})

    @property
    def state(self) -> State:
        """Episode id and the number of tool calls so far."""
        return self._state


def build_app(max_concurrent_envs: int = 64):
    """OpenEnv's FastAPI app for `PriceMCPEnvironment` (WebSocket ``/ws``, HTTP ``/mcp``, ``/health``)."""
    return create_app(PriceMCPEnvironment, CallToolAction, CallToolObservation, env_name="mcp_prices",
                      max_concurrent_envs=max_concurrent_envs)


def main(argv: list[str] | None = None) -> None:
    """Serve the environment with uvicorn until SIGTERM/SIGINT (``--host``, ``--port``, ``--tool-timeout-s``)."""
    import uvicorn

    parser = argparse.ArgumentParser(description="A small OpenEnv MCP tool environment (tests).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--tool-timeout-s", type=float, default=10.0,
                        help="seconds a tool call may take before it is answered with a timeout error")
    parser.add_argument("--max-concurrent-envs", type=int, default=int(os.environ.get("MAX_CONCURRENT_ENVS", "64")),
                        help="WebSocket sessions the server holds at once (OpenEnv's max_concurrent_envs; default "
                             "$MAX_CONCURRENT_ENVS, else 64); one more is refused with 'Server at capacity: n/n'")
    args = parser.parse_args(argv)
    PriceMCPEnvironment.tool_timeout_s = args.tool_timeout_s
    uvicorn.run(build_app(args.max_concurrent_envs), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
