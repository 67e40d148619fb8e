"""OpenEnv environments of composer-diloco, one package each in OpenEnv's own layout.

Shared by the packages: `envs.protocol` (the typed tool-call protocol: action, observation, state, client, which
each package's ``models.py`` and ``client.py`` subclass), `envs.schema` (tool schemas in OpenAI function format) and
`envs.demonstration` (the scripted demonstrations' type). What the trainer takes from a package is the env contract
of ``composer_diloco/rollout/env_package.py``.
"""

import importlib as _importlib
import os as _os
import sys as _sys


def _import_openenv_core_without_its_web_ui() -> None:
    """Import ``openenv.core`` with gradio hidden, unless OpenEnv's web UI is asked for (``ENABLE_WEB_INTERFACE``).

    The twin of ``composer_diloco.rollout.openenv_import.import_openenv_core`` (env packages import nothing of the
    trainer), here so that this project's env servers skip the web UI too.

    ``openenv.core``'s package init imports its optional gradio web UI (``env_server.web_interface``), which takes
    ~3.5 s of CPU per process (measured: ``import envs.tool_env.server`` 4.8 s user with it, 1.5 s without), and every
    node and env server pays it, though neither serves the UI. OpenEnv itself falls back when gradio is missing
    (``except ModuleNotFoundError``), and ``create_app`` imports the UI lazily, only when ``ENABLE_WEB_INTERFACE`` is
    set. gradio is hidden only during this import (a ``None`` entry in ``sys.modules``, which makes ``import gradio``
    raise ``ModuleNotFoundError``), so a later ``import gradio`` in the same process still works.
    """
    if "openenv.core" in _sys.modules or "gradio" in _sys.modules:
        return
    if _os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes"):
        return
    _sys.modules["gradio"] = None  # type: ignore[assignment]
    try:
        _importlib.import_module("openenv.core")
    finally:
        if "gradio" in _sys.modules and _sys.modules["gradio"] is None:
            del _sys.modules["gradio"]


_import_openenv_core_without_its_web_ui()
