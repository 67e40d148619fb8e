"""Any OpenEnv MCP tool server: `composer_diloco.rollout.mcp` against `tests/mcp_env_server.py`, an `MCPEnvironment`
with FastMCP tools served by OpenEnv as its own process.

The session lists the tools (``MCPToolClient.list_tools()``, over ``/mcp``), renders them into the chat template,
calls them (``CallToolAction``), maps OpenEnv's typed ``ToolError``s to the hint kinds, takes reward and done from the
observations; `play_episodes` plays episodes with the embedded tiny policy; `open_env_sessions` tells an MCP server
from this project's typed environments (from their ``/schema`` and ``/mcp``); and a node trains a round against the
MCP server through ``--env-url``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from trl import GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

from composer_diloco.rollout import episodes as rollout

from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.env_process import find_free_port, start_env_server
from composer_diloco.channels.hints import DEFAULT_HINTS
from composer_diloco.rollout.mcp import (
    TOOL_ERROR_KINDS,
    McpEnvSession,
    NotAnMcpServer,
    tool_error_kind,
    tool_result_text,
    tool_schema,
)
from composer_diloco.rollout.sessions import open_env_session, open_env_sessions
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.rollout.episodes import OpenEnvSession
from envs.tool_env.tasks import TOOL_SCHEMAS
from mcp_env_server import answer_of, question_of
import prefork
from tests_support import serve, stop_processes

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
SERVER = Path(__file__).resolve().parent / "mcp_env_server.py"
SEED = 5


def start_mcp_server(*extra: str, log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``python tests/mcp_env_server.py --port P ...`` in its own process group; returns it and its URL once
    ``/health`` answers (the process is stopped if it does not within 60 s)."""
    port = find_free_port()
    return serve([str(SERVER), "--host", "127.0.0.1", "--port", str(port), *extra], port, log_path)


@pytest.fixture(scope="module")
def mcp_url():
    """The URL of one `tests/mcp_env_server.py` process shared by this module's tests."""
    proc, url = start_mcp_server()
    try:
        yield url
    finally:
        stop_processes([proc])


@pytest.fixture
def session(mcp_url):
    """A fresh `McpEnvSession` on the module's server, closed after the test."""
    s = McpEnvSession(mcp_url, max_tool_calls=6)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def tok():
    """The embedded default's tokenizer (Qwen3 chat template with tools)."""
    return load_default_tokenizer()


# ------------------------------------------------------------------------------------------------- pure parts


@pytest.mark.timeout(10)
def test_every_openenv_tool_error_type_maps_to_a_hinted_kind():
    from openenv.core.env_server.mcp_types import ToolErrorType

    for t in ToolErrorType:
        kind = tool_error_kind(t)
        assert kind in DEFAULT_HINTS, (t, kind)
        assert kind == TOOL_ERROR_KINDS[t.value]
    for name in ("tool_not_found", "invalid_args", "execution_error", "timeout"):
        assert tool_error_kind(ToolErrorType(name)) == name  # OpenEnv's names are the hint kinds
    assert tool_error_kind("transport_error") == "execution_error"
    assert tool_error_kind("something_new") == "execution_error"


@pytest.mark.timeout(10)
def test_tool_result_text():
    fastmcp_result = {"content": [{"type": "text", "text": "9", "annotations": None}], "structured_content":
                      {"result": 9}, "data": 9, "is_error": False}
    assert tool_result_text(fastmcp_result) == "9"
    assert tool_result_text({"content": [{"type": "text", "text": "a"}, {"type": "image", "data": "x"}]}) == \
        'a\n{"type": "image", "data": "x"}'
    assert tool_result_text({"data": [1, 2]}) == "[1, 2]"
    assert tool_result_text("plain") == "plain"
    assert tool_result_text(7) == "7"
    assert tool_result_text({"a": 1}) == '{"a": 1}'
    assert tool_result_text(None) == ""


@pytest.mark.timeout(10)
def test_task_text_of_a_reset_observation():
    from openenv.core.mcp_client import GenericMCPObservation

    from composer_diloco.rollout.mcp import McpProtocolError, _question

    assert _question(GenericMCPObservation(metadata={"question": "Q?"}), "u") == "Q?"
    assert _question(GenericMCPObservation(task="T", metadata={"question": "Q?"}), "u") == "T"  # a field first
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Add 2 and 3."}]
    assert _question(GenericMCPObservation(metadata={"prompt": chat}), "u") == "Add 2 and 3."
    with pytest.raises(McpProtocolError, match=r"no task text.*metadata keys \['score'\]"):
        _question(GenericMCPObservation(metadata={"score": 1}), "http://h:1")


# ----------------------------------------------------------------------------------- against the server process


@pytest.mark.timeout(120)
def test_session_lists_tools_and_the_prompt_renders_them(session, tok):
    assert session.tool_names == ["lookup", "add", "subtract", "multiply", "submit"]
    question, tools = session.reset(SEED, "q")
    assert question == question_of(SEED, "q")
    add = next(t for t in tools if t["function"]["name"] == "add")
    assert add["type"] == "function" and add["function"]["description"] == "Return a + b."
    assert add["function"]["parameters"]["required"] == ["a", "b"]
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tools=tools, tokenize=False,
                                     add_generation_prompt=True)
    for name in ("lookup", "add", "submit"):
        assert f'"name": "{name}"' in prompt
    assert question in prompt
    # The same tools render the same prompt as the typed tool_env lists them (canonical schema key order, no
    # pydantic titles or FastMCP additionalProperties), so a policy trained on one plays the other.
    assert tools == TOOL_SCHEMAS
    assert tool_schema(SimpleNamespace(name="f", description="d", input_schema={
        "additionalProperties": False, "required": ["x"], "title": "F",
        "properties": {"x": {"description": "an x", "type": "array", "items": {"title": "X", "type": "integer"}}},
        "type": "object"})) == {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"x": {"type": "array", "description": "an x", "items": {"type": "integer"}}},
            "required": ["x"]}}}


@pytest.mark.timeout(120)
def test_calls_map_typed_errors_to_hint_kinds_and_reward_at_submit(session):
    session.reset(SEED, "e")
    catalogue_item = question_of(SEED, "e").split("price of ")[1].split(" ")[0]

    content, kind, meta, reward, done = session.call("lookup", {"item": "durian"})  # the tool raises ToolError
    assert (kind, reward, done) == ("execution_error", 0.0, False)
    assert content.startswith("error: no item 'durian'") and meta["tool"] == "lookup"
    assert DEFAULT_HINTS.hint(kind, meta).startswith("lookup failed: no item 'durian'")

    content, kind, meta, _, _ = session.call("add", {"a": 1})  # FastMCP's validation: missing argument
    assert kind == "invalid_args" and meta["expected_schema"]["required"] == ["a", "b"]
    assert DEFAULT_HINTS.hint(kind, meta).startswith("Call add(a: integer, b: integer).")

    content, kind, meta, _, _ = session.call("sum", {"a": 1, "b": 2})
    assert kind == "tool_not_found" and meta["available_tools"] == ["lookup", "add", "subtract", "multiply", "submit"]
    assert DEFAULT_HINTS.hint(kind, meta) == "There is no tool 'sum'. Use one of: lookup, add, subtract, multiply, submit."

    content, kind, meta, reward, done = session.call("lookup", {"item": catalogue_item})
    assert kind is None and meta == {} and content.isdigit() and (reward, done) == (0.0, False)
    assert session.call("add", {"a": 2, "b": 3})[:2] == ("5", None)

    content, kind, _, reward, done = session.call("submit", {"answer": answer_of(SEED, "e")})
    assert (content, kind, reward, done) == ("submitted", None, 1.0, True)

    session.reset(SEED, "e")  # the same episode again: a wrong answer ends it with reward 0
    assert session.call("submit", {"answer": answer_of(SEED, "e") + 1})[3:] == (0.0, True)


@pytest.mark.timeout(120)
def test_a_slow_tool_call_maps_to_timeout():
    proc, url = start_mcp_server("--tool-timeout-s", "0.000001")  # every call outlives OpenEnv's wait_for
    try:
        s = McpEnvSession(url, max_tool_calls=6)
        try:
            s.reset(SEED, "t")
            content, kind, meta, reward, done = s.call("add", {"a": 1, "b": 2})
        finally:
            s.close()
    finally:
        stop_processes([proc])
    assert kind == "timeout" and (reward, done) == (0.0, False) and "timed out" in content
    assert meta["timeout_s"] == pytest.approx(1e-6)
    assert DEFAULT_HINTS.hint(kind, meta).startswith("add timed out after 1e-06 s.")


@pytest.mark.timeout(120)
def test_open_env_sessions_detects_mcp_and_keeps_typed_envs_on_openenv_session(mcp_url):
    tool_env = start_env_server()
    sessions = []
    try:
        sessions = open_env_sessions([mcp_url, tool_env.url], 4, max_tool_calls=6)
        assert [type(s) for s in sessions] == [McpEnvSession, OpenEnvSession] * 2
        question, tools = sessions[1].reset(SEED, "x")  # the typed env plays as before
        assert tools[0]["function"]["name"] == "lookup" and question.startswith("What is the price of")
        with pytest.raises(NotAnMcpServer, match=r"is not an OpenEnv MCP tool server: /mcp tools/list answered error "
                                                 r"'Environment does not support MCP'"):
            open_env_session(tool_env.url, max_tool_calls=6, protocol="mcp")
    finally:
        for s in sessions:
            s.close()
        tool_env.stop()


def _tool_suffix(tok):
    """The trainer's rendering of tool replies (TRL's ``GRPOTrainer._get_tool_suffix_ids``), as the rollout gets it."""
    template = None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)
    trl_self = SimpleNamespace(processing_class=tok, chat_template=template, chat_template_kwargs={}, _is_vlm=False,
                               _tokenizer=tok)
    return lambda msgs: GRPOTrainer._get_tool_suffix_ids(trl_self, msgs)


@pytest.mark.timeout(180)
def test_tiny_policy_plays_episodes_against_the_server(mcp_url, tok):
    model = build_tiny_model(tok, seed=0)
    keys = [(SEED, f"p{i}") for i in range(4)]
    sessions = open_env_sessions([mcp_url], len(keys), max_tool_calls=3)
    try:
        episodes = play_episodes(model, tok, sessions, keys, tool_suffix_ids=_tool_suffix(tok),
                                         max_tool_calls=3, max_turn_tokens=24, max_seq_len=1024, temperature=1.0)
    finally:
        for s in sessions:
            s.close()
    assert len(episodes) == len(keys)
    for ep, (seed, episode_id) in zip(episodes, keys):
        ep.check()
        assert ep.turns[0].content == question_of(seed, episode_id)
        assert [t["function"]["name"] for t in ep.tools] == ["lookup", "add", "subtract", "multiply", "submit"]
        assert '"name": "submit"' in ep.prompt_text
        assert sum(ep.env_mask) > 0 and ep.end_reason in {"done", "no_tool_call", "truncated", "max_tool_calls",
                                                          "max_seq_len"}
        assert 0.0 <= ep.reward <= 1.0


@pytest.mark.timeout(180)
def test_scripted_episode_through_play_episodes_and_trace_replay(mcp_url, tok, monkeypatch):
    """Tool replies, error kinds and the final reward reach the episode; replaying it reproduces every reply."""
    from composer_diloco.channels.dpo_pairs import replay_to

    question = question_of(SEED, "s")
    x = question.split("price of ")[1].split(" ")[0]
    y = question.split("price of ")[2].rstrip("?")
    script = [("lookup", {"item": "durian"}), ("lookup", {"item": x}), ("lookup", {"item": y}),
              ("sum", {"a": 1, "b": 2}), ("add", {"a": 1}), ("submit", {"answer": answer_of(SEED, "s")})]
    step = itertools.count()

    def scripted_generate(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        name, args = script[next(step)]
        text = "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [ids], [[-0.5] * len(ids)]

    s = McpEnvSession(mcp_url, max_tool_calls=len(script))
    try:
        monkeypatch.setattr(rollout, "generate_turns", scripted_generate)
        (ep,) = play_episodes(None, tok, [s], [(SEED, "s")], tool_suffix_ids=_tool_suffix(tok),
                                      max_tool_calls=len(script), max_turn_tokens=64, max_seq_len=4096,
                                      temperature=1.0)
        assert (ep.end_reason, ep.reward) == ("done", 1.0)
        tool_turns = [t for t in ep.turns if t.role == "tool"]
        assert [t.error_kind for t in tool_turns] == ["execution_error", None, None, "tool_not_found",
                                                      "invalid_args", None]
        assert "error: no item 'durian'" in ep.completion_text and ep.tool_errors == 3
        for turn in range(1, len(ep.turns), 2):
            replay_to(s, ep, turn)  # raises ReplayError on any difference from the recorded replies
    finally:
        s.close()


# ------------------------------------------------------------------------------------ a node trains against it


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_node_trains_a_round_against_a_separately_started_mcp_server(run_dir):
    from composer_diloco.metrics import read_metrics
    from local_run import assert_peer_line, coordinator_line, free_listen_address

    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    procs = []
    try:
        server, url = start_mcp_server(log_path=logs / "mcp-server.log")
        procs.append(server)
        listen = free_listen_address()  # its line is known (its key is in the run dir): the node starts beside it
        peer = coordinator_line(run_dir, listen)
        coordinator = prefork.popen(
            [sys.executable, "-m", "coordinator", "start", "--config", str(SMOKE), "--rounds", "1", "--run-dir",
             str(run_dir), "--listen", listen], stdout=subprocess.PIPE, stderr=open(logs / "coordinator.err", "w"),
            text=True, cwd=ROOT, start_new_session=True)
        procs.append(coordinator)
        node_log = logs / "node-mcp.err"
        node = prefork.popen(
            [sys.executable, "-m", "nodes", "join", "--peer", peer, "--env-url", url, "--run-dir",
             str(run_dir), "--name", "node-mcp", "--device", "cpu"],
            stdout=subprocess.DEVNULL, stderr=open(node_log, "w"), cwd=ROOT, start_new_session=True,
            env={**os.environ, "COLUMNS": "400"})  # rich would wrap the log lines at 80 columns
        procs.append(node)
        assert_peer_line(coordinator, peer, lambda: (logs / "coordinator.err").read_text()[-2000:])
        assert node.wait(timeout=480) == 0, node_log.read_text()[-3000:]
        assert coordinator.wait(timeout=60) == 0
    finally:
        stop_processes(procs)

    text = node_log.read_text()
    assert "speaks OpenEnv's MCP tool protocol" in text and "lookup" in text
    (record,) = read_metrics(run_dir)["node-mcp"]
    assert record["round"] == 0 and record["samples"] > 0 and record["inner_steps"] >= 1
    # The embedded default knows tool_env's prompt; the server lists the same tools, rendered the same: it earns
    # reward (0.50-0.53 per node in round 0 here; 0.0 before the schemas were put in canonical order).
    assert 0.0 < record["mean_reward"] <= 1.0
    print(f"\nround 0 against the MCP server: mean reward {record['mean_reward']:.3f}, success "
          f"{record['success_rate']:.2f}, tool errors/episode {record['tool_errors_per_episode']:.2f}, "
          f"{record['samples']} episodes")
