"""Importing OpenEnv without the gradio web UI that neither a node nor an env server serves."""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["import_openenv_core"]


def import_openenv_core() -> None:
    """Import ``openenv.core`` with gradio hidden, unless OpenEnv's web UI is asked for (``ENABLE_WEB_INTERFACE``).

    ``openenv.core``'s package init imports its optional gradio web UI (``env_server.web_interface``): ~3.5 s of CPU
    in every process that touches OpenEnv (measured: ``import envs.tool_env.server`` takes 4.8 s user with it, 1.5 s
    without). OpenEnv itself falls back when gradio is missing (``except ModuleNotFoundError``), and its
    ``create_app`` imports the UI lazily, only when ``ENABLE_WEB_INTERFACE`` is set. gradio is hidden only during this
    import (a ``None`` entry in ``sys.modules`` makes ``import gradio`` raise ``ModuleNotFoundError``), so a later
    ``import gradio`` in the same process still works. A no-op once ``openenv.core`` or gradio is imported.

    Called before the core's first OpenEnv import (env packages, generic and MCP clients); ``envs/__init__.py``
    does the same for this project's env servers, which import nothing of the core.
    """
    if "openenv.core" in sys.modules or "gradio" in sys.modules:
        return
    if os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes"):
        return
    sys.modules["gradio"] = None  # type: ignore[assignment]
    try:
        importlib.import_module("openenv.core")
    finally:
        if "gradio" in sys.modules and sys.modules["gradio"] is None:
            del sys.modules["gradio"]
