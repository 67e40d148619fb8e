"""FastAPI app of the echo env (OpenEnv ``create_app``), and the ``python -m echo_env.server`` entry point."""

from __future__ import annotations

import argparse

import uvicorn
from openenv.core.env_server.http_server import create_app

from ..models import EchoAction, EchoObservation, EchoState
from .echo_environment import EchoEnvironment

__all__ = ["app", "main"]

app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=64,
                 state_cls=EchoState)


def main(argv: list[str] | None = None) -> None:
    """Serve ``app`` with uvicorn until SIGTERM/SIGINT (``--host``, ``--port``; default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description="Serve the echo env (OpenEnv; episodes over WebSocket /ws).")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8002, help="TCP port (default 8002)")
    args = parser.parse_args(argv)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
