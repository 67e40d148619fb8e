"""Tests of the coding environment: tasks, tools, reward, the sandbox's containment, and a real server process."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.channels.hints import HintRegistry
from envs.coding_env.demos import REASON_HINTS
from envs.coding_env import (
    FAMILIES,
    HANDWRITTEN,
    TOOL_SCHEMAS,
    CodingAction,
    CodingEnvClient,
    SandboxLimits,
    SandboxPolicy,
    execute,
    isolation,
    make_task,
    run_sandboxed,
    solve,
)
from envs.coding_env.sandbox import PROJECT_ROOT, safe_relative_path
from envs.coding_env.server import CodingEnvironment
from envs.coding_env.tasks import TASKS_FILE, normalize, same_value

FAST = SandboxLimits(wall_time_s=6.0, cpu_time_s=3, per_test_timeout_s=0.5, memory_mb=256)
KERNEL_ONLY = SandboxPolicy(audit_hook=False)
HOOK_ONLY = SandboxPolicy(namespaces=False, drop_uid=False)
CODING_HINTS = HintRegistry.from_config(None, reason_hints=REASON_HINTS)
"""The hints a trainer on the coding env uses: the defaults with the env's reason hints."""
SLUGIFY = make_task(0, "0", task_id="slugify")

# The model's "solution": each defines slugify(text) so that the visible tests call it.
ENDLESS_LOOP = "def slugify(text):\n    while True:\n        pass\n"
FORK_LOOP = "import os\n\ndef slugify(text):\n    while True:\n        os.fork()\n"
HUGE_ALLOCATION = "def slugify(text):\n    return str(len(bytearray(50 * 2**30)))\n"
SOCKET = ("import socket\n\ndef slugify(text):\n    s = socket.socket()\n    s.settimeout(2)\n"
          "    s.connect(('127.0.0.1', 9))\n")


def _write_outside(path: str) -> str:
    return f"def slugify(text):\n    with open({path!r}, 'w') as fh:\n        fh.write('escaped')\n    return text\n"


def _results(source: str, function: str, cases) -> list:
    """The project's own starter or reference code, run in this process on each case (JSON-normalized)."""
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 - the project's code, not the model's
    fn = namespace[function]
    out = []
    for args in cases:
        try:
            out.append(normalize(fn(*json.loads(json.dumps(list(args))))))
        except Exception as exc:  # noqa: BLE001 - a starter may raise
            out.append(f"raised {type(exc).__name__}")
    return out


def _run(code: str, tool: str = "run_tests", limits: SandboxLimits = FAST, policy: SandboxPolicy | None = None):
    files = SLUGIFY.files()
    files["solution.py"] = code
    return execute(SLUGIFY, files, tool, {}, limits, policy)


def _namespaces_available() -> bool:
    return isolation().get("network") == "namespace"


# ----------------------------------------------------------------------------- tasks


def test_handwritten_tasks_are_many_distinct_and_their_starters_fail():
    assert len(HANDWRITTEN) >= 50
    assert len({t.task_id for t in HANDWRITTEN}) == len(HANDWRITTEN)
    assert {t.kind for t in HANDWRITTEN} == {"write", "fix"}
    for task in HANDWRITTEN:
        assert task.task_id.startswith("hw/") and task.function in task.prompt
        assert len(task.visible_args) >= 2 and len(task.hidden_args) >= 3, task.task_id
        assert len(task.hidden_expected) == len(task.hidden_args)
        expected = [normalize(e) for e in task.hidden_expected + task.visible_expected]
        got = _results(task.starter, task.function, task.hidden_args + task.visible_args)
        assert not all(same_value(g, e) for g, e in zip(got, expected)), f"{task.task_id}: starter already passes"
        compile(task.files()["test_solution.py"], "test_solution.py", "exec")
    assert TASKS_FILE.is_file() and TASKS_FILE.is_relative_to(PROJECT_ROOT)


def test_generated_families_are_reproducible_and_their_starters_fail():
    for family in FAMILIES:
        for episode in range(15):
            task = make_task(3, str(episode), source=f"gen/{family}")
            assert task == make_task(3, str(episode), source=f"gen/{family}")
            assert task.family == family and task.task_id.startswith(f"gen/{family}/")
            expected = [normalize(e) for e in task.hidden_expected]
            got = _results(task.starter, task.function, task.hidden_args)
            assert not all(same_value(g, e) for g, e in zip(got, expected)), (task.task_id, task.starter)
    assert len({make_task(3, str(e), source="generated").question for e in range(40)}) > 20


def test_make_task_sources_and_bad_arguments():
    mixed = {make_task(1, str(e)).family for e in range(60)}
    assert "handwritten" in mixed and len(mixed) >= 4
    assert {make_task(1, str(e), source="handwritten").family for e in range(10)} == {"handwritten"}
    assert make_task(1, "x", task_id="gcd").task_id == make_task(9, "y", task_id="hw/gcd").task_id == "hw/gcd"
    with pytest.raises(ValueError, match="unknown source"):
        make_task(0, "0", source="bogus")
    with pytest.raises(ValueError, match="unknown family"):
        make_task(0, "0", source="gen/bogus")
    with pytest.raises(ValueError, match="unknown task_id"):
        make_task(0, "0", task_id="no_such_task")


def test_same_value_and_normalize():
    assert normalize((1, [2, (3,)], {4: {5}})) == [1, [2, [3]], {"4": [5]}]
    assert same_value(0.1 + 0.2, 0.3) and same_value(2, 2.0) and not same_value(2, 3)
    assert not same_value(True, 1) and not same_value(1, True) and same_value(None, None)
    assert not same_value([1, 2], [1, 2, 3]) and not same_value({"a": 1}, {"a": 1, "b": 2})
    assert not same_value("1", 1)


def test_safe_relative_path():
    assert safe_relative_path("./pkg/util.py") == "pkg/util.py"
    for bad in ("../x", "/etc/passwd", "", "a/../../b", ".hidden", "a\\b", "a/b/c/d.py", "x" * 101):
        assert safe_relative_path(bad) is None, bad


# ----------------------------------------------------------------------------- tools


def test_tool_schemas():
    names = [s["function"]["name"] for s in TOOL_SCHEMAS]
    assert names == ["list_files", "read_file", "write_file", "patch_file", "run_tests", "submit"]
    for schema in TOOL_SCHEMAS:
        params = schema["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) == set(params["properties"])


def test_file_tools_and_their_errors():
    files = SLUGIFY.files()
    listing = execute(SLUGIFY, files, "list_files", {})
    assert listing.error_kind is None and "solution.py" in listing.content and "test_solution.py" in listing.content
    assert execute(SLUGIFY, files, "read_file", {"path": "solution.py"}).content == SLUGIFY.starter

    out = execute(SLUGIFY, files, "read_file", {"path": "nope.py"})
    assert (out.error_kind, out.error_meta["reason"]) == ("execution_error", "no_such_file")
    assert out.error_meta["files"] == ["solution.py", "test_solution.py"] and out.content.startswith("error: ")
    out = execute(SLUGIFY, files, "write_file", {"path": "../escape.py", "content": "x"})
    assert out.error_meta["reason"] == "bad_path" and "../escape.py" not in files
    out = execute(SLUGIFY, files, "write_file", {"path": "solution.py", "content": "x" * 30_000})
    assert out.error_meta["reason"] == "too_large" and files["solution.py"] == SLUGIFY.starter

    out = execute(SLUGIFY, files, "patch_file", {"path": "solution.py", "old": "raise NotImplementedError",
                                                 "new": "return '-'.join(text.lower().split())"})
    assert out.error_kind is None and "return '-'.join" in files["solution.py"]
    out = execute(SLUGIFY, files, "patch_file", {"path": "solution.py", "old": "no such text", "new": ""})
    assert out.error_meta["reason"] == "patch_not_found"
    files["notes.txt"] = "a\na\n"
    out = execute(SLUGIFY, files, "patch_file", {"path": "notes.txt", "old": "a", "new": "b"})
    assert (out.error_meta["reason"], out.error_meta["count"]) == ("patch_ambiguous", 2)

    out = execute(SLUGIFY, files, "frobnicate", {})
    assert out.error_kind == "tool_not_found" and "run_tests" in out.error_meta["available_tools"]
    for args in ({}, {"path": 3}, {"path": "a", "extra": 1}, ["solution.py"]):
        out = execute(SLUGIFY, files, "read_file", args)
        assert out.error_kind == "invalid_args", args
        assert out.error_meta["expected_schema"]["required"] == ["path"]


def test_a_path_that_clashes_with_a_file_or_directory_is_refused_and_the_episode_stays_playable():
    """``solution.py/x.py`` after ``solution.py`` (and the reverse) used to wedge every later run with EEXIST."""
    files = SLUGIFY.files()
    for path, other in [("solution.py/x.py", "solution.py"), ("solution.py/a/b.py", "solution.py"),
                        ("test_solution.py/t.py", "test_solution.py")]:
        out = execute(SLUGIFY, files, "write_file", {"path": path, "content": "x = 1\n"})
        assert (out.error_kind, out.error_meta["reason"], out.error_meta["clashes_with"]) == (
            "invalid_args", "path_clash", other), out.content
        assert out.error_meta["expected_schema"]["required"] == ["path", "content"] and path not in files
    assert execute(SLUGIFY, files, "write_file", {"path": "pkg/util.py", "content": "X = 1\n"}).error_kind is None
    out = execute(SLUGIFY, files, "write_file", {"path": "pkg", "content": "x"})  # the reverse: pkg is a directory
    assert (out.error_kind, out.error_meta["reason"], out.error_meta["clashes_with"]) == (
        "invalid_args", "path_clash", "pkg/util.py")
    assert execute(SLUGIFY, files, "write_file", {"path": "pkg.py", "content": "Y = 2\n"}).error_kind is None
    files["solution.py"] = "import pkg\n\ndef slugify(text):\n    return '-'.join(text.lower().split())\n"
    out = execute(SLUGIFY, files, "run_tests", {}, FAST)  # the workspace (pkg/util.py and pkg.py) still builds
    assert out.error_kind is None, out.content
    assert execute(SLUGIFY, files, "submit", {}, FAST).reward == 1.0


def test_a_workspace_that_cannot_be_built_is_a_typed_error_before_anything_is_written(tmp_path):
    from envs.coding_env.sandbox import check_workspace

    clashing = {**SLUGIFY.files(), "solution.py/x.py": "x = 1\n"}
    with pytest.raises(ValueError, match="'solution.py' is a file and the directory of 'solution.py/x.py'"):
        check_workspace(clashing)
    with pytest.raises(ValueError, match="names 'a.py' twice"):
        check_workspace({"a.py": "", "./a.py": ""})
    with pytest.raises(ValueError, match="unsafe workspace path"):
        run_sandboxed({"../a.py": ""}, {"mode": "probe"}, FAST)
    out = execute(SLUGIFY, dict(clashing), "run_tests", {}, FAST)  # only reachable by building files by hand
    assert (out.error_kind, out.error_meta["reason"]) == ("execution_error", "bad_path"), out.content
    out = execute(SLUGIFY, dict(clashing), "submit", {}, FAST)
    assert out.submitted and out.reward == 0.0 and out.content.startswith("error: submitted: 0 of")


def test_run_tests_and_submit_reward_and_error_metadata():
    files = SLUGIFY.files()
    out = execute(SLUGIFY, files, "run_tests", {}, FAST)
    assert (out.error_kind, out.error_meta["reason"], out.error_meta["test"]) == (
        "execution_error", "tests_failed", "test_1")
    assert out.error_meta["failed_tests"] == ["test_1", "test_2"] and out.error_meta["error_type"] == \
        "NotImplementedError"

    files["solution.py"] = "def slugify(text):\n    return text.lower().replace(' ', '-')\n"  # half right
    out = execute(SLUGIFY, files, "run_tests", {}, FAST)
    assert out.error_meta["test"] == "test_2" and out.error_meta["passed"] == 1
    assert "returned '--many---spaces-here-', expected 'many-spaces-here'" in out.content
    hint = CODING_HINTS.hint(out.error_kind, out.error_meta)
    assert hint.startswith("test_2 failed: slugify('  Many   spaces here ') returned") and "Fix solution.py" in hint
    out = execute(SLUGIFY, files, "submit", {}, FAST)
    assert out.submitted and out.error_kind is None and 0.0 < out.reward < 1.0
    assert out.content == f"submitted: {out.hidden_passed} of {len(SLUGIFY.hidden_args)} hidden tests passed"

    files["solution.py"] = "def slugify(text):\n    return (\n"
    out = execute(SLUGIFY, files, "run_tests", {}, FAST)
    assert (out.error_meta["reason"], out.error_meta["where"]) == ("syntax_error", "solution.py:2")
    assert CODING_HINTS.hint(out.error_kind, out.error_meta) == (
        "The code does not compile at solution.py:2. Fix the syntax first.")
    out = execute(SLUGIFY, files, "submit", {}, FAST)
    assert out.submitted and out.reward == 0.0 and out.error_meta["reason"] == "syntax_error"


def test_outputs_are_compared_outside_the_sandbox():
    """An object that claims to equal everything (a classic reward hack) earns nothing: results cross as JSON."""
    files = SLUGIFY.files()
    files["solution.py"] = ("class Anything:\n    def __eq__(self, other):\n        return True\n\n"
                            "def slugify(text):\n    return Anything()\n")
    assert execute(SLUGIFY, files, "run_tests", {}, FAST).error_kind is None  # it fools the visible tests...
    out = execute(SLUGIFY, files, "submit", {}, FAST)
    assert out.reward == 0.0  # ...but not the hidden ones
    files["solution.py"] = ("def slugify(text):\n"
                            f"    return open({str(TASKS_FILE)!r}).read()[:20]\n")
    out = execute(SLUGIFY, files, "run_tests", {}, FAST)  # the tasks file, with every reference solution
    assert (out.error_kind, out.error_meta["reason"]) == ("execution_error", "read_refused"), out.content
    if _namespaces_available():  # without the hook, the project root is an empty tmpfs
        out = execute(SLUGIFY, files, "run_tests", {}, FAST, KERNEL_ONLY)
        assert out.error_meta["error_type"] == "FileNotFoundError", out.content


def test_replies_are_deterministic_for_replay():
    calls = [("run_tests", {}), ("write_file", {"path": "solution.py", "content": "import nope\n"}), ("run_tests", {}),
             ("write_file", {"path": "solution.py", "content": "def slugify(t):\n    return object()\n"}),
             ("run_tests", {}), ("submit", {})]
    replies = []
    for _ in range(2):
        files = SLUGIFY.files()
        replies.append([(o.content, o.error_kind) for o in (execute(SLUGIFY, files, t, a, FAST) for t, a in calls)])
    assert replies[0] == replies[1]
    assert "coding-env-" not in json.dumps(replies[0]) and "0x..." in replies[0][4][0]


def test_scripted_solver_earns_full_reward_on_every_handwritten_task():
    for task in HANDWRITTEN:
        files = task.files()
        outcomes = [execute(task, files, tool, args, FAST) for tool, args in solve(task)]
        assert [o.error_kind for o in outcomes] == [None] * 4, (task.task_id, outcomes[2].content)
        assert outcomes[-1].reward == 1.0, (task.task_id, outcomes[-1].content)


def test_scripted_solver_earns_full_reward_on_generated_tasks():
    for family in FAMILIES:
        task = make_task(11, family, source=f"gen/{family}")
        files = task.files()
        outcomes = [execute(task, files, tool, args, FAST) for tool, args in solve(task)]
        assert outcomes[2].error_kind is None and outcomes[-1].reward == 1.0, (task.task_id, outcomes[2].content)


# ----------------------------------------------------------------------------- containment, in process


def test_isolation_is_reported():
    found = isolation()
    assert {"network", "filesystem", "processes", "uid", "audit_hook", "notes"} <= set(found), found
    assert found["network"] in ("namespace", "audit_hook") and found["filesystem"] != "none"
    if os.geteuid() == 0 and _namespaces_available():  # this machine: root with namespaces
        assert found["processes"] == "pid_namespace" and found["filesystem"] == "allowlist"
        assert str(PROJECT_ROOT) in found["hidden_paths"] and found["mode"] == "root"
        assert (found["ipc"], found["uts"], found["proc"]) == ("namespace", "namespace", "own")
        assert found["capabilities"] == "none" and found["no_new_privs"] is True
    assert isolation(HOOK_ONLY)["network"] == "audit_hook"


def test_endless_loop_is_a_timeout_naming_the_test():
    out = _run(ENDLESS_LOOP)
    assert (out.error_kind, out.error_meta["reason"], out.error_meta["test"]) == ("timeout", "test_timeout", "test_1")
    assert out.error_meta["failed_tests"] == ["test_1", "test_2"]  # test_2 is skipped after the timeout
    assert CODING_HINTS.hint(out.error_kind, out.error_meta) == (
        "run_tests timed out after 0.5 s in test_1. Look for an endless loop.")
    out = _run(ENDLESS_LOOP, tool="submit")
    assert out.submitted and out.reward == 0.0 and out.error_kind == "timeout"


def test_cpu_time_and_wall_clock_limits_stop_code_the_alarm_cannot():
    c_loop = "def slugify(text):\n    return sum(range(10 ** 12))\n"  # one C call: SIGALRM waits for it
    out = _run(c_loop, limits=SandboxLimits(wall_time_s=8.0, cpu_time_s=1, per_test_timeout_s=5.0))
    assert (out.error_kind, out.error_meta["reason"], out.error_meta["test"]) == ("timeout", "cpu_time", "test_1")
    sleeper = ("import signal, time\n\ndef slugify(text):\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
               "    time.sleep(60)\n")
    out = _run(sleeper, limits=SandboxLimits(wall_time_s=2.0, cpu_time_s=5, per_test_timeout_s=1.0))
    assert (out.error_kind, out.error_meta["reason"], out.error_meta["timeout_s"]) == ("timeout", "wall_clock", 2.0)
    assert out.error_meta["test"] == "test_1"


@pytest.mark.parametrize("policy", [None, KERNEL_ONLY, HOOK_ONLY], ids=["default", "kernel_only", "hook_only"])
def test_fork_loop_huge_allocation_and_socket_are_contained(policy):
    if policy is KERNEL_ONLY and not _namespaces_available():
        pytest.skip("no namespaces here: the audit hook is the only network/filesystem layer")
    fork = _run(FORK_LOOP, policy=policy)
    assert fork.error_kind == "execution_error", fork.content
    if policy is KERNEL_ONLY:
        assert fork.error_meta["reason"] == "process_limit"  # RLIMIT_NPROC on the run's fresh uid
    else:
        assert fork.error_meta["reason"] == "processes_refused"
    memory = _run(HUGE_ALLOCATION, policy=policy)
    assert (memory.error_kind, memory.error_meta["reason"], memory.error_meta["error_type"]) == (
        "execution_error", "memory_limit", "MemoryError")
    sock = _run(SOCKET, policy=policy)
    assert (sock.error_kind, sock.error_meta["reason"]) == ("execution_error", "network_disabled"), sock.content
    assert CODING_HINTS.hint(sock.error_kind, sock.error_meta) == "There is no network. Do not open sockets."


@pytest.mark.parametrize("policy", [None, KERNEL_ONLY, HOOK_ONLY], ids=["default", "kernel_only", "hook_only"])
def test_writing_outside_the_workspace_is_contained(policy, tmp_path):
    if policy is KERNEL_ONLY and not _namespaces_available():
        pytest.skip("no namespaces here: the audit hook is the only filesystem layer")
    for target in (tmp_path / "escaped.txt", PROJECT_ROOT / "escaped.txt"):
        out = _run(_write_outside(str(target)), policy=policy)
        assert out.error_kind == "execution_error", out.content
        if policy is KERNEL_ONLY and isolation(policy)["filesystem"] == "allowlist":  # the path is not there at all
            assert out.error_meta["error_type"] == "FileNotFoundError", out.content
        else:
            assert out.error_meta["reason"] in ("write_outside_workspace", "permission_denied"), out.content
        assert not target.exists()
    inside = "def slugify(text):\n    with open('scratch.txt', 'w') as fh:\n        fh.write(text)\n" \
             "    return '-'.join(open('scratch.txt').read().lower().split())\n"
    assert _run(inside, policy=policy).error_kind is None


def test_file_size_limit_is_contained():
    big = "def slugify(text):\n    with open('big.bin', 'wb') as fh:\n        fh.write(b'x' * 3 * 2**20)\n"
    out = _run(big, limits=SandboxLimits(wall_time_s=6.0, cpu_time_s=3, per_test_timeout_s=1.0, max_file_mb=1))
    assert (out.error_kind, out.error_meta["reason"]) == ("execution_error", "file_size_limit"), out.content


def test_workspace_is_removed_and_no_process_outlives_a_run():
    layers = isolation(KERNEL_ONLY)
    if layers["processes"] != "pid_namespace" and not layers["uid"].startswith("fresh"):
        pytest.skip("neither a PID namespace nor a uid drop here: a setsid child can outlive the run (documented)")
    code = ("import os, time\n\ndef where():\n    pid = os.fork()\n    if pid == 0:\n        os.setsid()\n"
            "        time.sleep(30)\n        os._exit(0)\n    return [os.getcwd(), os.getuid()]\n")
    result = run_sandboxed({"solution.py": code}, {"mode": "cases", "module": "solution", "function": "where",
                                                   "cases": [[]]}, FAST, KERNEL_ONLY)
    (record,) = [r for r in result.records if r["type"] == "case"]
    workspace, uid = json.loads(record["result"])
    assert not Path(workspace).exists()
    owners = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                owners.append(entry.stat().st_uid)
            except OSError:
                pass
    assert uid == 0 or uid not in owners  # the daemonized child died with the run


@pytest.mark.timeout(60)
def test_a_non_root_server_gets_the_same_containment_through_a_user_namespace():
    """The launcher as ``nobody`` (``tests/sandbox_modes.py``): new user, network, mount and PID namespaces, no audit
    hook. The attacks of ``tests/test_sandbox_containment.py`` run in this mode too."""
    from tests.sandbox_modes import mode_skip_reason, run_in_mode

    reason = mode_skip_reason("non_root")
    if reason is not None:
        pytest.skip(reason)
    codes = {"fork": FORK_LOOP, "socket": SOCKET, "write": _write_outside("/tmp/coding-env-test-escape.txt")}
    runs = {name: ({"solution.py": code}, {"mode": "cases", "module": "solution", "function": "slugify",
                                           "cases": [["x"]]}) for name, code in codes.items()}
    results = run_in_mode("non_root", runs, SandboxLimits(wall_time_s=6.0, cpu_time_s=3, per_test_timeout_s=1.0))
    out = {name: [r.get("message", "") for r in result["records"] if r["type"] == "case"]
           for name, result in results.items()}
    isolation_found = results["fork"]["isolation"]
    assert isolation_found["network"] == "namespace" and isolation_found["mode"] == "user_namespace", isolation_found
    assert "user namespace" in " ".join(isolation_found["notes"])
    assert out["fork"] == ["[Errno 11] Resource temporarily unavailable"]
    assert out["socket"] == ["[Errno 101] Network is unreachable"]
    assert out["write"][0].startswith("[Errno 30] Read-only file system")
    assert not Path("/tmp/coding-env-test-escape.txt").exists()


def test_hints_cover_the_coding_error_reasons():
    for meta, hint in [
        ({"tool": "read_file", "reason": "no_such_file", "path": "x.py", "files": ["solution.py"]},
         "There is no file x.py. Files: solution.py."),
        ({"tool": "patch_file", "reason": "patch_ambiguous", "path": "solution.py", "count": 2},
         "The old text occurs 2 times in solution.py. Include more lines so it occurs once."),
        ({"tool": "run_tests", "reason": "memory_limit"}, "The code ran out of memory. Use less memory."),
        ({"tool": "run_tests", "reason": "tests_failed", "message": "1 of 2 visible tests failed"},
         "run_tests failed: 1 of 2 visible tests failed. Check the arguments."),  # no test/detail: generic hint
    ]:
        assert CODING_HINTS.hint("execution_error", meta) == hint


# ----------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def server():
    """One coding-env server process for the module, stopped in finally."""
    srv = start_env_server("envs.coding_env.server", startup_timeout_s=60.0)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_server_plays_a_scripted_episode_and_survives_every_containment_case(server, tmp_path):
    task = make_task(0, "0", task_id="slugify")
    with CodingEnvClient(base_url=server.url).sync() as env:
        result = env.reset(seed=0, episode_id="0", task_id="slugify")
        assert result.observation.question == task.question and result.observation.tools == TOOL_SCHEMAS
        assert result.reward is None and result.observation.metadata["sandbox"]["audit_hook"] is True
        results = [env.step(CodingAction(tool=t, arguments=a)) for t, a in solve(task)]
        assert [r.done for r in results] == [False, False, False, True]
        assert results[-1].reward == 1.0 and results[-1].observation.metadata["end_reason"] == "submitted"
        assert env.state().hidden_passed == env.state().hidden_total == len(task.hidden_args)

        env.reset(seed=0, episode_id="1", task_id="slugify", max_tool_calls=20)
        escaped = tmp_path / "escaped.txt"
        expected = [(ENDLESS_LOOP, "timeout", "test_timeout"), (FORK_LOOP, "execution_error", "processes_refused"),
                    (HUGE_ALLOCATION, "execution_error", "memory_limit"),
                    (_write_outside(str(escaped)), "execution_error", "write_outside_workspace"),
                    (SOCKET, "execution_error", "network_disabled")]
        for code, kind, reason in expected:
            env.step(CodingAction(tool="write_file", arguments={"path": "solution.py", "content": code}))
            obs = env.step(CodingAction(tool="run_tests", arguments={})).observation
            assert (obs.error_kind, obs.error_meta["reason"]) == (kind, reason), obs.content
            assert obs.error_meta["test"] == "test_1"
            listing = env.step(CodingAction(tool="list_files", arguments={}))  # the server still answers
            assert listing.observation.error_kind is None and not listing.done
        assert not escaped.exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_rollout_session_plays_the_coding_env_unchanged(server):
    """``composer_diloco.rollout.episodes.OpenEnvSession`` (the node's client, reading the protocol's JSON fields) plays
    it."""
    from composer_diloco.rollout.episodes import OpenEnvSession

    session = OpenEnvSession(server.url, max_tool_calls=6)
    try:
        question, tools = session.reset(4, "7")
        task = make_task(4, "7")
        assert question == task.question and [t["function"]["name"] for t in tools][-1] == "submit"
        content, kind, meta, reward, done = session.call("nope", {})
        assert kind == "tool_not_found" and not done
        session.call("write_file", {"path": "solution.py", "content": "def f(:\n"})
        content, kind, meta, reward, done = session.call("run_tests", {})
        assert (kind, meta["reason"]) == ("execution_error", "syntax_error") and content.startswith("error: ")
        content, kind, meta, reward, done = session.call("submit", {})
        assert done and reward == 0.0 and content.startswith("error: submitted: 0 of")
        session.reset(4, "7")
        for tool, args in solve(task):
            content, kind, meta, reward, done = session.call(tool, args)
        assert done and reward == 1.0 and kind is None
    finally:
        session.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_dpo_recovery_after_failed_tests_runs_the_tests_and_submits(server):
    """Issue 40: DPO's ``dpo_score = "recovery"`` pair at a failed ``run_tests`` of the starter code. Its chosen is the
    rest of the script played in the env: the reference written, the tests run, a submit that passes (reward 1), so
    the pair holds the calls that check and finish the work on its chosen side too (single-call pairs put only a
    ``write_file`` there, and taught a policy that never submits)."""
    from composer_diloco.channels.dpo_recovery import recovery_pairs
    from composer_diloco.channels.dpo_teachers import render_tool_call
    from composer_diloco.policy import load_embedded_tokenizer
    from composer_diloco.rollout.env_package import load_env_package
    from composer_diloco.rollout.episodes import OpenEnvSession
    from episode_support import scripted_episode

    tok = load_embedded_tokenizer("envs.coding_env.server")
    session = OpenEnvSession(server.url, max_tool_calls=8)
    try:
        question, tools = session.reset(4, "7")
        steps = []
        for name, args in [("read_file", {"path": "solution.py"}), ("run_tests", {})]:  # the starter fails its tests
            content, kind, meta, _, _ = session.call(name, args)
            text, _ = render_tool_call(tok, name, args)
            steps.append((text[: -len(tok.eos_token)], content, kind, meta or {}))
        assert steps[-1][2] == "execution_error" and steps[-1][3]["reason"] == "tests_failed", steps[-1]
        episode = scripted_episode(tok, seed=4, episode_id="7", question=question, tools=tools, steps=steps)
        (pair,), stats = recovery_pairs(tok, [episode], session, load_env_package("envs.coding_env").script)
    finally:
        session.close()
    assert (pair.turn, pair.chosen_score, pair.rejected_score, stats.pairs) == (3, 1.0, 0.0, 1)
    assert '"run_tests"' in tok.decode(pair.rejected_ids)
    calls = tok.decode([t for t, m in zip(pair.chosen_ids, pair.chosen_mask) if m])
    assert [name for name in ("write_file", "run_tests", "submit") if f'"{name}"' in calls] == \
        ["write_file", "run_tests", "submit"], calls
    assert calls.count(tok.eos_token) == 3  # three turns, each ended
    replies = tok.decode([t for t, m in zip(pair.chosen_ids, pair.chosen_mask) if not m])
    assert "passed" in replies, replies  # the env's reply to the recovery's run_tests, as context


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_concurrent_sessions_each_solve_their_episode(server):
    tasks = [make_task(0, "0", task_id=name) for name in ("gcd", "fizzbuzz", "caesar")]
    rewards: dict[int, float] = {}
    errors: list[BaseException] = []

    def play(index: int) -> None:
        try:
            with CodingEnvClient(base_url=server.url).sync() as env:
                env.reset(seed=0, episode_id=str(index), task_id=tasks[index].task_id)
                for tool, args in solve(tasks[index]):
                    result = env.step(CodingAction(tool=tool, arguments=args))
                rewards[index] = result.reward
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=play, args=(i,)) for i in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=45)
    assert not errors, errors
    assert rewards == {0: 1.0, 1: 1.0, 2: 1.0}


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_server_rejects_bad_resets(server):
    with CodingEnvClient(base_url=server.url).sync() as env:
        with pytest.raises(RuntimeError, match="bogus"):
            env.reset(seed=0, episode_id="0", bogus=1)
        with pytest.raises(RuntimeError, match="unknown task_id"):
            env.reset(seed=0, episode_id="0", task_id="no_such_task")
        obs = env.reset(seed=0, episode_id="0", max_tool_calls=1).observation
        assert obs.question
        only = env.step(CodingAction(tool="list_files", arguments={}))
        assert only.done and only.reward == 0.0 and only.observation.metadata["end_reason"] == "max_tool_calls"


def test_shipped_config_plays_the_coding_env():
    from composer_diloco.config import load_config

    config = load_config(PROJECT_ROOT / "configs" / "coding.toml")
    assert config.env.server_module == "envs.coding_env.server"
    assert config.env.max_tool_calls >= len(solve(SLUGIFY)) and config.env.max_turn_tokens >= 128
    # The embedded default warm-starts on this env's own demonstrations and plays the generated families.
    from composer_diloco.policy import env_demonstrations

    assert env_demonstrations(config.env.server_module).__module__ == "envs.coding_env.demos"
    assert config.model is None and config.warmstart.steps > 0 and config.env.reset_kwargs == {"source": "generated"}
    assert (config.outer.lr, config.outer.momentum) == (1.0, 0.0)


def test_environment_in_process_counts_calls_and_rejects_steps_after_the_end():
    env = CodingEnvironment(limits=FAST)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(CodingAction(tool="list_files", arguments={}))
    obs = env.reset(seed=2, episode_id="3", max_tool_calls=2)
    assert obs.metadata["task_id"] == make_task(2, "3").task_id
    first = env.step(CodingAction(tool="read_file", arguments={"path": "missing.py"}))
    assert first.error_kind == "execution_error" and not first.done and first.reward == 0.0
    last = env.step(CodingAction(tool="list_files", arguments={}))
    assert last.done and last.metadata["end_reason"] == "max_tool_calls"
    with pytest.raises(RuntimeError, match="is over"):
        env.step(CodingAction(tool="submit", arguments={}))
    with pytest.raises(ValueError, match="max_tool_calls"):
        env.reset(max_tool_calls=0)


@pytest.mark.timeout(120)
def test_warm_start_demonstrations_replay_exactly_in_the_sandbox():
    """The demos write run_tests/submit replies without the sandbox; real sandboxed runs must give the same text."""
    from envs.coding_env.demos import demonstration

    seen_families, seen_failures = set(), 0
    for index in range(12):
        demo = demonstration(5, index, error_rate=0.5)
        task = make_task(5, f"warmstart-{index}", "generated")
        assert demo.question == task.question
        files = task.files()
        replies = [execute(task, files, tool, args, limits=FAST).content for tool, args in demo.calls]
        assert replies == demo.replies
        assert demo.replies[-1].startswith("submitted:") and demo.imitate[-1]
        seen_families.add(task.family)
        seen_failures += not all(demo.imitate)
    assert len(seen_families) >= 3 and seen_failures >= 3
    with pytest.raises(ValueError, match="error_rate"):
        demonstration(0, 0, error_rate=1.5)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_server_answers_forged_result_streams_with_typed_errors(server):
    """Deep nesting and a record without ``status``, written by the model's code to the runner's records fd: the
    real server answers ``malformed_output`` and the session plays on (no ``Server error``)."""
    from tests.test_sandbox_output import PAYLOADS, _forge

    with CodingEnvClient(base_url=server.url).sync() as env:
        env.reset(seed=0, episode_id="0", task_id="slugify", max_tool_calls=10)
        for name in ("deep_nesting", "test_without_status"):
            env.step(CodingAction(tool="write_file", arguments={"path": "solution.py", "content": _forge(PAYLOADS[name])}))
            obs = env.step(CodingAction(tool="run_tests", arguments={})).observation
            assert (obs.error_kind, obs.error_meta["reason"]) == ("execution_error", "malformed_output"), obs.content
        result = env.step(CodingAction(tool="submit", arguments={}))
        assert result.done and result.reward == 0.0
