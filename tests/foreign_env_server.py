"""OpenEnv env servers as their authors might ship them, for `tests/test_env_detection.py`: one process, one OpenEnv
``create_app`` app per path, each built from openenv 0.10.0's own classes.

- ``/mcp-subclass``: `tests/mcp_env_server.py`'s MCP environment under ``create_app(Env, PriceCallToolAction,
  CallToolObservation)``, a *subclass* of ``CallToolAction``: OpenEnv answers a ``ListToolsAction`` step with
  ``VALIDATION_ERROR`` there, although it is an MCP tool server (its ``/mcp`` lists the tools, calls work).
- ``/code``: a typed env with an action of its own (``code``) and an observation of its own (``stdout``,
  ``exit_code``): neither MCP nor this project's typed tool-call protocol.
- ``/no-question``: the typed tool-call protocol, but the reset observation's ``question`` is empty.
- ``/no-tools``: the typed tool-call protocol, but the reset observation lists no tools.
- ``/mcp-no-tools``: an MCP environment whose FastMCP server has no tools.

Each app serves its own ``/health``, ``/schema``, ``/mcp`` and ``/ws`` under its path, so a client's base URL is
``http://HOST:PORT/<path>``.

Run: ``python tests/foreign_env_server.py --host 127.0.0.1 --port 8020``.
"""

from __future__ import annotations

import argparse
from typing import Any
from uuid import uuid4

from fastapi import FastAPI
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from mcp_env_server import PriceMCPEnvironment

__all__ = ["PATHS", "build_app", "main"]

PATHS = ("mcp-subclass", "code", "no-question", "no-tools", "mcp-no-tools")
"""The apps this server mounts, one per path."""


class PriceCallToolAction(CallToolAction):
    """An author's own tool-call action: OpenEnv's ``CallToolAction`` plus an optional field."""

    trace_id: str | None = Field(default=None, description="Caller's trace id (ignored).")


class CodeAction(Action):
    """A code-execution env's action: its own field, no ``tool``/``arguments``."""

    code: str = Field(..., description="Python source to run.")


class CodeObservation(Observation):
    """A code-execution env's observation."""

    stdout: str = Field(default="", description="What the code printed.")
    exit_code: int = Field(default=0, description="The process's exit code.")


class CodeEnvironment(Environment):
    """Echoes the code as its output (nothing runs): enough to be a working typed env of another protocol."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CodeObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return CodeObservation(stdout="ready")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> CodeObservation:
        self._state.step_count += 1
        return CodeObservation(stdout=getattr(action, "code", ""), reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class ToolCallAction(Action):
    """The typed tool-call protocol's action, in an author's own model."""

    tool: str = Field(..., description="Tool name.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Tool arguments.")


class ToolCallObservation(Observation):
    """The typed tool-call protocol's observation, in an author's own model."""

    content: str = Field(default="", description="The tool message.")
    error_kind: str | None = Field(default=None, description="Why the call failed.")
    error_meta: dict[str, Any] = Field(default_factory=dict, description="Failure details.")
    question: str = Field(default="", description="The task; set on reset.")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="Tool schemas; set on reset.")


ECHO_TOOL = {"type": "function", "function": {"name": "echo", "description": "Echo a text.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


class HollowToolEnvironment(Environment):
    """The typed tool-call protocol with a hollow reset: no question (``QUESTION``) or no tools (``TOOLS``)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    QUESTION = "Echo apple."
    TOOLS: list[dict[str, Any]] = [ECHO_TOOL]

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ToolCallObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return ToolCallObservation(question=self.QUESTION, tools=list(self.TOOLS))

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> ToolCallObservation:
        self._state.step_count += 1
        return ToolCallObservation(content=str(getattr(action, "arguments", {}).get("text", "")), reward=1.0,
                                   done=True)

    @property
    def state(self) -> State:
        return self._state


class NoQuestionEnvironment(HollowToolEnvironment):
    QUESTION = ""


class NoToolsEnvironment(HollowToolEnvironment):
    TOOLS: list[dict[str, Any]] = []


class NoToolsMCPEnvironment(MCPEnvironment):
    """An MCP environment whose FastMCP server registers no tools."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__(FastMCP("empty"))
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"question": "Use a tool."})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def build_app() -> FastAPI:
    """One FastAPI app mounting each of `PATHS`'s OpenEnv apps (64 sessions each)."""
    apps = {
        "mcp-subclass": create_app(PriceMCPEnvironment, PriceCallToolAction, CallToolObservation,
                                   env_name="mcp_subclass", max_concurrent_envs=64),
        "code": create_app(CodeEnvironment, CodeAction, CodeObservation, env_name="code", max_concurrent_envs=64),
        "no-question": create_app(NoQuestionEnvironment, ToolCallAction, ToolCallObservation, env_name="no_question",
                                  max_concurrent_envs=64),
        "no-tools": create_app(NoToolsEnvironment, ToolCallAction, ToolCallObservation, env_name="no_tools",
                               max_concurrent_envs=64),
        "mcp-no-tools": create_app(NoToolsMCPEnvironment, CallToolAction, CallToolObservation, env_name="mcp_no_tools",
                                   max_concurrent_envs=64),
    }
    root = FastAPI()

    @root.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    for path, app in apps.items():
        root.mount(f"/{path}", app)
    return root


def main(argv: list[str] | None = None) -> None:
    """Serve `build_app` with uvicorn until SIGTERM/SIGINT (``--host``, ``--port``)."""
    import uvicorn

    parser = argparse.ArgumentParser(description="Foreign OpenEnv env servers (tests).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8020)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
