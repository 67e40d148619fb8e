"""Scripted demonstrations of the coding env: the warm-start data of the embedded default policy.

Episode ``index`` is ``make_task(seed, f"warmstart-{index}", source)`` (the generated families by default: the
hand-written tasks are few enough for a tiny model to memorize, which would teach it nothing) played by `solve`:
read ``solution.py``, write the reference solution, run the visible tests, submit. A fraction ``error_rate`` of
episodes hold one failed call before the call it is a failed attempt at, then that call as the recovery: an
unknown tool name, arguments that fail the schema, or a read of a file that is not there.

The replies of ``run_tests`` and ``submit`` on the reference solution are the env's own texts
(`tests_passed_text`, `submitted_text`) without running the sandbox, which costs ~0.07 s a run: 200 warm-start
steps of 16 episodes would spend 7 minutes in it. The reference passes every test by construction (its outputs
are the expected values); ``tests/test_coding_env.py`` checks these replies against real sandboxed runs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from envs.demonstration import Demonstration

from .tasks import SOLUTION_FILE, SOURCES, TEST_FILE, make_task, solve
from .tools import TOOL_SCHEMAS, execute, submitted_text, tests_passed_text

__all__ = ["ERROR_RATE", "demonstration", "script"]

ERROR_RATE = 0.3
"""Default fraction of demonstrations with one failed call and its recovery."""

_WRONG_NAMES = {"read_file": "open_file", "write_file": "save_file", "run_tests": "pytest", "submit": "finish"}


def _failed_attempt(call: tuple[str, dict[str, Any]], rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A call that fails the way a policy's attempt at ``call`` might, without running code."""
    tool, args = call
    kinds = ["tool_not_found"] + (["invalid_args"] if args else []) + (["no_such_file"] if "path" in args else [])
    kind = rng.choice(kinds)
    if kind == "tool_not_found":
        return _WRONG_NAMES[tool], dict(args)
    if kind == "invalid_args":
        key = rng.choice(sorted(args))
        return tool, {k: v for k, v in args.items() if k != key}
    return tool, {**args, "path": rng.choice(("solutions.py", "main.py", TEST_FILE.replace("test_", "tests_")))}


def demonstration(seed: int, index: int, error_rate: float = ERROR_RATE, source: str = "generated",
                  prefix: str = "warmstart") -> Demonstration:
    """Episode ``index`` of the scripted solver under ``seed``; a pure function of its arguments.

    Args:
        seed: run-level seed of the tasks.
        index: the demonstration's number.
        error_rate: probability in [0, 1] of one failed call and its recovery.
        source: `make_task`'s task source.
        prefix: the episode id is ``f"{prefix}-{index}"`` (the warm start's by default; the tokenizer's corpus
            uses ``"corpus"``, so it shares no episode with a warm start).

    Raises:
        ValueError: if ``error_rate`` is outside [0, 1] or ``source`` is unknown.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    episode = f"{prefix}-{index}"
    task = make_task(seed, episode, source)
    calls = solve(task)
    rng = random.Random(f"{seed}:{episode}:solver")
    if rng.random() < error_rate:
        at = rng.randrange(len(calls))
        calls.insert(at, _failed_attempt(calls[at], rng))
    files = task.files()
    replies, imitate, errors = [], [], []
    for tool, args in calls:
        solved = files[SOLUTION_FILE] == task.reference  # then run_tests and submit pass without the sandbox
        if solved and tool == "run_tests":
            reply, error = tests_passed_text(len(task.visible_args)), None
        elif solved and tool == "submit":
            reply, error = submitted_text(len(task.hidden_args), len(task.hidden_args)), None
        else:
            outcome = execute(task, files, tool, args)
            reply = outcome.content
            error = None if outcome.error_kind is None else (outcome.error_kind, outcome.error_meta)
        replies.append(reply)
        imitate.append(error is None)
        errors.append(error)
    return Demonstration(task.question, TOOL_SCHEMAS, calls, replies, imitate, errors)


def script(seed: int, episode_id: str, question: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The scripted solver's calls (read, write the reference, run the tests, submit) for episode
    ``(seed, episode_id)`` under whichever task source (`SOURCES`) gives ``question``; None when none does (the
    episode was played on another env, or reset by ``task_id``). The DPO channel's ``"scripted"`` teacher follows it."""
    for source in SOURCES:
        task = make_task(seed, episode_id, source)
        if task.question == question:
            return solve(task)
    return None


REASON_HINTS: Mapping[str, str] = MappingProxyType({
    "tests_failed": "{test} failed: {detail}. Fix solution.py, then run the tests again.",
    "syntax_error": "The code does not compile at {where}. Fix the syntax first.",
    "import_error": "Importing {path} raised {error_type}. Check the code outside functions.",
    "no_tests": "The test file has no test functions. Do not change test_solution.py.",
    "crashed": "The code stopped the test process. Do not call exit or kill processes.",
    "no_such_file": "There is no file {path}. Files: {files}.",
    "bad_path": "Use a relative path inside the workspace, e.g. solution.py.",
    "patch_not_found": "The old text is not in {path}. Read the file and copy the text exactly.",
    "patch_ambiguous": "The old text occurs {count} times in {path}. Include more lines so it occurs once.",
    "too_large": "The file is too long. Keep it under {max_chars} characters.",
    "too_many_files": "Do not create more files. Edit solution.py.",
    "memory_limit": "The code ran out of memory. Use less memory.",
    "process_limit": "Do not start processes. Compute the result directly.",
    "processes_refused": "Do not start processes. Compute the result directly.",
    "write_outside_workspace": "Write files only inside the workspace, with relative paths.",
    "permission_denied": "Only use files inside the workspace.",
    "network_disabled": "There is no network. Do not open sockets.",
    "read_refused": "Only read files inside the workspace.",
    "ctypes_refused": "Do not use ctypes.",
    "file_size_limit": "The code wrote too much data. Write less.",
    "open_files_limit": "The code opened too many files. Close the files you open.",
    "malformed_output": "Do not write to the sandbox's own files. Return results from solution.py.",
})
"""SDPO hint templates for ``execution_error`` by this env's ``meta["reason"]`` (fields: the meta keys), the env
contract's ``reason_hints`` (`composer_diloco.rollout.env_package`); a ``[hints]`` entry for ``execution_error``
overrides them all."""
