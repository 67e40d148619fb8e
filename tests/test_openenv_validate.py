"""`openenv validate` (openenv 0.10.0) passes for every env package of the repo: the manifest (``--level static``,
the ``validation:`` block of ``openenv.yaml``) and a served instance (``--level runtime --url``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_diloco.rollout.env_process import start_env_server

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"envs.tool_env.server": ROOT / "envs" / "tool_env", "envs.coding_env.server": ROOT / "envs" / "coding_env"}


def openenv_validate(*args: str) -> tuple[int, str]:
    """``openenv validate ARGS``: the installed openenv's own command line, invoked in this process (typer's
    CliRunner), so that the five validations pay for importing openenv's CLI once, without the gradio web UI
    (`import_openenv_core`). Returns (exit code, output)."""
    from composer_diloco.rollout.openenv_import import import_openenv_core

    import_openenv_core()
    from openenv.cli.__main__ import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["validate", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _assert_pass(result: tuple[int, str]) -> None:
    code, report = result
    assert code == 0 and "Verdict: PASS" in report and "FAIL" not in report, report


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
