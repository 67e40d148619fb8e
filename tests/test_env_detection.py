"""OpenEnv envs as their authors ship them (`tests/foreign_env_server.py`, openenv 0.10.0's own classes, served as a
real process): the node decides MCP vs typed from what each server says it is (``/schema``, ``/mcp`` ``tools/list``),
plays an MCP app built with a ``CallToolAction`` subclass, and refuses with one line a server of another protocol, a
reset without task text and a server without tools; a node with such an ``--env-url`` fails before it joins the DHT.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from composer_diloco.rollout import episodes as rollout

from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.env_process import find_free_port
from composer_diloco.rollout.episodes import EnvProtocolError, OpenEnvSession
from composer_diloco.rollout.mcp import (
    McpEnvSession,
    McpProtocolError,
    UnsupportedEnvServer,
    detect_env_protocol,
)
from composer_diloco.rollout.sessions import open_env_sessions
from mcp_env_server import answer_of, question_of
import prefork
from tests_support import error_line, serve, stop_processes

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).resolve().parent / "foreign_env_server.py"
PRICE_TOOLS = ("lookup", "add", "subtract", "multiply", "submit")
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@pytest.fixture(scope="module")
def base():
    """``http://127.0.0.1:PORT`` of one `tests/foreign_env_server.py` process (its apps under their paths)."""
    port = find_free_port()
    proc, url = serve([str(SERVER), "--host", "127.0.0.1", "--port", str(port)], port)
    try:
        yield url
    finally:
        stop_processes([proc])


def _one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    print(f"\n{type(e.value).__name__}: {message}")
    return message


@pytest.mark.timeout(120)
def test_an_mcp_app_with_a_calltoolaction_subclass_is_detected_and_played(base, monkeypatch):
    from openenv.core.env_server.mcp_types import ListToolsAction
    from openenv.core.mcp_client import MCPToolClient

    from composer_diloco.policy import load_default_tokenizer

    url = f"{base}/mcp-subclass"
    # what fooled the node: OpenEnv's WebSocket route refuses a ListToolsAction step on this app
    client = MCPToolClient(base_url=url).sync()
    try:
        client.connect()
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR|Invalid message"):
            client.step(ListToolsAction())
    finally:
        client.close()

    info = detect_env_protocol(url)
    assert (info.protocol, info.tool_names) == ("mcp", PRICE_TOOLS) and "trace_id" in info.action_fields

    tok = load_default_tokenizer()
    question = question_of(5, "s")
    x, y = question.split("price of ")[1].split(" ")[0], question.split("price of ")[2].rstrip("?")
    script = iter([("lookup", {"item": x}), ("lookup", {"item": y}), ("submit", {"answer": answer_of(5, "s")})])

    def scripted_generate(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        name, args = next(script)
        ids = tok("<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>",
                  add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [ids], [[-0.5] * len(ids)]

    (session,) = open_env_sessions([url], 1, max_tool_calls=3)
    try:
        assert isinstance(session, McpEnvSession) and tuple(session.tool_names) == PRICE_TOOLS
        monkeypatch.setattr(rollout, "generate_turns", scripted_generate)
        suffix = itertools.repeat(tok("\n", add_special_tokens=False)["input_ids"])
        (ep,) = play_episodes(None, tok, [session], [(5, "s")], tool_suffix_ids=lambda _: next(suffix),
                                      max_tool_calls=3, max_turn_tokens=64, max_seq_len=4096, temperature=1.0)
    finally:
        session.close()
    assert ep.turns[0].content == question and [t["function"]["name"] for t in ep.tools] == list(PRICE_TOOLS)
    assert (ep.end_reason, ep.reward, ep.tool_errors) == ("done", 1.0, 0)


@pytest.mark.timeout(60)
def test_a_typed_env_of_another_protocol_is_refused_with_one_line(base):
    url = f"{base}/code"
    with pytest.raises(UnsupportedEnvServer) as e:
        open_env_sessions([url], 2, max_tool_calls=4)
    message = _one_line(e)
    assert message.startswith(f"env server at {url} speaks neither OpenEnv's MCP tool protocol")
    assert "'Environment does not support MCP'" in message and "['metadata', 'code']" in message
    assert "expected an MCP tool server, or an action with fields ['tool', 'arguments']" in message


@pytest.mark.timeout(60)
def test_a_reset_without_task_text_and_a_server_without_tools_are_refused(base):
    url = f"{base}/no-question"
    assert detect_env_protocol(url).protocol == "openenv"
    with pytest.raises(EnvProtocolError) as e:
        open_env_sessions([url], 2, max_tool_calls=4)
    assert _one_line(e) == f"env server at {url}: the reset observation's 'question' is empty: expected the task text"

    url = f"{base}/no-tools"
    with pytest.raises(EnvProtocolError) as e:
        open_env_sessions([url], 1, max_tool_calls=4)
    assert _one_line(e) == (f"env server at {url}: the reset observation lists no tools ('tools' is []): expected at "
                            f"least one tool schema")

    url = f"{base}/mcp-no-tools"
    expected = (f"the MCP server at {url} lists no tools (/mcp tools/list answered an empty list): expected at least "
                f"one tool")
    with pytest.raises(McpProtocolError) as e:
        open_env_sessions([url], 1, max_tool_calls=4)
    assert _one_line(e) == expected
    with pytest.raises(McpProtocolError) as e:  # a session told it is MCP checks too
        McpEnvSession(url, max_tool_calls=4)
    assert _one_line(e) == expected
    # the typed session of a good URL is still what it was
    (s,) = open_env_sessions([f"{base}/no-question"], 1, max_tool_calls=4, protocols={f"{base}/no-question": "openenv"},
                             check_reset=False)
    s.close()
    assert isinstance(s, OpenEnvSession)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_node_with_a_bad_env_url_fails_before_it_joins_the_dht(base, tmp_path):
    """No coordinator runs and ``--peer`` names a dead address: a node that reached the DHT would fail with ``no peer
    answered``; it fails with the env's one line instead, before it starts the DHT."""
    url = f"{base}/code"
    r = prefork.run([sys.executable, "-m", "nodes", "join", "--peer", DEAD_PEER, "--env-url", url, "--device", "cpu",
                     "--run-dir", str(tmp_path), "--join-timeout", "30"],
                    capture_output=True, text=True, timeout=100, cwd=ROOT)
    line = error_line(r)
    assert r.returncode == 1 and line.startswith(f"composer-node: error: env server at {url} speaks neither"), r.stderr
    assert "no peer answered" not in r.stderr, r.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


@pytest.mark.timeout(60)
def test_an_env_url_that_is_not_a_url_is_refused_before_anything(tmp_path):
    from composer_diloco.lifecycle import GracefulStop
    from nodes.node import Node, NodeOptions
    from nodes.options import OptionError

    node = Node(NodeOptions(peer=DEAD_PEER, device="cpu", env_urls=["localhost:8000"], run_dir=tmp_path),
                GracefulStop())
    try:
        with pytest.raises(OptionError, match=r"^--env-url 'localhost:8000' is not a URL: expected http://HOST:PORT"):
            node.join()
        assert node.dht is None
    finally:
        node.close()
