"""Tests of the embedded default policy (tokenizer, tiny model, warm start, loading) and of chat parsing."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from composer_diloco import policy
from composer_diloco.policy import (
    DEFAULT_TOKENIZER_DIR,
    ENV_TOKENIZER_FOLDER,
    PolicyLoadError,
    build_tiny_model,
    embedded_tokenizer_dir,
    evaluate_policy,
    load_default_tokenizer,
    load_embedded_tokenizer,
    load_policy,
    tokenize_episode,
    warm_start,
)
from composer_diloco.policy import load as load_module
from composer_diloco.policy import warmstart as warmstart_module
from composer_diloco.policy.tokenizer import build_env_tokenizer
from composer_diloco.rollout.chat import ParsedCall, episode_messages, parse_tool_call
from composer_diloco.rollout.env_process import start_env_server
from envs.tool_env.tasks import TOOL_SCHEMAS, execute, make_task, solve


@pytest.fixture(scope="module")
def tok():
    return load_default_tokenizer()


def _episode(seed: int = 1, error_rate: float = 1.0):
    task = make_task(seed, "test")
    calls = solve(task, random.Random(seed), error_rate)
    results = [execute(task, name, args)[0] for name, args in calls]
    return task, calls, results


# ---------------------------------------------------------------------------------------- tokenizer


@pytest.mark.timeout(20)
def test_shipped_tokenizer_loads_and_round_trips(tok):
    for text in ["What is the price of apple plus the price of pear?", "héllo wörld ✓ 12345\n\t{}", ""]:
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]) == [0, 1, 2, 3]
    # one token per digit; environment nouns are single tokens
    assert [tok.decode([i]) for i in tok("2024", add_special_tokens=False)["input_ids"]] == ["2", "0", "2", "4"]
    assert len(tok("apple", add_special_tokens=False)["input_ids"]) == 1
    assert len(tok) < 1000


@pytest.mark.timeout(20)
def test_shipped_tokenizer_is_trl_qwen3(tok):
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        parse_response,
        qwen3_training_chat_template,
        supports_tool_calling,
    )

    assert tok.chat_template == policy.trl_qwen3_chat_template()
    assert supports_tool_calling(tok)
    assert get_training_chat_template(tok) == qwen3_training_chat_template
    add_response_schema(tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOL_SCHEMAS,
                                     add_generation_prompt=True, return_dict=False)
    ids = tok('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>')["input_ids"]
    parsed = parse_response(tok, ids, prefix=prompt)
    assert parsed["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 3, "b": 4}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", ["envs.tool_env", "envs.coding_env"])
def test_shipped_tokenizer_is_current(tmp_path, env):
    """The shipped files equal a fresh deterministic build (rebuild them after changing the env's tasks or demos)."""
    build_env_tokenizer(env, tmp_path)
    shipped = embedded_tokenizer_dir(env)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), (
            f"{shipped / name} is stale: run `python -m composer_diloco.policy build-tokenizer --env {env}`")


def test_each_env_gets_its_own_tokenizer_else_the_projects(tmp_path, monkeypatch):
    """The coding env ships its own tokenizer; tool_env, a foreign env package without one and a name that is no
    package here get the project's."""
    assert embedded_tokenizer_dir("envs.tool_env.server") == DEFAULT_TOKENIZER_DIR
    coding = embedded_tokenizer_dir("envs.coding_env.server")
    assert coding == embedded_tokenizer_dir("envs.coding_env") != DEFAULT_TOKENIZER_DIR
    assert coding.name == ENV_TOKENIZER_FOLDER and coding.parent.name == "coding_env"
    (tmp_path / "foreign_env").mkdir()
    (tmp_path / "foreign_env" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert embedded_tokenizer_dir("foreign_env.server") == DEFAULT_TOKENIZER_DIR
    assert embedded_tokenizer_dir("no_such_package_here.server") == DEFAULT_TOKENIZER_DIR
    assert len(load_embedded_tokenizer("envs.coding_env.server")) != len(load_default_tokenizer())


def test_coding_tokenizer_keeps_what_the_code_copies_whole():
    """With the coding env's tokenizer an episode is short and the task's function name is one token, the same token
    in the prompt and in the code, and numbers are digits; the project's tokenizer spells both out in characters
    (why a warm start on it never learned to copy them: BENCHMARKS.md 1, the coding env)."""
    from envs.coding_env.demos import demonstration
    from envs.coding_env.tasks import FUNCTION_NAMES

    coding = load_embedded_tokenizer("envs.coding_env")
    for name in FUNCTION_NAMES:
        assert len(coding(name, add_special_tokens=False)["input_ids"]) == 1, name
    prompt = coding("Fix scale(x): it must return 8 * x + 5.", add_special_tokens=False)["input_ids"]
    code = coding("def scale(x):\n    return 8 * x + 5\n", add_special_tokens=False)["input_ids"]
    scale, eight = coding.convert_tokens_to_ids("scale"), coding("8", add_special_tokens=False)["input_ids"]
    assert scale in prompt and scale in code and len(eight) == 1 and eight[0] in prompt and eight[0] in code
    demo = demonstration(7, 0, 0.0)
    lengths = {}
    for label, tok in (("own", coding), ("project", load_default_tokenizer())):
        enc = tokenize_episode(tok, episode_messages(demo.question, demo.calls, demo.replies), tools=demo.tools)
        lengths[label] = len(enc["input_ids"])
    assert lengths["own"] * 4 < lengths["project"], lengths


# -------------------------------------------------------------------------------------------- chat


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
         ParsedCall("add", {"a": 3, "b": 4}, None)),
        ('  <think>\n\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"item": "fig"}}\n'
         '</tool_call><|im_end|>\n', ParsedCall("lookup", {"item": "fig"}, None)),
        ('<tool_call>\n{"name": "submit", "arguments": {"answer": -3}}<|im_end|>',  # cut before the end tag
         ParsedCall("submit", {"answer": -3}, None)),
        ('<tool_call>{"name": "submit", "arguments": "{\\"answer\\": 5}"}</tool_call>',
         ParsedCall("submit", {"answer": 5}, None)),
        ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b"}\n</tool_call>',
         ParsedCall("a", {}, None)),
        ("The answer is 7.", ParsedCall(None, None, "no tool call")),
        ("", ParsedCall(None, None, "no tool call")),
    ],
)
def test_parse_tool_call_ok_and_missing(text, expected):
    assert parse_tool_call(text) == expected


@pytest.mark.parametrize(
    ("text", "prefix"),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 3,}}\n</tool_call>', "malformed json: "),
        ("<tool_call>\n</tool_call>", "malformed json: "),
        ("<tool_call>[1, 2]</tool_call>", "malformed call: "),
        ('<tool_call>{"arguments": {}}</tool_call>', "malformed call: "),
        ('<tool_call>{"name": "add", "arguments": [3, 4]}</tool_call>', "malformed call: "),
    ],
)
def test_parse_tool_call_errors(text, prefix):
    parsed = parse_tool_call(text)
    assert not parsed.ok and parsed.name is None and parsed.arguments is None
    assert parsed.error.startswith(prefix)


@pytest.mark.timeout(20)
def test_episode_messages_render_with_the_template(tok):
    task, calls, results = _episode()
    messages = episode_messages(task.question, calls, results)
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * len(calls)
    text = tok.apply_chat_template(messages, tools=TOOL_SCHEMAS, tokenize=False)
    assert task.question in text
    assert f'<tool_call>\n{{"name": "lookup", "arguments": {{"item": "{task.x}"}}}}\n</tool_call>' in text
    assert "<think>" not in text.split("<|im_start|>user")[1]  # no-think form in every assistant turn
    pending = episode_messages(task.question, calls, results[:-1])
    assert pending[-1]["role"] == "assistant"
    with pytest.raises(ValueError, match="results"):
        episode_messages(task.question, calls, results[:-2])


@pytest.mark.timeout(20)
def test_tokenize_episode_masks_exactly_the_generated_turns(tok):
    task, calls, results = _episode()
    enc = tokenize_episode(tok, episode_messages(task.question, calls, results), tools=TOOL_SCHEMAS)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    for k in range(len(calls)):  # the generation prompt after k calls is a prefix; turn k follows it
        prompt = tok.apply_chat_template(episode_messages(task.question, calls[:k], results[:k]),
                                         tools=TOOL_SCHEMAS, add_generation_prompt=True, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        assert ids[: len(p)] == p
        end = len(p)
        while mask[end]:
            end += 1
        turn = tok.decode(ids[len(p):end])
        assert parse_tool_call(turn) == ParsedCall(calls[k][0], calls[k][1], None)
        assert turn.endswith("</tool_call><|im_end|>")
    assert sum(mask) > 0 and len(mask) == len(ids)
    failed = [execute(task, n, a)[1] is None for n, a in calls]
    partial = tokenize_episode(tok, episode_messages(task.question, calls, results), trained_turns=failed,
                               tools=TOOL_SCHEMAS)
    assert 0 < sum(partial["assistant_masks"]) < sum(mask)


# ------------------------------------------------------------------------------------------- model


@pytest.mark.timeout(20)
def test_tiny_model_forward_shapes(tok):
    model = build_tiny_model(tok, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n_params < 1.5e6
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    ids = torch.randint(0, len(tok), (2, 7))
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 7, len(tok)) and logits.dtype == torch.float32
    same = build_tiny_model(tok, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))


@pytest.mark.timeout(60)
def test_warm_start_is_deterministic_and_atomic(tok, tmp_path):
    state = torch.random.get_rng_state()
    runs = []
    for name in ("a", "b"):
        out = warm_start(build_tiny_model(tok, seed=3), tok, seed=3, steps=5, batch_size=4,
                         out_dir=tmp_path / name)
        assert out == tmp_path / name
        runs.append((out / "model.safetensors").read_bytes())
    assert runs[0] == runs[1]
    assert torch.equal(torch.random.get_rng_state(), state)  # caller's RNG untouched
    initial = warm_start(build_tiny_model(tok, seed=3), tok, seed=3, steps=0, out_dir=tmp_path / "init")
    assert (initial / "model.safetensors").read_bytes() != runs[0]  # training moved the weights
    files = set(os.listdir(tmp_path / "a"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "warmstart.json"} <= files
    meta = json.loads((tmp_path / "a" / "warmstart.json").read_text())
    assert meta["steps"] == 5 and meta["seed"] == 3
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "init"]  # no temp dirs left behind
    with pytest.raises(FileExistsError):
        warm_start(build_tiny_model(tok, seed=3), tok, seed=3, steps=0, out_dir=tmp_path / "a")


@pytest.mark.timeout(30)
def test_warm_start_failure_leaves_nothing(tok, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(warmstart_module, "solver_examples", boom)
    with pytest.raises(RuntimeError, match="injected"):
        warm_start(build_tiny_model(tok, seed=0), tok, seed=0, steps=2, out_dir=tmp_path / "ws")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("value", ["/definitely/not/here", "./not-here-either", "no/such/deep/path"])
def test_load_policy_missing_path_raises(value, tmp_path):
    with pytest.raises(PolicyLoadError, match=value.replace(".", r"\.")) as info:
        load_policy(value, seed=0, warmstart_steps=0)
    assert "\n" not in str(info.value)


def test_load_policy_rejects_a_directory_without_a_model(tmp_path):
    with pytest.raises(PolicyLoadError, match="config.json"):
        load_policy(tmp_path, seed=0, warmstart_steps=0)


@pytest.mark.timeout(30)
def test_load_policy_local_directory(tok, tmp_path):
    model = build_tiny_model(tok, seed=1).to(torch.float16)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, loaded_tok = load_policy(str(tmp_path / "m"), seed=0, warmstart_steps=0)
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu" and not loaded.training
    assert loaded_tok.chat_template == tok.chat_template
    ids = torch.tensor([[1, 5, 9, 30]])
    assert torch.allclose(loaded(input_ids=ids).logits, model.float()(input_ids=ids).logits, atol=1e-3)


@pytest.mark.timeout(60)
def test_load_policy_default_warm_starts_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_DILOCO_CACHE", str(tmp_path))
    model, tok = load_policy(None, seed=0, warmstart_steps=2)
    (cache,) = (p for p in (tmp_path / "warmstart").iterdir() if p.is_dir())
    assert (cache / "model.safetensors").is_file()
    assert model.dtype == torch.float32 and tok.chat_template

    def no_training(*args, **kwargs):
        raise AssertionError("should reuse the cache")

    monkeypatch.setattr(load_module, "warm_start", no_training)
    again, _ = load_policy(None, seed=0, warmstart_steps=2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.fixture(scope="module")
def tool_env_url():
    with start_env_server("envs.tool_env.server") as server:
        yield server.url


@pytest.mark.timeout(60)
def test_evaluate_policy_runs_episodes(tok, tool_env_url):
    model = build_tiny_model(tok, seed=0)
    state, mode = torch.random.get_rng_state(), model.training
    for temperature in (0.0, 1.0):
        stats = evaluate_policy(model, tok, 3, 0, env_url=tool_env_url, temperature=temperature, max_new_tokens=8,
                                batch_size=2, family=lambda seed, episode_id: f"parity-{int(episode_id[-1]) % 2}")
        assert stats["n_episodes"] == 3
        for key in ("success_rate", "mean_reward", "format_error_rate", "tool_error_rate"):
            assert 0.0 <= stats[key] <= 1.0
        assert stats["success_rate"] == 0.0  # an untrained model does not solve the task
        assert {f: v["episodes"] for f, v in stats["by_family"].items()} == {"parity-0": 2, "parity-1": 1}
    assert torch.equal(torch.random.get_rng_state(), state)  # caller's RNG untouched
    assert model.training == mode  # train/eval mode restored


@pytest.mark.timeout(400)  # the session's warm start (~1 min) may be paid here
def test_compare_policies_is_paired_on_the_same_episodes(tok, warm_cache):
    """A policy against itself: the same rewards episode by episode (difference 0, standard error 0); the warm start
    against an untrained model: the untrained one solves nothing, the difference is the warm start's whole reward,
    and its paired standard error is the per-episode differences' (sampled: the same sampling seed for both)."""
    from composer_diloco.config import load_config
    from composer_diloco.policy.evaluate import compare_policies

    cfg = load_config(None)
    warm, _ = load_policy(None, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps)
    n = 12
    same = compare_policies(warm, warm, tok, n, 7, env="envs.tool_env.server", temperatures=(1.0,))
    assert (same[0].diff, same[0].diff_se, same[0].n_episodes) == (0.0, 0.0, n) and same[0].before > 0.2
    untrained = build_tiny_model(tok, seed=5)
    worse = compare_policies(warm, untrained, tok, n, 7, env="envs.tool_env.server", temperatures=(1.0, 0.0))
    for c in worse:
        assert c.after == 0.0 and c.diff == -c.before
        p = c.before  # rewards are 0/1: the differences are -1 on the episodes the warm start solved, else 0
        assert c.diff_se == pytest.approx((p * (1 - p) * n / (n - 1) / n) ** 0.5, abs=1e-9)
    assert worse[0].before == same[0].before  # sampled, seed 7, the same episodes: the same draws
    assert "greedy: warm start" in worse[1].describe() and f"paired se, {n} tasks" in worse[1].describe()
    # what the warm start does, counted by tool: every parsed call, and the tool_env episode's end (submit) among them
    greedy = evaluate_policy(warm, tok, 8, 7, env="envs.tool_env.server")
    assert sum(greedy["calls_by_tool"].values()) == round(greedy["mean_tool_calls"] * 8)
    assert set(greedy["calls_by_tool"]) <= {"lookup", "add", "subtract", "multiply", "submit"}
    assert greedy["calls_by_tool"].get("submit", 0) >= round(greedy["success_rate"] * 8) > 0  # no success unsubmitted


@pytest.mark.timeout(30)
def test_load_policy_unknown_hub_id_offline_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network attempt: local cache only
    with pytest.raises(PolicyLoadError, match="nonexistent-org/nonexistent-model"):
        load_policy("nonexistent-org/nonexistent-model", seed=0, warmstart_steps=0)


# ----------------------------------------------------------------------------------------- warm-start envs


@pytest.mark.timeout(60)
def test_warm_start_data_comes_from_the_run_s_env(tok, tmp_path):
    """Each env package owns its demonstrations; the coding env's render its own tools and skip failed calls."""
    from envs.coding_env.demos import demonstration
    from envs.coding_env.tools import TOOL_SCHEMAS as CODING_TOOLS

    rows = policy.solver_examples(tok, seed=0, n_episodes=20, env="envs.coding_env.server")
    demos = [demonstration(0, i) for i in range(20)]
    assert any(not all(d.imitate) for d in demos) and any(all(d.imitate) for d in demos)
    for row, demo in zip(rows, demos):
        text = tok.decode(row["input_ids"])
        assert '"name": "write_file"' in text and '"name": "lookup"' not in text  # coding tools rendered
        trained = tok.decode([t for t in row["labels"] if t != -100])
        assert trained.count("<tool_call>") == sum(demo.imitate)  # failed attempts are context only
    assert demos[0].tools == CODING_TOOLS
    default = policy.solver_examples(tok, seed=0, n_episodes=2)
    assert '"name": "lookup"' in tok.decode(default[0]["input_ids"])
    out = warm_start(build_tiny_model(tok, seed=0), tok, seed=0, steps=1, batch_size=2, out_dir=tmp_path / "c",
                     env="envs.coding_env")
    assert json.loads((out / "warmstart.json").read_text())["env"] == "envs.coding_env"


def test_an_env_without_demonstrations_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSER_DILOCO_CACHE", str(tmp_path))
    with pytest.raises(PolicyLoadError, match=r"envs\.nope\.server.*\[warmstart\] steps = 0"):
        load_policy(None, seed=0, warmstart_steps=5, env="envs.nope.server")
    assert not (tmp_path / "warmstart").exists()
    with pytest.raises(PolicyLoadError, match="no scripted demonstrations"):
        policy.env_demonstrations("envs.schema")


# ------------------------------------------------------------------------------------------ evaluation loop


class _ScriptedSession:
    """A fake env session: ``submit`` ends the episode with reward ``answer / 10``; other tools answer "ok"."""

    def __init__(self):
        self.resets = []

    def reset(self, seed, episode_id):
        self.resets.append((seed, episode_id))
        return f"question {episode_id}", []

    def call(self, tool, arguments):
        if tool == "submit":
            return "submitted", None, {}, arguments["answer"] / 10, True
        if tool == "bad":
            return "error: unknown tool", "tool_not_found", {}, 0.0, False
        return "ok", None, {}, 0.0, False

    def close(self):
        pass


def test_evaluation_loop_follows_the_env(tok, monkeypatch):
    """Reward comes from the env's done step; a turn with no call ends with reward 0; the call budget is kept."""
    from composer_diloco.policy import evaluate as evaluate_module

    turns = {  # episode -> the texts the "policy" writes, turn by turn
        "eval-0": ['<tool_call>{"name": "look", "arguments": {}}</tool_call>',
                   '<tool_call>{"name": "submit", "arguments": {"answer": 10}}</tool_call>'],
        "eval-1": ["no call here"],
        "eval-2": ['<tool_call>{"name": "bad", "arguments": {}}</tool_call>'] * 5,
    }
    played = {k: 0 for k in turns}

    def fake_generate(model, tokenizer, prompts, *, temperature, max_new_tokens):
        texts = []
        for prompt in prompts:
            episode = prompt.split("question ")[1].split("<|im_end|>")[0]
            texts.append(turns[episode][played[episode]])
            played[episode] += 1
        return texts

    monkeypatch.setattr(evaluate_module, "_generate_turns", fake_generate)
    sessions = [_ScriptedSession() for _ in range(3)]
    outcomes = evaluate_module._play_batch(None, tok, sessions, [(5, "eval-0"), (5, "eval-1"), (5, "eval-2")],
                                           temperature=0.0, max_calls=3, max_new_tokens=8)
    assert [o.reward for o in outcomes] == [1.0, 0.0, 0.0]
    assert [o.tool_calls for o in outcomes] == [2, 0, 3]  # eval-2 stops at the budget
    assert [o.format_error for o in outcomes] == [False, True, False]
    assert outcomes[2].tool_errors == 3 and [s.resets for s in sessions] == [[(5, "eval-0")], [(5, "eval-1")],
                                                                             [(5, "eval-2")]]
    stats = evaluate_module._summary(outcomes, [(5, "eval-0"), (5, "eval-1"), (5, "eval-2")],
                                     lambda seed, episode_id: "all", seconds=1.0)
    assert stats["mean_reward"] == pytest.approx(1 / 3) and stats["success_rate"] == pytest.approx(1 / 3)
    assert stats["tool_error_rate"] == pytest.approx(3 / 5) and stats["by_family"]["all"]["episodes"] == 3


@pytest.mark.timeout(60)
def test_evaluate_policy_in_process_equals_served(tok, tool_env_url):
    """The env package played in this process (`EnvPackage.local_session`, the CLI's default) scores a policy
    exactly as its served env does."""
    model = build_tiny_model(tok, seed=0)
    for temperature in (0.0, 1.0):
        served, local = (evaluate_policy(model, tok, 4, 3, **where, temperature=temperature, max_new_tokens=8,
                                         batch_size=2)
                         for where in ({"env_url": tool_env_url}, {"env": "envs.tool_env.server"}))
        served.pop("seconds"), local.pop("seconds")
        assert local == served


def test_evaluate_policy_rejects_bad_arguments(tok):
    with pytest.raises(ValueError, match="n_episodes"):
        evaluate_policy(None, tok, 0, 0, env_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="exactly one of env_url"):
        evaluate_policy(None, tok, 1, 0, env_url="http://127.0.0.1:1", env="envs.tool_env.server")


# ------------------------------------------------------------------------------------------ layout and CLI


def test_an_env_package_that_ships_its_own_tokenizer_builds_it_from_its_recipe_with_no_core_edit(tmp_path, monkeypatch):
    """A package with a ``tokenizer_recipe.py`` (the env contract) gets its ``policy_tokenizer/`` built by the CLI,
    and the embedded default then plays it with that tokenizer; a package without a recipe is one line, exit 1."""
    from typer.testing import CliRunner

    from composer_diloco.policy.cli import app

    pkg = tmp_path / "recipe_env"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tokenizer_recipe.py").write_text(
        "from envs.demonstration import Demonstration\n"
        "VOCAB_SIZE = 300\n"
        "TOOLS = [{'type': 'function', 'function': {'name': 'shout', 'description': 'Shout a word.',\n"
        "          'parameters': {'type': 'object', 'properties': {'word': {'type': 'string'}}}}}]\n"
        "def domain_words():\n    return ('zebrafish', 'shout')\n"
        "def corpus():\n"
        "    return [Demonstration(f'Shout zebrafish {i}.', TOOLS, [('shout', {'word': 'zebrafish'})],\n"
        "                          ['ZEBRAFISH'], [True]) for i in range(50)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert embedded_tokenizer_dir("recipe_env.server") == DEFAULT_TOKENIZER_DIR  # nothing built yet
    result = CliRunner().invoke(app, ["build-tokenizer", "--env", "recipe_env"])
    assert result.exit_code == 0, result.output
    assert embedded_tokenizer_dir("recipe_env.server") == pkg / ENV_TOKENIZER_FOLDER
    tok = load_embedded_tokenizer("recipe_env.server")
    assert tok.convert_tokens_to_ids(["zebrafish", "shout"]) == [9, 10]  # the recipe's nouns, atomic, from id 9

    (tmp_path / "bare_env").mkdir()
    (tmp_path / "bare_env" / "__init__.py").write_text("")
    result = CliRunner().invoke(app, ["build-tokenizer", "--env", "bare_env"])
    assert result.exit_code == 1 and "has no tokenizer recipe" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_cli_errors_are_one_line_and_nonzero(tmp_path):
    from typer.testing import CliRunner

    from composer_diloco.policy.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["evaluate", str(tmp_path / "missing")])
    assert result.exit_code == 1
    assert result.stderr.strip().count("\n") == 0 and "error: policy" in result.stderr
    (tmp_path / "ws").mkdir()
    result = runner.invoke(app, ["warm-start", "--out", str(tmp_path / "ws"), "--steps", "0"])
    assert result.exit_code == 1 and "already exists" in result.stderr
    result = runner.invoke(app, ["warm-start", "--out", str(tmp_path / "w2"), "--env", "envs.nope.server"])
    assert result.exit_code == 1 and "[warmstart] steps = 0" in result.stderr
    result = runner.invoke(app, ["evaluate", str(tmp_path), "--reset-kwarg", "novalue"])
    assert result.exit_code == 2  # a usage error


@pytest.mark.timeout(180)
def test_python_m_policy_runs(tmp_path):
    """``python -m composer_diloco.policy`` (the package's ``__main__``) runs a subcommand (a cold start: slow)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "composer_diloco.policy", "warm-start", "--out", str(tmp_path / "w"),
                        "--steps", "0"], capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warm start: 0 steps" in r.stdout and (tmp_path / "w" / "model.safetensors").is_file()
