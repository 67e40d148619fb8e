"""Env session capacity, and env failures that end one episode, not the step.

An OpenEnv server holds ``MAX_CONCURRENT_ENVS`` sessions; a node learns it from ``Server at capacity: n/n`` (or takes
``--env-sessions``) and plays a step's episodes in waves of the sessions it holds. A server that refuses a node's
first session fails the join in one line with the fix. Served by `tests/mcp_env_server.py` (``--max-concurrent-envs``)
and a typed env of this project built with the same OpenEnv ``create_app`` argument.
"""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest

from composer_diloco.rollout import episodes as rollout

from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.env_process import find_free_port
from composer_diloco.rollout.episodes import EnvSession
from composer_diloco.rollout.mcp import McpEnvSession
from composer_diloco.rollout.sessions import EnvCapacityError, capacity_of, open_env_sessions
from local_run import LocalRun
from test_mcp_env import SMOKE, _tool_suffix, start_mcp_server
from tests_support import serve, stop_processes



def start_typed_server(max_sessions: int) -> tuple[subprocess.Popen, str]:
    """``envs/tool_env``'s environment under OpenEnv's ``create_app(..., max_concurrent_envs=max_sessions)``."""
    port = find_free_port()
    code = ("import uvicorn; from openenv.core.env_server.http_server import create_app; "
            "from envs.tool_env.models import ToolAction, ToolObservation, ToolState; "
            "from envs.tool_env.server.tool_environment import ToolEnvironment; "
            f"uvicorn.run(create_app(ToolEnvironment, ToolAction, ToolObservation, env_name='tool_env', "
            f"max_concurrent_envs={max_sessions}, state_cls=ToolState), host='127.0.0.1', port={port}, "
            "log_level='warning')")
    return serve(["-c", code], port)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["mcp", "typed"])
def test_a_node_learns_the_capacity_and_a_full_server_is_an_error_with_the_fix(kind):
    proc, url = start_mcp_server("--max-concurrent-envs", "3") if kind == "mcp" else start_typed_server(3)
    try:
        sessions = open_env_sessions([url], 8, max_tool_calls=4)
        try:
            assert len(sessions) == 3  # the server's capacity, learnt from its refusal of the 4th
            with pytest.raises(EnvCapacityError) as info:  # every slot is held: the first session is refused
                open_env_sessions([url], 8, max_tool_calls=4)
            message = str(info.value)
            assert "\n" not in message and url in message and "Server at capacity: 3/3 sessions active" in message
            assert "start the server with MAX_CONCURRENT_ENVS >= 8" in message and "more --env-url" in message
            assert capacity_of(info.value) == (3, 3)
        finally:
            for s in sessions:
                s.close()
        capped = open_env_sessions([url], 8, max_tool_calls=4, per_url=2)  # --env-sessions 2
        try:
            assert len(capped) == 2
        finally:
            for s in capped:
                s.close()
    finally:
        stop_processes([proc])


class _FailingCalls(EnvSession):
    """A real session whose ``call`` raises for one episode, as OpenEnv's client does when the server's step
    raises (``Server error: ...``)."""

    def __init__(self, inner: EnvSession, bad_episode: str):
        self.inner, self.bad, self.current, self.url = inner, bad_episode, "", getattr(inner, "url", "")

    def reset(self, seed, episode_id):
        self.current = episode_id
        return self.inner.reset(seed, episode_id)

    def call(self, tool, arguments):
        if self.current == self.bad:
            raise RuntimeError("Server error: KeyError: 'result' (code: EXECUTION_ERROR)")
        return self.inner.call(tool, arguments)

    def close(self):
        self.inner.close()


@pytest.mark.timeout(180)
def test_episodes_play_in_waves_and_an_env_failure_ends_only_its_episode(monkeypatch):
    """8 episodes on 2 sessions: 4 waves, in key order; the episode whose call fails ends with reward 0."""
    from composer_diloco.inner.step import RoundStats
    from composer_diloco.policy import load_default_tokenizer
    from mcp_env_server import answer_of

    tok = load_default_tokenizer()
    keys = [(3, f"w{i}") for i in range(8)]
    calls = itertools.count()

    def scripted_generate(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        wave = next(calls)
        ids = []
        for i, context in enumerate(contexts):  # submit the right answer: the waves play the keys in order, 2 by 2
            key = keys[2 * wave + i]
            assert _question(key) in tok.decode(context)
            call = {"name": "submit", "arguments": {"answer": answer_of(*key)}}
            ids.append(tok("<tool_call>\n" + json.dumps(call) + "\n</tool_call>", add_special_tokens=False)
                       ["input_ids"] + [tok.eos_token_id])
        return ids, [[-0.5] * len(i) for i in ids]

    proc, url = start_mcp_server("--max-concurrent-envs", "2")
    try:
        sessions = [_FailingCalls(s, "w5") for s in open_env_sessions([url], 8, max_tool_calls=3)]
        assert len(sessions) == 2
        monkeypatch.setattr(rollout, "generate_turns", scripted_generate)
        try:
            episodes = play_episodes(None, tok, sessions, keys, tool_suffix_ids=_tool_suffix(tok),
                                             max_tool_calls=3, max_turn_tokens=64, max_seq_len=2048, temperature=1.0)
        finally:
            for s in sessions:
                s.close()
    finally:
        stop_processes([proc])
    assert [(e.seed, e.episode_id) for e in episodes] == keys
    assert next(calls) == 4  # one generate per wave of 2 (each episode submits at its first turn)
    assert [(e.end_reason, e.reward) for e in episodes] == [("done", 1.0)] * 5 + [("env_error", 0.0)] + \
        [("done", 1.0)] * 2
    stats = RoundStats((), 8)
    stats.add_episodes(episodes)
    assert stats.record()["episodes_env_error"] == 1


def _question(key: tuple[int, str]) -> str:
    from mcp_env_server import question_of

    return question_of(*key)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_node_of_8_episodes_trains_on_a_server_of_1_session_and_a_second_node_is_told_why_not(run_dir):
    server, url = start_mcp_server("--max-concurrent-envs", "1", log_path=run_dir / "mcp-server.log")
    run = LocalRun(run_dir, SMOKE)
    try:
        run.start_coordinator("--rounds", "1", wait=False)  # the node starts beside it (the suite's time)
        held = McpEnvSession(url, max_tool_calls=4)  # someone else holds the only session
        try:
            run.start_node("node-refused", "--env-url", url)
            run.wait_peer_line()
            assert run.wait_exit("node-refused", timeout_s=240) == 1
        finally:
            held.close()
        last = run.log_tail("node-refused", 1)
        assert last.startswith(f"composer-node: error: env server at {url} refused this node's first session "
                               "(Server at capacity: 1/1 sessions active)"), last
        assert "MAX_CONCURRENT_ENVS >= 8" in last
        run.start_node("node-0", "--env-url", url)
        assert run.wait_exit("node-0", timeout_s=480) == 0, run.all_tails()
        assert run.wait_exit("coordinator", timeout_s=120) == 0, run.all_tails()
        (record,) = run.records()["node-0"]
        assert record["samples"] == 8 * record["inner_steps"] and record["episodes_without_tool_call"] < 8
        assert "it plays them in waves of 1" in run.log("node-0")
        print(f"\ncapacity 1, 8 episodes per step: round 0 reward {record['mean_reward']:.3f}, inner "
              f"{record['inner_seconds']:.1f} s")
    finally:
        run.stop()
        stop_processes([server])
