"""`openenv validate` (openenv 0.10.0) passes for every env package of the repo: the manifest (``--level static``,
the ``validation:`` block of ``openenv.yaml``) and a served instance (``--level runtime --url``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from composer_diloco.rollout.env_process import start_env_server

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"envs.tool_env.server": ROOT / "envs" / "tool_env", "envs.coding_env.server": ROOT / "envs" / "coding_env"}


def openenv_validate(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """``openenv validate ARGS`` in a child process (the CLI of the installed openenv); text output."""
    return subprocess.run([sys.executable, "-m", "openenv.cli", "validate", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def _assert_pass(result: subprocess.CompletedProcess) -> None:
    report = result.stdout + result.stderr
    assert result.returncode == 0 and "Verdict: PASS" in report and "FAIL" not in report, report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [*PACKAGES.values(), ROOT / "tests" / "echo_env"], ids=lambda p: p.name)
def test_manifest_passes_static_validation(path):
    _assert_pass(openenv_validate(str(path), "--level", "static"))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", list(PACKAGES))
def test_served_env_passes_runtime_validation(module):
    server = start_env_server(module, startup_timeout_s=60.0)
    try:
        _assert_pass(openenv_validate("--level", "runtime", "--url", server.url, "--timeout", "20"))
    finally:
        server.stop()
