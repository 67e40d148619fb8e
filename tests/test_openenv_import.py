"""Nodes and env servers import OpenEnv without its gradio web UI (~3.5 s of CPU each), and the UI still comes when
OpenEnv's ``ENABLE_WEB_INTERFACE`` asks for it (`composer_diloco.rollout.openenv_import`, ``envs/__init__.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
sys.path.insert(0, "tests")
import envs.tool_env.server.app as ours
server_loaded_gradio = "gradio" in sys.modules
from composer_diloco.rollout.env_package import load_env_package
load_env_package("echo_env.server")  # another author's package, loaded the way a node loads it
import openenv.core.env_server as env_server
routes = sorted({getattr(r, "path", "") for r in ours.app.routes})
seen = {"server": server_loaded_gradio, "after_node_load": "gradio" in sys.modules,
        "ui_factory": env_server.create_web_interface_app is not None, "web_route": "/web" in routes}
import gradio  # hidden only while openenv.core was imported: still importable
print(json.dumps(seen))
"""


def _probe(**env: str) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}, **env}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_openenv_is_imported_without_gradio_unless_the_web_ui_is_asked_for():
    plain = _probe()
    assert plain == {"server": False, "after_node_load": False, "ui_factory": False, "web_route": False}, plain
    with_ui = _probe(ENABLE_WEB_INTERFACE="true")
    assert with_ui == {"server": True, "after_node_load": True, "ui_factory": True, "web_route": True}, with_ui
