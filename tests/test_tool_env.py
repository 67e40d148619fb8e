"""Tests of the tool environment: pure task logic, and a real server process over WebSocket."""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
from collections import Counter

import pytest
from pydantic import ValidationError

from composer_diloco.rollout.env_process import (
    EnvServerError,
    find_free_port,
    start_env_server,
    wait_for_env,
)
from envs.tool_env import TOOL_SCHEMAS, ToolAction, ToolEnvClient, execute, make_task, solve
from envs.tool_env.tasks import ITEM_VOCAB, OPS

QUESTION_RE = re.compile(r"^What is the price of (\w+) (plus|minus|times) the price of (\w+)\?$")


def _correct_calls(task):
    return solve(task, random.Random(0), error_rate=0.0)


# ----------------------------------------------------------------------------- pure tasks.py


def test_make_task_is_reproducible_and_well_formed():
    for episode in range(50):
        task = make_task(7, str(episode))
        assert task == make_task(7, str(episode))
        assert len(task.catalogue) == 4 and set(task.catalogue) <= set(ITEM_VOCAB)
        assert all(1 <= price <= 9 for price in task.catalogue.values())
        assert task.x != task.y and {task.x, task.y} <= set(task.catalogue)
        match = QUESTION_RE.match(task.question)
        assert match and match.groups() == (task.x, OPS[task.op], task.y)
        a, b = task.catalogue[task.x], task.catalogue[task.y]
        assert task.answer == {"add": a + b, "subtract": a - b, "multiply": a * b}[task.op]
    questions = {make_task(7, str(e)).question for e in range(50)}
    assert len(questions) > 30
    assert make_task(7, "1") != make_task(8, "1")
    assert {make_task(0, str(e)).op for e in range(50)} == set(OPS)


def test_tool_schemas_are_openai_function_format():
    names = [s["function"]["name"] for s in TOOL_SCHEMAS]
    assert names == ["lookup", "add", "subtract", "multiply", "submit"]
    for schema in TOOL_SCHEMAS:
        assert schema["type"] == "function"
        params = schema["function"]["parameters"]
        assert params["type"] == "object"
        assert set(params["required"]) == set(params["properties"])
        assert schema["function"]["description"]


def test_execute_success_and_each_error_kind():
    task = make_task(0, "0")
    px = task.catalogue[task.x]
    assert execute(task, "lookup", {"item": task.x}) == (str(px), None, {})
    assert execute(task, "multiply", {"a": 3, "b": -4}) == ("-12", None, {})
    assert execute(task, "submit", {"answer": 5}) == ("submitted 5", None, {})

    content, kind, meta = execute(task, "sum", {"a": 1, "b": 2})
    assert kind == "tool_not_found" and meta["tool"] == "sum"
    assert meta["available_tools"] == ["lookup", "add", "subtract", "multiply", "submit"]
    assert content == "error: " + meta["message"]

    bad_args = [{"a": 1}, {"a": 1, "b": 2, "c": 3}, {"x": 1, "b": 2}, {"a": "1", "b": 2},
                {"a": True, "b": 2}, {"a": 1.0, "b": 2}, ["a", "b"]]
    for args in bad_args:
        content, kind, meta = execute(task, "add", args)
        assert kind == "invalid_args", args
        assert meta["tool"] == "add" and meta["expected_schema"]["required"] == ["a", "b"]
        assert content.startswith("error: invalid arguments for add")

    missing = next(item for item in ITEM_VOCAB if item not in task.catalogue)
    content, kind, meta = execute(task, "lookup", {"item": missing})
    assert kind == "execution_error" and meta["tool"] == "lookup"
    assert f"unknown item '{missing}'; known items: " in meta["message"]
    assert all(item in meta["message"] for item in task.catalogue)


def test_solve_without_errors_is_the_four_call_solution():
    task = make_task(1, "2")
    calls = solve(task, random.Random(3), error_rate=0.0)
    assert [tool for tool, _ in calls] == ["lookup", "lookup", task.op, "submit"]
    assert calls[-1] == ("submit", {"answer": task.answer})
    assert [execute(task, t, a)[1] for t, a in calls] == [None] * 4


def test_solve_with_errors_inserts_exactly_one_recoverable_error():
    kinds = Counter()
    for episode in range(200):
        task = make_task(5, str(episode))
        calls = solve(task, random.Random(episode), error_rate=1.0)
        outcomes = [execute(task, tool, args)[1] for tool, args in calls]
        errors = [i for i, kind in enumerate(outcomes) if kind is not None]
        assert len(calls) == 5 and len(errors) == 1
        kinds[outcomes[errors[0]]] += 1
        # Dropping the failed call leaves the correct solution, so the next call is the recovery.
        assert calls[: errors[0]] + calls[errors[0] + 1 :] == _correct_calls(task)
    assert set(kinds) == {"tool_not_found", "invalid_args", "execution_error"}
    with pytest.raises(ValueError, match="error_rate"):
        solve(make_task(0, "0"), random.Random(0), error_rate=1.5)


def test_tool_action_rejects_unknown_fields():
    with pytest.raises(ValidationError):
        ToolAction(tool="add", arguments={}, extra_field=1)


# ----------------------------------------------------------------------------- real server


@pytest.fixture(scope="module")
def server():
    """One tool-env server process for the module, stopped in finally."""
    srv = start_env_server("envs.tool_env.server", startup_timeout_s=60.0)
    try:
        yield srv
    finally:
        srv.stop()


def _play(env, calls):
    return [env.step(ToolAction(tool=tool, arguments=args)) for tool, args in calls]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_reset_returns_question_and_tools(server):
    with ToolEnvClient(base_url=server.url).sync() as env:
        result = env.reset(seed=11, episode_id="3")
        obs = result.observation
        assert obs.question == make_task(11, "3").question
        assert obs.tools == TOOL_SCHEMAS
        assert not result.done and result.reward is None
        state = env.state()
        assert (state.seed, state.episode_id, state.tool_calls, state.done) == (11, "3", 0, False)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_scripted_solve_gets_reward_one_and_wrong_answer_zero(server):
    task = make_task(2, "9")
    with ToolEnvClient(base_url=server.url).sync() as env:
        env.reset(seed=2, episode_id="9")
        results = _play(env, _correct_calls(task))
        assert [r.done for r in results] == [False, False, False, True]
        assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
        assert results[0].observation.content == str(task.catalogue[task.x])
        assert results[-1].observation.metadata["end_reason"] == "submitted"
        with pytest.raises(RuntimeError, match="is over"):
            env.step(ToolAction(tool="submit", arguments={"answer": task.answer}))

        env.reset(seed=2, episode_id="9")  # same session, next episode
        (result,) = _play(env, [("submit", {"answer": task.answer + 1})])
        assert result.done and result.reward == 0.0
        assert env.state().submitted_answer == task.answer + 1


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_error_kinds_carry_metadata_and_count_towards_budget(server):
    task = make_task(4, "1")
    missing = next(item for item in ITEM_VOCAB if item not in task.catalogue)
    with ToolEnvClient(base_url=server.url).sync() as env:
        env.reset(seed=4, episode_id="1")
        not_found, invalid, wrong_type, unknown_item = _play(env, [
            ("sum", {"a": 1, "b": 2}),
            ("add", {"a": 1}),
            ("submit", {"answer": True}),
            ("lookup", {"item": missing}),
        ])
        assert not_found.observation.error_kind == "tool_not_found"
        assert "lookup" in not_found.observation.error_meta["available_tools"]
        assert invalid.observation.error_kind == "invalid_args"
        assert invalid.observation.error_meta["expected_schema"]["required"] == ["a", "b"]
        assert "missing argument(s) b" in invalid.observation.content
        assert wrong_type.observation.error_kind == "invalid_args"
        assert unknown_item.observation.error_kind == "execution_error"
        assert "known items" in unknown_item.observation.error_meta["message"]
        assert not any(r.done for r in (not_found, invalid, wrong_type, unknown_item))

        rest = _play(env, [("get", {})] * 4)  # calls 5..8 of the default budget of 8
        assert [r.done for r in rest] == [False, False, False, True]
        assert rest[-1].reward == 0.0
        assert rest[-1].observation.metadata["end_reason"] == "max_tool_calls"

        env.reset(seed=4, episode_id="1", max_tool_calls=1)
        (only,) = _play(env, [("lookup", {"item": task.x})])
        assert only.done and only.reward == 0.0


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_reset_is_reproducible_across_sessions(server):
    questions = []
    for _ in range(2):
        with ToolEnvClient(base_url=server.url).sync() as env:
            questions.append([env.reset(seed=9, episode_id=str(e)).observation.question
                              for e in range(8)])
    assert questions[0] == questions[1]
    assert len(set(questions[0])) > 1
    with ToolEnvClient(base_url=server.url).sync() as env:
        with pytest.raises(RuntimeError, match="bogus"):
            env.reset(seed=9, episode_id="0", bogus=1)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_concurrent_sessions_in_threads_each_solve_their_episode(server):
    n_sessions = 6
    barrier = threading.Barrier(n_sessions, timeout=30)
    rewards: dict[int, float] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            task = make_task(21, str(index))
            with ToolEnvClient(base_url=server.url).sync() as env:
                obs = env.reset(seed=21, episode_id=str(index)).observation
                assert obs.question == task.question
                barrier.wait()  # all sessions are open on the server at once
                calls = solve(task, random.Random(index), error_rate=0.5)
                rewards[index] = _play(env, calls)[-1].reward
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=45)
    assert not errors, errors
    assert rewards == {i: 1.0 for i in range(n_sessions)}


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_concurrent_sessions_with_async_clients(server):
    async def episode(index: int) -> float:
        task = make_task(33, str(index))
        async with ToolEnvClient(base_url=server.url) as env:
            await env.reset(seed=33, episode_id=str(index))
            result = None
            for tool, args in _correct_calls(task):
                result = await env.step(ToolAction(tool=tool, arguments=args))
            return result.reward

    async def main() -> list[float]:
        return await asyncio.gather(*(episode(i) for i in range(4)))

    assert asyncio.run(main()) == [1.0] * 4


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_solver_with_errors_recovers_through_the_server(server):
    with ToolEnvClient(base_url=server.url).sync() as env:
        for episode in range(6):
            task = make_task(13, str(episode))
            env.reset(seed=13, episode_id=str(episode))
            results = _play(env, solve(task, random.Random(episode), error_rate=1.0))
            assert sum(r.observation.error_kind is not None for r in results) == 1
            assert results[-1].done and results[-1].reward == 1.0


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_rollout_session_sees_what_the_typed_client_sees(server):
    """The core's `OpenEnvSession` reads the protocol's JSON fields (no env import): every value equals the typed
    client's, errors and their metadata included."""
    from composer_diloco.rollout.episodes import OpenEnvSession

    task = make_task(6, "2")
    calls = [("sum", {"a": 1}), ("add", {"a": 1}), ("lookup", {"item": "zzz"})] + _correct_calls(task)
    session = OpenEnvSession(server.url, max_tool_calls=8)
    try:
        with ToolEnvClient(base_url=server.url).sync() as env:
            obs = env.reset(seed=6, episode_id="2", max_tool_calls=8).observation
            assert session.reset(6, "2") == (obs.question, obs.tools)
            for tool, args in calls:
                typed = env.step(ToolAction(tool=tool, arguments=args))
                o = typed.observation
                assert session.call(tool, args) == (o.content, o.error_kind, o.error_meta, typed.reward, typed.done)
        assert typed.done and typed.reward == 1.0
    finally:
        session.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_local_session_plays_as_the_served_env(server):
    """`EnvPackage.local_session` (the env in this process, for evaluation) answers as the server does."""
    from composer_diloco.rollout.env_package import load_env_package
    from composer_diloco.rollout.episodes import OpenEnvSession

    task = make_task(8, "5")
    calls = [("sum", {"a": 1}), ("add", {"a": 1}), ("lookup", {"item": "zzz"})] + _correct_calls(task)
    served = OpenEnvSession(server.url, max_tool_calls=8)
    local = load_env_package("envs.tool_env.server").local_session(max_tool_calls=8)
    try:
        assert local.reset(8, "5") == served.reset(8, "5")
        assert [local.call(*c) for c in calls] == [served.call(*c) for c in calls]
    finally:
        served.close()
        local.close()


# ----------------------------------------------------------------------------- process lifecycle


@pytest.mark.timeout(10)
def test_wait_for_env_on_dead_port_fails_fast():
    url = f"http://127.0.0.1:{find_free_port()}"
    start = time.monotonic()
    with pytest.raises(EnvServerError, match=f"env server at {re.escape(url)} not reachable"):
        wait_for_env(url, timeout_s=0.5)
    assert time.monotonic() - start < 5.0


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_start_failure_reports_url_and_output():
    with pytest.raises(EnvServerError) as info:
        start_env_server("no_such_env_module", startup_timeout_s=20.0)
    message = str(info.value)
    assert "env server at http://127.0.0.1:" in message and "No module named" in message


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_stop_ends_the_server_process_and_keeps_only_a_log_the_caller_named(tmp_path):
    """Its output goes to a temp file `stop` removes, or to the caller's ``log_path`` (a node's
    ``<run-dir>/<name>/env-server.log``), emptied at start and kept after `stop`."""
    srv = start_env_server(startup_timeout_s=60.0)
    named = tmp_path / "node-a" / "env-server.log"
    named.parent.mkdir()  # a node's folder
    named.write_text("the output of an earlier life\n")
    kept = start_env_server(startup_timeout_s=60.0, log_path=named)
    try:
        assert srv.running and kept.log_path == named
        wait_for_env(srv.url, timeout_s=5.0)
    finally:
        srv.stop(timeout_s=10.0)
        kept.stop(timeout_s=10.0)
    assert not srv.running and not srv.log_path.exists()
    assert named.exists() and "earlier life" not in named.read_text(), named.read_text()
    with pytest.raises(EnvServerError):
        start_env_server("no_such_env_module", startup_timeout_s=20.0, log_path=named)
    assert "No module named" in named.read_text()  # the failed server's output, kept after its stop
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.pid, 0)
    srv.stop()  # idempotent
    with pytest.raises(EnvServerError, match="not reachable"):
        wait_for_env(srv.url, timeout_s=0.3)
