"""The coding environment's tools: schemas, argument checks, and one call against an episode's workspace.

Tools (OpenAI function format in `TOOL_SCHEMAS`):

- ``list_files()``: the workspace's files and sizes;
- ``read_file(path)``: one file's text;
- ``write_file(path, content)``: create or replace a file;
- ``patch_file(path, old, new)``: replace the one occurrence of ``old`` in a file by ``new``;
- ``run_tests()``: run the visible tests (every ``test_*`` function of ``test_*.py``) in the sandbox;
- ``submit()``: run the hidden tests in the sandbox and end the episode; reward = fraction passed.

A failed call comes back as data, typed as in ``envs/tool_env``: ``(content, error_kind, error_meta)`` with
``content == "error: " + error_meta["message"]``. Kinds and their metadata (every meta also has ``tool`` and
``message``):

- ``tool_not_found``: ``available_tools``;
- ``invalid_args``: ``expected_schema`` (missing, extra or wrongly typed arguments; strict JSON types); for a
  ``write_file`` path that clashes with a file or directory of the workspace (``solution.py/x.py`` while
  ``solution.py`` exists, or the reverse) also ``reason`` ``path_clash``, ``path`` and ``clashes_with``;
- ``execution_error``: ``reason``, one of ``bad_path``, ``no_such_file``, ``too_large``, ``too_many_files``,
  ``patch_not_found``, ``patch_ambiguous``, ``tests_failed``, ``no_tests``, ``syntax_error``, ``import_error``,
  ``crashed``, ``malformed_output`` (the run's output stream failed the server's checks: the code wrote to the
  runner's records; ``detail`` says how), and the containment reasons ``memory_limit``, ``process_limit``, ``processes_refused``,
  ``write_outside_workspace``, ``network_disabled``, ``read_refused``, ``ctypes_refused``, ``permission_denied``,
  ``file_size_limit``, ``open_files_limit``; plus, where they apply, ``path``, ``files``, ``count``, ``test`` (the
  first failing test, e.g. ``test_2``), ``detail`` (its failure, e.g. ``f(2) returned 3, expected 4``),
  ``failed_tests``, ``passed``, ``total``, ``error_type``, ``where`` (``solution.py:4``), ``line`` (that source
  line) and ``stderr_tail`` (the last 500 characters of the code's output);
- ``timeout``: ``reason`` (``test_timeout``: one test ran past ``per_test_timeout_s``; ``cpu_time``: the run used
  up ``cpu_time_s``; ``wall_clock``: the run passed ``wall_time_s`` and was killed), ``timeout_s``, ``test`` (the
  test running at the time, when known) and ``stderr_tail``.

Tool replies are deterministic in the workspace's contents (memory addresses are masked), so a trace can be
replayed call by call.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

from envs.schema import function_schema

from .sandbox import (
    SandboxLimits,
    SandboxPolicy,
    SandboxResult,
    check_workspace,
    parse_json,
    run_sandboxed,
    safe_relative_path,
)
from .tasks import SOLUTION_FILE, CodingTask, normalize, same_value

__all__ = [
    "ERROR_KINDS",
    "MAX_FILES",
    "MAX_FILE_CHARS",
    "READ_MAX_CHARS",
    "TOOL_NAMES",
    "TOOL_SCHEMAS",
    "ErrorKind",
    "ToolOutcome",
    "execute",
    "submitted_text",
    "tests_passed_text",
]

ErrorKind = Literal["tool_not_found", "invalid_args", "execution_error", "timeout"]
ERROR_KINDS: tuple[str, ...] = ("tool_not_found", "invalid_args", "execution_error", "timeout")

MAX_FILE_CHARS = 20_000
"""Largest file ``write_file``/``patch_file`` may leave, in characters."""
MAX_FILES = 16
"""Most files a workspace may hold."""
READ_MAX_CHARS = 6_000
"""``read_file`` shows at most this many characters of a file."""
_TAIL_CHARS = 500
_SIGXCPU, _SIGKILL = 24, 9


_PATH = ("string", "File path inside the workspace, e.g. solution.py.")
TOOL_SCHEMAS: list[dict[str, Any]] = [
    function_schema("list_files", "List the workspace's files.", {}),
    function_schema("read_file", "Read a file.", {"path": _PATH}),
    function_schema("write_file", "Create or replace a file.",
                    {"path": _PATH, "content": ("string", "The whole new text of the file.")}),
    function_schema("patch_file", "Replace the one occurrence of old by new in a file.",
                    {"path": _PATH, "old": ("string", "Exact text to replace (must occur once)."),
                     "new": ("string", "Replacement text.")}),
    function_schema("run_tests", "Run the visible tests.", {}),
    function_schema("submit", "Run the hidden tests and end the episode.", {}),
]
"""Tool schemas in OpenAI function format (``apply_chat_template(..., tools=TOOL_SCHEMAS)``)."""

TOOL_NAMES: tuple[str, ...] = tuple(s["function"]["name"] for s in TOOL_SCHEMAS)
_PARAMS: dict[str, dict[str, Any]] = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one tool call.

    Attributes:
        content: the tool message shown to the agent (``"error: " + error_meta["message"]`` on failure).
        error_kind: one of `ERROR_KINDS`, or None when the call succeeded.
        error_meta: failure details for hints (see the module docstring); ``{}`` on success.
        submitted: whether this call was ``submit`` (with valid arguments): the episode ends.
        hidden_passed, hidden_total: hidden tests passed and run, set by ``submit``.
    """

    content: str
    error_kind: ErrorKind | None = None
    error_meta: dict[str, Any] = field(default_factory=dict)
    submitted: bool = False
    hidden_passed: int | None = None
    hidden_total: int | None = None

    @property
    def reward(self) -> float | None:
        """Fraction of hidden tests passed (``submit`` only), in [0, 1]."""
        if self.hidden_total is None:
            return None
        return self.hidden_passed / self.hidden_total if self.hidden_total else 0.0


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_WORKSPACE = re.compile(r"/\S*?/coding-env-[^/\s]+/workspace/")


def _mask(text: str) -> str:
    """Mask what differs between runs: memory addresses (``0x7f...``) and the temporary workspace's path."""
    return _ADDRESS.sub("0x...", _WORKSPACE.sub("", text))


def _error(kind: ErrorKind, tool: str, message: str, **meta: Any) -> ToolOutcome:
    message = _mask(message)
    return ToolOutcome(f"error: {message}", kind, {"tool": tool, "message": message, **meta})


def _check_args(tool: str, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit ``tool``'s schema, or None when they do (strict JSON types)."""
    params = _PARAMS[tool]
    if not isinstance(arguments, dict):
        return f"invalid arguments for {tool}: arguments must be an object, got {type(arguments).__name__}"
    problems = []
    missing = [p for p in params["required"] if p not in arguments]
    extra = sorted(set(arguments) - set(params["properties"]))
    if missing:
        problems.append(f"missing argument(s) {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected argument(s) {', '.join(extra)}")
    for name in params["properties"]:
        if name in arguments and not isinstance(arguments[name], str):
            value = arguments[name]
            problems.append(f"argument {name} must be string, got {type(value).__name__} {value!r:.40}")
    return f"invalid arguments for {tool}: " + "; ".join(problems) if problems else None


# ------------------------------------------------------------------------------------------ sandbox results

_SANDBOX_REASONS = (
    ("network", "network_disabled"), ("writing", "write_outside_workspace"), ("outside the workspace",
                                                                             "write_outside_workspace"),
    ("processes", "processes_refused"), ("ctypes", "ctypes_refused"), ("reading", "read_refused"),
    ("listing", "read_refused"),
)
_ERRNO_REASONS = (
    ("[Errno 11]", "process_limit"), ("[Errno 30]", "write_outside_workspace"), ("[Errno 13]", "permission_denied"),
    ("[Errno 101]", "network_disabled"), ("[Errno 99]", "network_disabled"), ("[Errno 27]", "file_size_limit"),
    ("[Errno 24]", "open_files_limit"),
)


def _containment_reason(record: dict[str, Any]) -> str | None:
    """The containment reason behind a failed test, case or import, or None for an ordinary failure."""
    error_type, message = str(record.get("error_type", "")), str(record.get("message", ""))
    if message.startswith("sandbox: "):
        return next((reason for word, reason in _SANDBOX_REASONS if word in message), "sandbox_refused")
    if error_type == "MemoryError":
        return "memory_limit"
    if error_type == "BlockingIOError" and "fork" in str(record.get("line", "")):
        return "process_limit"
    return next((reason for errno, reason in _ERRNO_REASONS if message.startswith(errno)), None)


_REASON_TEXT = {
    "memory_limit": "the code ran out of memory (limit {memory_mb} MB)",
    "process_limit": "the code may not start more than {max_processes} processes",
    "processes_refused": "the code may not start processes",
    "write_outside_workspace": "the code may only write inside the workspace",
    "network_disabled": "the sandbox has no network",
    "read_refused": "the code may not read the project's files",
    "ctypes_refused": "the code may not use ctypes",
    "file_size_limit": "the code wrote a file larger than {max_file_mb} MB",
    "open_files_limit": "the code opened more than {max_open_files} files",
    "permission_denied": "the sandbox denied access to a file outside the workspace",
    "sandbox_refused": "the sandbox refused an operation",
}


def _short(name: str) -> str:
    """``test_solution::test_2`` -> ``test_2`` (other test files keep their prefix)."""
    return name.split("::", 1)[1] if name.startswith("test_solution::") else name


def _where(record: dict[str, Any]) -> str:
    where, line = record.get("where"), record.get("line")
    if not where:
        return ""
    return f" (at {where}: {line})" if line else f" (at {where})"


def _run_failure(tool: str, result: SandboxResult, limits: SandboxLimits) -> ToolOutcome | None:
    """A typed error when the run's output cannot be trusted or the run did not finish (wall clock, CPU limit,
    crash), else None."""
    tail = result.stderr_tail[-_TAIL_CHARS:]
    if result.malformed is not None:
        return _error("execution_error", tool, f"the run's output was malformed ({result.malformed}); do not write "
                      "to the sandbox's own file descriptors", reason="malformed_output", detail=result.malformed,
                      stderr_tail=tail)
    if result.finished:
        return None
    running = _short(result.last_started) if result.last_started else None
    during = f" during {running}" if running else ""
    if result.oom_killed:
        return _error("execution_error", tool, f"the run went over its total memory of "
                      f"{limits.memory_mb + limits.disk_mb} MB{during} and was killed", reason="memory_limit",
                      test=running, stderr_tail=tail)
    if result.timed_out:
        return _error("timeout", tool, f"the run passed the {limits.wall_time_s:g} s wall-clock limit{during} and "
                      "was stopped", reason="wall_clock", timeout_s=limits.wall_time_s, test=running,
                      stderr_tail=tail)
    if result.killed_by in (_SIGXCPU, _SIGKILL):
        return _error("timeout", tool, f"the run used up its {limits.cpu_time_s} s of CPU time{during}",
                      reason="cpu_time", timeout_s=float(limits.cpu_time_s), test=running, stderr_tail=tail)
    return _error("execution_error", tool, f"the run stopped early (exit code {result.exit_code}){during}",
                  reason="crashed", exit_code=result.exit_code, test=running, stderr_tail=tail)


def _import_failure(tool: str, record: dict[str, Any], result: SandboxResult, limits: SandboxLimits,
                    prefix: str = "") -> ToolOutcome:
    """A typed error for a file that could not be imported."""
    tail = result.stderr_tail[-_TAIL_CHARS:]
    path, error_type, message = record.get("file"), record.get("error_type"), record.get("message", "")
    if error_type == "Timeout":
        return _error("timeout", tool, f"{prefix}{message} (an endless loop at import?)", reason="test_timeout",
                      timeout_s=limits.per_test_timeout_s, test=f"import {path}", path=path, stderr_tail=tail)
    where = record.get("where") or ""
    common = {"path": where.split(":")[0] or path, "error_type": error_type, "where": record.get("where"),
              "line": record.get("line"), "stderr_tail": tail}
    if error_type in ("SyntaxError", "IndentationError", "TabError"):
        return _error("execution_error", tool, f"{prefix}{common['path']} does not compile: {error_type}: {message}",
                      reason="syntax_error", **common)
    reason = _containment_reason(record)
    text = f"importing {path} failed: {error_type}: {message}{_where(record)}"
    if reason is not None:
        text += "; " + _REASON_TEXT[reason].format(**vars(limits))
    return _error("execution_error", tool, prefix + text, reason=reason or "import_error", **common)


def tests_passed_text(total: int) -> str:
    """``run_tests``'s reply when all ``total`` visible tests pass."""
    return f"all {total} visible tests passed"


def submitted_text(passed: int, total: int) -> str:
    """``submit``'s reply (or its error message's start) when ``passed`` of ``total`` hidden tests pass."""
    return f"submitted: {passed} of {total} hidden tests passed"


def _bad_workspace(tool: str, files: dict[str, str]) -> ToolOutcome | None:
    """The error when no workspace can be built from ``files`` (unreachable through the file tools), else None."""
    try:
        check_workspace(files)
    except ValueError as exc:
        return _error("execution_error", tool, f"the workspace cannot be built: {exc}", reason="bad_path")
    return None


def _run_tests(files: dict[str, str], limits: SandboxLimits, policy: SandboxPolicy) -> ToolOutcome:
    tool = "run_tests"
    bad = _bad_workspace(tool, files)
    if bad is not None:
        return bad
    result = run_sandboxed(files, {"mode": "tests"}, limits, policy)
    failure = _run_failure(tool, result, limits)
    if failure is not None:
        return failure
    imports = [r for r in result.records if r["type"] == "import_error"]
    if imports:
        return _import_failure(tool, imports[0], result, limits)
    tests = [r for r in result.records if r["type"] == "test"]
    if not tests:
        return _error("execution_error", tool, "no tests found: test_*.py files need test_* functions",
                      reason="no_tests")
    failed = [r for r in tests if r["status"] != "passed"]
    total = len(tests)
    if not failed:
        return ToolOutcome(tests_passed_text(total))
    names = [_short(r["name"]) for r in failed]
    summary = f"{len(failed)} of {total} visible tests failed"
    meta = {"failed_tests": names, "passed": total - len(failed), "total": total,
            "stderr_tail": result.stderr_tail[-_TAIL_CHARS:]}
    timed_out = next((r for r in failed if r["status"] == "timeout"), None)
    if timed_out is not None:
        name = _short(timed_out["name"])
        return _error("timeout", tool, f"{name} ran longer than {limits.per_test_timeout_s:g} s (an endless loop?); "
                      f"{summary}", reason="test_timeout", timeout_s=limits.per_test_timeout_s, test=name, **meta)
    first = failed[0]
    name = _short(first["name"])
    reason = _containment_reason(first)
    detail = _mask(first.get("message") or "")
    text = f"{summary}. {name}: {first.get('error_type')}" + (f": {detail}" if detail else "")
    if first.get("error_type") != "AssertionError" or not detail:
        text += _where(first)
    if reason is not None:
        text += "; " + _REASON_TEXT[reason].format(**vars(limits))
    return _error("execution_error", tool, text, reason=reason or "tests_failed", test=name,
                  detail=detail or f"{first.get('error_type')}{_where(first)}", error_type=first.get("error_type"),
                  where=first.get("where"), line=first.get("line"), **meta)


def _submit(task: CodingTask, files: dict[str, str], limits: SandboxLimits, policy: SandboxPolicy) -> ToolOutcome:
    tool = "submit"
    bad = _bad_workspace(tool, files)
    if bad is not None:
        score = submitted_text(0, len(task.hidden_args))
        message = f"{score}; {bad.error_meta['message']}"
        return ToolOutcome(f"error: {message}", bad.error_kind, {**bad.error_meta, "message": message, "passed": 0,
                           "total": len(task.hidden_args)}, submitted=True, hidden_passed=0,
                           hidden_total=len(task.hidden_args))
    cases = [list(args) for args in task.hidden_args]
    request = {"mode": "cases", "module": SOLUTION_FILE[:-3], "function": task.function, "cases": cases}
    result = run_sandboxed(files, request, limits, policy)
    total = len(cases)
    passed = 0
    results = {r["index"]: r for r in result.records if r["type"] == "case" and isinstance(r.get("index"), int)}
    for index, expected in enumerate(task.hidden_expected):
        record = results.get(index)
        if record is None or record.get("status") != "ok":
            continue
        try:
            got = parse_json(record["result"])  # bounded: the text came out of the sandbox
        except (KeyError, ValueError):
            continue
        passed += same_value(got, normalize(expected))
    score = submitted_text(passed, total)
    outcome = _run_failure(tool, result, limits)
    if outcome is None:
        imports = [r for r in result.records if r["type"] == "import_error"]
        if imports:
            outcome = _import_failure(tool, imports[0], result, limits, prefix=f"{score}; ")
        else:
            timed_out = next((r for r in results.values() if r.get("status") == "timeout"), None)
            contained = next((r for r in results.values() if r.get("status") == "error"
                              and _containment_reason(r) is not None), None)
            if timed_out is not None:
                outcome = _error("timeout", tool, f"{score}; a hidden test ran longer than "
                                 f"{limits.per_test_timeout_s:g} s (an endless loop?)", reason="test_timeout",
                                 timeout_s=limits.per_test_timeout_s, test=f"hidden test {timed_out['index'] + 1}")
            elif contained is not None:
                reason = _containment_reason(contained)
                outcome = _error("execution_error", tool,
                                 f"{score}; {_REASON_TEXT[reason].format(**vars(limits))}", reason=reason,
                                 error_type=contained.get("error_type"), where=contained.get("where"),
                                 line=contained.get("line"))
    if outcome is None:
        return ToolOutcome(score, submitted=True, hidden_passed=passed, hidden_total=total)
    if not outcome.content.startswith(f"error: {score}"):  # a run failure: put the score first
        message = _mask(f"{score}; {outcome.error_meta['message']}")
        outcome = ToolOutcome(f"error: {message}", outcome.error_kind, {**outcome.error_meta, "message": message})
    return ToolOutcome(outcome.content, outcome.error_kind, {**outcome.error_meta, "passed": passed, "total": total},
                       submitted=True, hidden_passed=passed, hidden_total=total)


# ------------------------------------------------------------------------------------------ file tools


def _file_path(tool: str, files: MutableMapping[str, str], raw: str, must_exist: bool) -> str | ToolOutcome:
    """The normalized path, or the error for a bad or (when ``must_exist``) unknown one."""
    path = safe_relative_path(raw)
    if path is None:
        return _error("execution_error", tool, f"bad path {raw!r}: use a relative path inside the workspace, "
                      "e.g. solution.py", reason="bad_path", path=raw)
    if must_exist and path not in files:
        return _error("execution_error", tool, f"no file {path!r}; files: {', '.join(sorted(files))}",
                      reason="no_such_file", path=path, files=sorted(files))
    return path


def _clash(files: MutableMapping[str, str], path: str) -> str | None:
    """The workspace file that ``path`` clashes with (one is the other's directory), or None."""
    for other in sorted(files):
        if path.startswith(other + "/") or other.startswith(path + "/"):
            return other
    return None


def _store(tool: str, files: MutableMapping[str, str], path: str, text: str) -> ToolOutcome | None:
    """Store ``text`` at ``path``, or the error when it is too large or one file too many."""
    if len(text) > MAX_FILE_CHARS:
        return _error("execution_error", tool, f"{path} would have {len(text)} characters; the limit is "
                      f"{MAX_FILE_CHARS}", reason="too_large", path=path, max_chars=MAX_FILE_CHARS)
    if path not in files and len(files) >= MAX_FILES:
        return _error("execution_error", tool, f"the workspace already holds {MAX_FILES} files",
                      reason="too_many_files", path=path)
    files[path] = text
    return None


def execute(
    task: CodingTask,
    files: MutableMapping[str, str],
    tool: str,
    arguments: Any,
    limits: SandboxLimits | None = None,
    policy: SandboxPolicy | None = None,
) -> ToolOutcome:
    """Run one tool call of an episode; ``write_file`` and ``patch_file`` change ``files`` in place.

    Never raises for a bad call: a failed call is returned as data (see the module docstring).

    Args:
        task: the episode's task (``submit`` runs its hidden tests).
        files: the episode's workspace, path -> text.
        tool: the tool name.
        arguments: the call's arguments (a JSON object).
        limits: sandbox limits of ``run_tests`` and ``submit`` (default `SandboxLimits()`).
        policy: sandbox isolation layers (default `SandboxPolicy()`).

    Raises:
        OSError: only if the sandbox's temporary directory or child process cannot be created.
    """
    limits = limits or SandboxLimits()
    policy = policy or SandboxPolicy()
    if tool not in _PARAMS:
        return _error("tool_not_found", tool, f"unknown tool {tool!r}; available tools: {', '.join(TOOL_NAMES)}",
                      available_tools=list(TOOL_NAMES))
    problem = _check_args(tool, arguments)
    if problem is not None:
        return _error("invalid_args", tool, problem, expected_schema=_PARAMS[tool])
    if tool == "list_files":
        return ToolOutcome("\n".join(f"{p} ({len(t)} chars)" for p, t in sorted(files.items())) or "(no files)")
    if tool == "run_tests":
        return _run_tests(dict(files), limits, policy)
    if tool == "submit":
        return _submit(task, dict(files), limits, policy)
    path = _file_path(tool, files, arguments["path"], must_exist=tool != "write_file")
    if isinstance(path, ToolOutcome):
        return path
    if tool == "read_file":
        text = files[path]
        if len(text) > READ_MAX_CHARS:
            return ToolOutcome(text[:READ_MAX_CHARS] + f"\n... [{len(text) - READ_MAX_CHARS} more characters]")
        return ToolOutcome(text)
    if tool == "write_file":
        other = _clash(files, path)
        if other is not None:  # e.g. solution.py/x.py while solution.py exists: the workspace could not be built
            directory, file = (other, path) if path.startswith(other + "/") else (path, other)
            return _error("invalid_args", tool, f"invalid path {path!r} for write_file: {directory!r} is "
                          f"{'a file' if directory == other else 'a directory holding ' + repr(file)}; a path "
                          "cannot be both a file and a directory", expected_schema=_PARAMS[tool], reason="path_clash",
                          path=path, clashes_with=other)
        error = _store(tool, files, path, arguments["content"])
        return error or ToolOutcome(f"wrote {path} ({len(arguments['content'])} chars)")
    old, new = arguments["old"], arguments["new"]  # patch_file
    count = files[path].count(old) if old else 0
    if count != 1:
        reason = "patch_ambiguous" if count > 1 else "patch_not_found"
        why = f"occurs {count} times" if count > 1 else ("is empty" if not old else "was not found")
        return _error("execution_error", tool, f"the old text {why} in {path}; it must occur exactly once "
                      "(read the file and copy the text exactly)", reason=reason, path=path, count=count)
    error = _store(tool, files, path, files[path].replace(old, new, 1))
    return error or ToolOutcome(f"patched {path} ({len(files[path])} chars)")
