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


def _probe(**env: str) -> subprocess.Popen:
    """The probe in a fresh interpreter (what it imports is the question), started now; `_result` reads it."""
    env = {**{k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}, **env}
    return subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)


def _result(probe: subprocess.Popen) -> dict:
    out, err = probe.communicate(timeout=240)
    assert probe.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_openenv_is_imported_without_gradio_unless_the_web_ui_is_asked_for():
    probes = _probe(), _probe(ENABLE_WEB_INTERFACE="true")  # both at once: the suite's time
    try:
        plain, with_ui = (_result(p) for p in probes)
    finally:
        for p in probes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert plain == {"server": False, "after_node_load": False, "ui_factory": False, "web_route": False}, plain
    assert with_ui == {"server": True, "after_node_load": True, "ui_factory": True, "web_route": True}, with_ui
