"""FastAPI app of the coding environment, and the ``python -m envs.coding_env.server`` entry point.

Episodes go through the WebSocket route ``/ws`` (one environment per connection); ``/health`` answers readiness
probes. The HTTP ``/reset`` and ``/step`` routes build a fresh environment per request, so they cannot carry a
multi-step episode.
"""

from __future__ import annotations

import argparse
import functools
import logging

import uvicorn
from fastapi import FastAPI
from openenv.core.env_server.http_server import create_app

from ..models import CodingAction, CodingObservation, CodingState
from ..sandbox import SandboxLimits, SandboxPolicy, isolation, missing_layers
from .coding_environment import CodingEnvironment

__all__ = ["MAX_CONCURRENT_ENVS", "app", "build_app", "main"]

logger = logging.getLogger(__name__)

MAX_CONCURRENT_ENVS = 256
"""Most WebSocket sessions (episodes in flight) one server holds at once."""


def build_app(limits: SandboxLimits | None = None, policy: SandboxPolicy | None = None) -> FastAPI:
    """The OpenEnv FastAPI app; every session's environment gets ``limits`` and ``policy``."""
    factory = functools.partial(CodingEnvironment, limits=limits, policy=policy)
    return create_app(
        factory,
        CodingAction,
        CodingObservation,
        env_name="coding_env",
        max_concurrent_envs=MAX_CONCURRENT_ENVS,
        state_cls=CodingState,
    )


app = build_app()


def main(argv: list[str] | None = None) -> None:
    """Serve the coding environment with uvicorn until SIGTERM/SIGINT.

    Args:
        argv: command-line arguments (``--host``, ``--port``, ``--log-level``, and the sandbox limits
            ``--wall-time-s``, ``--cpu-time-s``, ``--per-test-timeout-s``, ``--memory-mb``, and
            ``--allow-weak-sandbox``); default
            ``sys.argv[1:]``.

    The sandbox's isolation layers are probed once at start and logged (``coding_env sandbox: mode root, layers
    {...}``). Where they miss any of `REQUIRED_LAYERS` (e.g. an unprivileged user without user namespaces), the
    server refuses to start (exit status 2) unless ``--allow-weak-sandbox`` is given.

    Raises:
        SystemExit: 2 for bad arguments or a sandbox that cannot isolate (without ``--allow-weak-sandbox``).
    """
    defaults = SandboxLimits()
    parser = argparse.ArgumentParser(
        description="Serve the coding environment (OpenEnv; episodes over WebSocket /ws)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="TCP port (default 8001)")
    parser.add_argument("--log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--wall-time-s", type=float, default=defaults.wall_time_s,
                        help="wall-clock seconds per sandbox run (default %(default)s)")
    parser.add_argument("--cpu-time-s", type=int, default=defaults.cpu_time_s,
                        help="CPU seconds per sandbox run (default %(default)s)")
    parser.add_argument("--per-test-timeout-s", type=float, default=defaults.per_test_timeout_s,
                        help="seconds per test or hidden case (default %(default)s)")
    parser.add_argument("--memory-mb", type=int, default=defaults.memory_mb,
                        help="address-space limit per sandbox process, MiB (default %(default)s)")
    parser.add_argument("--allow-weak-sandbox", action="store_true",
                        help="serve even where the sandbox cannot isolate the model's code (no namespaces: only the "
                        "audit hook, which the code can switch off, stands between it and this server's user)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = SandboxLimits(wall_time_s=args.wall_time_s, cpu_time_s=args.cpu_time_s,
                               per_test_timeout_s=args.per_test_timeout_s, memory_mb=args.memory_mb)
    except ValueError as exc:
        parser.error(str(exc))
    found = isolation()
    missing = missing_layers(found)
    logger.log(logging.WARNING if missing else logging.INFO, "coding_env sandbox: mode %s, layers %s",
               found.get("mode", "none"), found)
    if missing and not args.allow_weak_sandbox:
        logger.error("coding_env sandbox cannot isolate here (missing %s); refusing to serve. Run as root or where "
                     "unprivileged user namespaces are allowed, or pass --allow-weak-sandbox", ", ".join(missing))
        raise SystemExit(2)
    if missing:
        logger.warning("coding_env sandbox is weak (missing %s); serving because of --allow-weak-sandbox",
                       ", ".join(missing))
    served = app if limits == defaults else build_app(limits)
    uvicorn.run(served, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
