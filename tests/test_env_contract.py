"""The env contract (`composer_diloco.rollout.env_package`): the core names no env, and a third env package,
``tests/echo_env``, is found from its server module and played through the core with no core edit."""

from __future__ import annotations

import ast
import os
from dataclasses import replace
from pathlib import Path

import pytest

from composer_diloco.channels.dpo_pairs import replay_to
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.rollout import episodes as rollout
from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.env_package import EnvPackageError, load_env_package
from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.episodes import OpenEnvSession
from composer_diloco.rollout.sessions import open_env_sessions
from episode_support import tool_call_ids

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
ECHO = "echo_env.server"
SEED = 3



def env_imports(path: Path) -> list[str]:
    """The modules of ``envs`` (or of the test env) that ``path`` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [n for n in names if n.split(".")[0] in ("envs", "echo_env")]
    return found


def test_the_core_imports_no_env_package():
    """Every module of the library, the node and the coordinator: what an env brings (demos, hints, tokenizer
    recipe, tokenizer files) comes through the env contract."""
    offenders = {str(p.relative_to(ROOT)): env_imports(p) for folder in ("composer_diloco", "nodes", "coordinator")
                 for p in sorted((ROOT / folder).rglob("*.py"))}
    assert len(offenders) > 60
    assert {f: m for f, m in offenders.items() if m} == {}


def test_load_env_package_finds_the_demos_entries():
    from echo_env import demos

    pkg = load_env_package(ECHO)
    assert (pkg.package, pkg.server_module) == ("echo_env", ECHO)
    assert (pkg.demonstration, pkg.script, pkg.error_rate) == (demos.demonstration, demos.script, 0.5)
    assert dict(pkg.reason_hints) == demos.REASON_HINTS
    demo = pkg.demonstration(SEED, 0, 1.0)
    assert demo.imitate == [False, True] and demo.calls[-1] == pkg.script(SEED, "warmstart-0", demo.question)[0]
    assert replace(load_env_package("echo_env"), server_module=ECHO) == pkg  # the package name itself works too


def _package(root: Path, name: str, demos: str | None) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    if demos is not None:
        (root / name / "demos.py").write_text(demos)


def test_load_env_package_errors_name_the_bad_entry(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _package(tmp_path, "bare_env", None)
    bare = load_env_package("bare_env.server")  # no demos.py: every entry empty
    assert (bare.package, bare.demonstration, bare.script, dict(bare.reason_hints), bare.error_rate) == \
        ("bare_env", None, None, {}, None)
    with pytest.raises(EnvPackageError, match="'no_such_env' is not importable"):
        load_env_package("no_such_env.server")
    for name, demos, message in [
        ("bad_script_env", "script = 3\n", r"bad_script_env.demos.script is int: expected a function"),
        ("bad_hints_env", "REASON_HINTS = {'x': 1}\n", r"bad_hints_env.demos.REASON_HINTS is \{'x': 1\}"),
        ("bad_rate_env", "ERROR_RATE = 1.5\n", r"bad_rate_env.demos.ERROR_RATE is 1.5: expected a number in \[0, 1\]"),
    ]:
        _package(tmp_path, name, demos)
        with pytest.raises(EnvPackageError, match=message):
            load_env_package(f"{name}.server")
    with pytest.raises(EnvPackageError, match="bare_env.server is not importable"):
        bare.local_session(max_tool_calls=2)
    _package(tmp_path, "broken_env", "import no_such_dependency_xyz\n")
    with pytest.raises(ImportError, match="no_such_dependency_xyz"):  # a real error inside demos.py is not hidden
        load_env_package("broken_env.server")


@pytest.fixture(scope="module")
def echo_url():
    """One ``python -m echo_env.server`` process (``tests/`` on its import path), stopped in finally."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        server = start_env_server(load_env_package(ECHO).server_module, startup_timeout_s=60.0)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tok():
    return load_default_tokenizer()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_scripted_policy_plays_the_echo_env_through_the_core(echo_url, tok, monkeypatch):
    """Sessions, rollout, error kinds, reason hints and trace replay of a package the core has never heard of."""
    pkg = load_env_package(ECHO)
    keys = [(SEED, f"e{i}") for i in range(3)]
    sessions = open_env_sessions([echo_url], len(keys), max_tool_calls=3)
    try:
        assert all(isinstance(s, OpenEnvSession) for s in sessions)  # detected as the typed tool-call protocol
        questions = {s.reset(seed, e)[0]: (seed, e) for s, (seed, e) in zip(sessions, keys)}
        # The policy: episode e0 first echoes a wrong word, then every episode follows the package's script.
        plans = {e: ([("echo", {"text": "nope"})] if e == "e0" else []) + pkg.script(seed, e, q)
                 for q, (seed, e) in questions.items()}
        turn = {e: 0 for _, e in keys}

        def scripted_generate(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
            ids = []
            for context in contexts:
                text = tokenizer.decode(context)
                (seed, e), = [k for q, k in questions.items() if q in text]
                ids.append(tool_call_ids(tokenizer, *plans[e][turn[e]]))
                turn[e] += 1
            return ids, [[-0.5] * len(x) for x in ids]

        monkeypatch.setattr(rollout, "generate_turns", scripted_generate)
        episodes = play_episodes(None, tok, sessions, keys, tool_suffix_ids=lambda m: tool_suffix_ids(tok, m),
                                         max_tool_calls=3, max_turn_tokens=64, max_seq_len=4096, temperature=1.0)
        assert [(ep.end_reason, ep.reward) for ep in episodes] == [("done", 1.0)] * 3
        first = [t for t in episodes[0].turns if t.role == "tool"]
        assert [t.error_kind for t in first] == ["execution_error", None]
        assert first[0].error_meta["reason"] == "wrong_word"
        assert pkg.reason_hints["wrong_word"].format(**first[0].error_meta) == \
            "You echoed 'nope'; echo exactly the word the question names."
        for t in range(1, len(episodes[0].turns), 2):
            replay_to(sessions[0], episodes[0], t)  # the env replays its episodes (raises ReplayError otherwise)
    finally:
        for s in sessions:
            s.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_tiny_policy_plays_the_echo_env(echo_url, tok):
    model = build_tiny_model(tok, seed=0)
    keys = [(SEED, f"t{i}") for i in range(2)]
    sessions = open_env_sessions([echo_url], len(keys), max_tool_calls=2)
    try:
        episodes = play_episodes(model, tok, sessions, keys, tool_suffix_ids=lambda m: tool_suffix_ids(tok, m),
                                         max_tool_calls=2, max_turn_tokens=16, max_seq_len=1024, temperature=1.0)
    finally:
        for s in sessions:
            s.close()
    for ep in episodes:
        ep.check()
        assert ep.turns[0].content.startswith("Echo the word ") and '"name": "echo"' in ep.prompt_text
        assert sum(ep.env_mask) > 0 and 0.0 <= ep.reward <= 1.0


def test_an_observation_outside_the_protocol_is_named():
    """`OpenEnvSession` checks the protocol's fields; the error names the URL, the field and the value."""
    from types import SimpleNamespace

    from composer_diloco.rollout.episodes import EnvProtocolError

    class Stub:
        def reset(self, **kwargs):
            return SimpleNamespace(observation={"tools": []})  # no question

        def step(self, action):
            return SimpleNamespace(observation={"content": "7", "error_kind": 3}, reward=None, done=False)

    session = OpenEnvSession.__new__(OpenEnvSession)
    session.url, session.max_tool_calls, session.reset_kwargs, session._client = "http://h:1", 2, {}, Stub()
    with pytest.raises(EnvProtocolError, match=r"http://h:1: observation field 'question' should be str, got None"):
        session.reset(0, "0")
    with pytest.raises(EnvProtocolError, match=r"field 'error_kind' should be str or NoneType, got 3"):
        session.call("add", {})


def test_local_session_plays_the_echo_env_in_process():
    """The package's environment in this process (evaluation without a server), read through the same protocol."""
    pkg = load_env_package(ECHO)
    session = pkg.local_session(max_tool_calls=3)
    try:
        question, tools = session.reset(SEED, "l0")
        assert [t["function"]["name"] for t in tools] == ["echo"]
        content, kind, meta, reward, done = session.call("shout", {"text": "x"})
        assert (kind, meta["available_tools"], reward, done) == ("tool_not_found", ["echo"], 0.0, False)
        (call,) = pkg.script(SEED, "l0", question)
        content, kind, meta, reward, done = session.call(*call)
        assert (content, kind, reward, done) == (call[1]["text"], None, 1.0, True)
    finally:
        session.close()
