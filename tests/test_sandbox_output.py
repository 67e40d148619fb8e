"""The server parses what comes out of the coding sandbox defensively: forged result streams, written by the model's
own code to the runner's records file descriptor, become typed tool errors, never exceptions in the server."""

from __future__ import annotations

import json

import pytest

from envs.coding_env import CodingAction, SandboxLimits, execute, make_task
from envs.coding_env.sandbox import MAX_JSON_DEPTH, parse_json
from envs.coding_env.server import CodingEnvironment

FAST = SandboxLimits(wall_time_s=6.0, cpu_time_s=3, per_test_timeout_s=1.0, memory_mb=256, max_file_mb=4)
SLUGIFY = make_task(0, "0", task_id="slugify")

# The model's solution writes PAYLOAD (bytes built from the runner's pid) to the records fd, then answers.
FORGER = """
import os, stat

def _records_fd():
    output = os.fstat(2).st_ino  # fds 1 and 2: the code's output file; the records file is the other one
    for fd in range(3, 64):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_ino != output:
            return fd
    raise RuntimeError("no records fd")

def slugify(text):
    pid = os.getpid()
    try:
        os.write(_records_fd(), {payload})
    except OSError:  # the file-size limit
        pass
    return '-'.join(text.lower().split())
"""

PAYLOADS = {
    "deep_nesting": "b'[' * 100000 + b'\\n'",
    "deep_inside_a_record": "b'{\"type\": \"start\", \"pid\": %d, \"name\": ' % pid + b'[' * 100000 + b'\\n'",
    "test_without_status": "b'{\"type\": \"test\", \"pid\": %d, \"name\": \"test_x\"}\\n' % pid",
    "test_without_name": "b'{\"type\": \"test\", \"pid\": %d, \"status\": \"failed\"}\\n' % pid",
    "huge_line": "b'{\"type\": \"start\", \"pid\": %d, \"name\": \"' % pid + b'x' * (2 << 20) + b'\"}\\n'",
    "not_json": "b'\\xff\\xfe not json at all\\n'",
    "not_an_object": "b'[1, 2, 3]\\n'",
    "unknown_type": "b'{\"type\": \"victory\", \"pid\": %d}\\n' % pid",
    "wrong_field_type": "b'{\"type\": \"test\", \"pid\": %d, \"name\": [\"a\"], \"status\": \"passed\"}\\n' % pid",
    "too_much_in_all": "(b'{\"type\": \"start\", \"pid\": %d, \"name\": \"x\"}\\n' % pid) * 200000",
}


def _forge(payload: str) -> str:
    return FORGER.replace("{payload}", payload)


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_forged_stream_in_run_tests_is_a_typed_error(name):
    files = SLUGIFY.files()
    files["solution.py"] = _forge(PAYLOADS[name])
    out = execute(SLUGIFY, files, "run_tests", {}, FAST)
    assert (out.error_kind, out.error_meta["reason"]) == ("execution_error", "malformed_output"), out.content
    assert out.content.startswith("error: the run's output was malformed") and out.error_meta["detail"]


@pytest.mark.parametrize("payload", [
    "b'{\"type\": \"case\", \"pid\": %d, \"index\": 0, \"status\": \"ok\"}\\n' % pid",  # no result
    "b'{\"type\": \"case\", \"pid\": %d, \"status\": \"ok\", \"result\": \"1\"}\\n' % pid",  # no index
    "b'{\"type\": \"case\", \"pid\": %d, \"index\": 0, \"status\": \"won\", \"result\": \"1\"}\\n' % pid",
    "b'{\"type\": \"case\", \"pid\": %d, \"index\": 0, \"status\": \"ok\", \"result\": 7}\\n' % pid",
], ids=["no_result", "no_index", "bad_status", "result_not_text"])
def test_forged_case_records_in_submit_are_a_typed_error_with_reward_zero(payload):
    files = SLUGIFY.files()
    files["solution.py"] = _forge(payload)
    out = execute(SLUGIFY, files, "submit", {}, FAST)
    assert out.submitted and out.error_kind == "execution_error" and out.error_meta["reason"] == "malformed_output"
    assert out.content.startswith("error: submitted: ")


def test_a_forged_deep_result_does_not_pass_and_does_not_crash():
    """A well-formed case record whose result text nests deeper than the server's comparisons may recurse."""
    deep = json.dumps("[" * 5000 + "]" * 5000)
    payload = ("b'{\"type\": \"case\", \"pid\": %d, \"index\": 0, \"status\": \"ok\", \"result\": ' % pid + "
               f"{deep.encode()!r} + b'}}\\n'")
    files = SLUGIFY.files()
    files["solution.py"] = _forge(payload).replace("return '-'.join(text.lower().split())", "return None")
    out = execute(SLUGIFY, files, "submit", {}, FAST)
    assert out.submitted and out.hidden_passed == 0, out.content


def test_parse_json_bounds():
    assert parse_json('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    for text, match in [("[" * 100000, "deeper"), ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "deeper"),
                        ("x" * 100, "Expecting value"), ('"' + "x" * 70 + '"', "over the limit")]:
        with pytest.raises(ValueError, match=match):
            parse_json(text, max_chars=60 if "over" in match else 10**6)
    with pytest.raises(ValueError, match="expected JSON text"):
        parse_json(b"[]")


def test_environment_step_survives_a_forged_stream_and_plays_on():
    env = CodingEnvironment(limits=FAST)
    env.reset(seed=0, episode_id="0", task_id="slugify")
    env.step(CodingAction(tool="write_file", arguments={"path": "solution.py",
                                                        "content": _forge(PAYLOADS["deep_nesting"])}))
    obs = env.step(CodingAction(tool="run_tests", arguments={}))
    assert (obs.error_kind, obs.error_meta["reason"], obs.done) == ("execution_error", "malformed_output", False)
    obs = env.step(CodingAction(tool="submit", arguments={}))
    assert obs.done and obs.reward == 0.0 and obs.error_meta["reason"] == "malformed_output"


def test_environment_step_turns_a_server_side_failure_into_a_typed_error(monkeypatch):
    """The last line of defence: whatever raises inside a call is an ``internal_error``, not a server error."""
    import envs.coding_env.server.coding_environment as module

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    env = CodingEnvironment(limits=FAST)
    env.reset(seed=0, episode_id="0", task_id="slugify")
    monkeypatch.setattr(module, "execute", broken)  # a full /tmp cannot be made for real in a test
    obs = env.step(CodingAction(tool="run_tests", arguments={}))
    assert (obs.error_kind, obs.error_meta["reason"]) == ("execution_error", "internal_error")
    assert "No space left on device" in obs.content and env.state.tool_calls == 1
