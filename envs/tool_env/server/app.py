"""FastAPI app of the tool environment, and the ``python -m envs.tool_env.server`` entry point.

Episodes go through the WebSocket route ``/ws`` (one environment per connection); ``/health``
answers readiness probes. The HTTP ``/reset`` and ``/step`` routes build a fresh environment per
request, so they cannot carry a multi-step episode.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn
from openenv.core.env_server.http_server import create_app

from ..models import ToolAction, ToolObservation, ToolState
from .tool_environment import ToolEnvironment

__all__ = ["MAX_CONCURRENT_ENVS", "app", "main"]

MAX_CONCURRENT_ENVS = 256
"""Most WebSocket sessions (episodes in flight) one server holds at once."""

app = create_app(
    ToolEnvironment,
    ToolAction,
    ToolObservation,
    env_name="tool_env",
    max_concurrent_envs=MAX_CONCURRENT_ENVS,
    state_cls=ToolState,
)


def main(argv: list[str] | None = None) -> None:
    """Serve ``app`` with uvicorn until SIGTERM/SIGINT.

    Args:
        argv: command-line arguments (``--host``, ``--port``, ``--log-level``); default
            ``sys.argv[1:]``.
    """
    parser = argparse.ArgumentParser(
        description="Serve the tool environment (OpenEnv; episodes over WebSocket /ws)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
