"""Run code in the coding sandbox as the server would in each deployment mode, for the containment tests.

Modes:

- ``root``: the launcher (this test process) is root: namespaces, a fresh unprivileged uid per run, cgroups.
- ``non_root``: the launcher is ``nobody`` (uid 65534) with no capabilities, as in most containers: the runner
  isolates itself inside a new user namespace. A child process sets that up: as root it makes a private mount
  namespace where the interpreter under ``/root`` is reachable, then drops to ``nobody`` for good, imports
  ``sandbox.py`` by path (standard library only) and runs the requests (`as_nobody`).
- ``non_root_no_userns`` (not in `MODES`: nothing holds there but the audit hook): the same, where user namespaces
  are not allowed (as in a default Docker container); the server must refuse to start there.

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

_LAUNCHER = r"""
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("sandbox_runner", os.path.abspath("envs/coding_env/sandbox_runner.py"))
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
argv, user_namespaces = json.loads(sys.argv[1]), sys.argv[2] == "1"
# As root: a private mount namespace where the interpreter under /root (0700) is reachable for nobody.
assert runner._unshare(runner.CLONE_NEWNS)
runner._mount(None, "/", None, runner.MS_REC | runner.MS_PRIVATE)
for path in runner._stdlib_dirs():
    runner._expose(path, {"notes": []})
if not user_namespaces:  # a user namespace that may hold no further user namespaces (its parent writes the maps)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child:
        os.read(ready_r, 1)
        for name in ("uid_map", "gid_map"):
            runner._write_file(f"/proc/{child}/{name}", "0 0 65536")
        os.write(go_w, b"x")
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status))
    assert runner._unshare(runner.CLONE_NEWUSER)
    os.write(ready_w, b"x")
    os.read(go_r, 1)
    runner._write_file("/proc/sys/user/max_user_namespaces", "0")
os.setgroups([]); os.setgid(NOBODY); os.setuid(NOBODY)
os.execv(argv[0], argv)
""".replace("NOBODY", str(NOBODY))

_RUNS_SCRIPT = r"""
import dataclasses, importlib.util, json, os, sys

def load(name):  # by path: the package's __init__ would import OpenEnv (seconds), and only the stdlib is needed
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(f"envs/coding_env/{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

sandbox = load("sandbox")
os.chdir("/tmp")
job = json.loads(sys.argv[1])
limits = sandbox.SandboxLimits(**job["limits"])
policy = sandbox.SandboxPolicy(audit_hook=False)
print(json.dumps({name: dataclasses.asdict(sandbox.run_sandboxed(files, request, limits, policy))
                  for name, (files, request) in job["runs"].items()}))
"""


def as_nobody(argv: list[str], user_namespaces: bool = True) -> list[str]:
    """A command that runs ``argv`` as ``nobody`` with no capabilities (from a root test process, in the project
    root); with ``user_namespaces=False`` inside a user namespace that may create none (``unshare(CLONE_NEWUSER)``
    fails with ENOSPC): the unprivileged mode that cannot isolate."""
    return [sys.executable, "-c", _LAUNCHER, json.dumps(argv), "1" if user_namespaces else "0"]


def run_in_mode(mode: str, runs: dict[str, tuple[dict[str, str], dict[str, Any]]], limits: SandboxLimits,
                timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """Run each ``name -> (files, request)`` in ``mode`` (`MODES` or ``non_root_no_userns``) with the audit hook off; ``name ->`` the `SandboxResult` as
    a dict (``records``, ``isolation``, ``exit_code``, ``oom_killed``, ...).

    Raises:
        ValueError: for an unknown mode.
        RuntimeError: if the non-root launcher failed (its stderr's tail in the message).
    """
    if mode == "root":
        from dataclasses import asdict

        return {name: asdict(run_sandboxed(files, request, limits, KERNEL_ONLY))
                for name, (files, request) in runs.items()}
    if mode not in ("non_root", "non_root_no_userns"):
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    from dataclasses import asdict

    job = json.dumps({"limits": asdict(limits), "runs": runs})
    argv = as_nobody([sys.executable, "-c", _RUNS_SCRIPT, job], user_namespaces=mode == "non_root")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=str(PROJECT_ROOT))
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
