"""Run code in the coding sandbox as the server would in each deployment mode, for the containment tests.

Modes:

- ``root``: the launcher (this test process) is root: namespaces, a fresh unprivileged uid per run, cgroups.
- ``non_root``: the launcher is ``nobody`` (uid 65534) with no capabilities, as in most containers: the runner
  isolates itself inside a new user namespace. A child process sets that up: as root it makes a private mount
  namespace where the interpreter under ``/root`` is reachable, then drops to ``nobody`` for good, imports
  ``sandbox.py`` by path (standard library only) and runs the requests.

Both run with the audit hook off: every property tested must hold without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from envs.coding_env.sandbox import PROJECT_ROOT, SandboxLimits, SandboxPolicy, run_sandboxed

MODES = ("root", "non_root")
NOBODY = 65534
KERNEL_ONLY = SandboxPolicy(audit_hook=False)

_NON_ROOT_SCRIPT = r"""
import dataclasses, importlib.util, json, os, sys

def load(name):  # by path: the package's __init__ would import OpenEnv (seconds), and only the stdlib is needed
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(f"envs/coding_env/{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

runner = load("sandbox_runner")
sandbox = load("sandbox")  # before the chdir below
assert runner._unshare(runner.CLONE_NEWNS)
runner._mount(None, "/", None, runner.MS_REC | runner.MS_PRIVATE)
for path in runner._stdlib_dirs():
    runner._expose(path, {"notes": []})
os.setgroups([]); os.setgid(NOBODY); os.setuid(NOBODY)
os.chdir("/tmp")
job = json.loads(sys.argv[1])
limits = sandbox.SandboxLimits(**job["limits"])
policy = sandbox.SandboxPolicy(audit_hook=False)
out = {}
for name, (files, request) in job["runs"].items():
    result = sandbox.run_sandboxed(files, request, limits, policy)
    out[name] = {k: v for k, v in dataclasses.asdict(result).items()}
print(json.dumps(out))
""".replace("NOBODY", str(NOBODY))


def run_in_mode(mode: str, runs: dict[str, tuple[dict[str, str], dict[str, Any]]], limits: SandboxLimits,
                timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """Run each ``name -> (files, request)`` in ``mode`` with the audit hook off; ``name ->`` the `SandboxResult` as
    a dict (``records``, ``isolation``, ``exit_code``, ``oom_killed``, ...).

    Raises:
        ValueError: for an unknown mode.
        RuntimeError: if the non-root launcher failed (its stderr's tail in the message).
    """
    if mode == "root":
        from dataclasses import asdict

        return {name: asdict(run_sandboxed(files, request, limits, KERNEL_ONLY))
                for name, (files, request) in runs.items()}
    if mode != "non_root":
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    from dataclasses import asdict

    job = json.dumps({"limits": asdict(limits), "runs": runs})
    proc = subprocess.run([sys.executable, "-c", _NON_ROOT_SCRIPT, job], capture_output=True, text=True,
                          timeout=timeout_s, cwd=str(PROJECT_ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"non-root launcher failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def mode_skip_reason(mode: str) -> str | None:
    """Why ``mode`` cannot be tested on this machine (None when it can)."""
    if os.geteuid() != 0:
        return "the tests need root to set up each mode (root itself, and becoming nobody)"
    if mode == "non_root":
        result = run_in_mode(mode, {"probe": ({}, {"mode": "probe"})}, SandboxLimits())["probe"]
        if result["isolation"].get("mode") != "user_namespace":
            return f"no unprivileged user namespaces here: {result['isolation'].get('notes')}"
    return None


def case_result(result: dict[str, Any]) -> Any:
    """The JSON value the one case of a ``cases`` run returned; AssertionError naming what happened otherwise."""
    cases = [r for r in result["records"] if r["type"] == "case"]
    assert cases and cases[0]["status"] == "ok", (cases, result["stderr_tail"][-800:], result["exit_code"])
    return json.loads(cases[0]["result"])


def attack_run(code: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(files, request) that call ``attack()`` of ``code`` once."""
    return {"solution.py": code}, {"mode": "cases", "module": "solution", "function": "attack", "cases": [[]]}


def world_readable_copy(source: Path, directory: Path) -> Path:
    """A world-readable copy of ``source`` in ``directory`` (created 0755), as another checkout would leave it."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    target = directory / source.name
    target.write_bytes(source.read_bytes())
    os.chmod(target, 0o644)
    return target
