"""The hinted warm start (``[warmstart] hint_rate``, issue 40): demonstrations with a failed call show the SDPO hint
for it exactly where, and exactly as, SDPO's teacher context holds it in training."""

from __future__ import annotations

import pytest

from composer_diloco.channels.hints import HintRegistry, peer_demo_text, teacher_hint
from composer_diloco.channels.sdpo_sites import peer_demos, successful_calls
from composer_diloco.config import ConfigError, RunConfig, load_config
from composer_diloco.policy.load import _default_cache_key, embedded_tokenizer_dir, load_embedded_tokenizer
from composer_diloco.policy.tiny_model import tiny_model_config
from composer_diloco.policy.tokenizer import tokenize_episode
from composer_diloco.policy.warmstart import demonstration_messages, solver_examples
from composer_diloco.rollout.env_package import load_env_package
from composer_diloco.rollout.episode_tokens import generation_prompt_ids, message_ids
from composer_diloco.rollout.episodes import Episode, Turn

ENVS = ["envs.tool_env", "envs.coding_env"]


def _failed_demos(env: str, count: int = 6):
    """Demonstrations of ``env`` whose failed call is followed by a recovery, with their indices."""
    package = load_env_package(env)
    found = []
    for i in range(400):
        demo = package.demonstration(0, i, 1.0)
        failed = [k for k, e in enumerate(demo.errors) if e is not None]
        if failed and failed[-1] + 1 < len(demo.calls):
            found.append((i, demo, failed[0]))
        if len(found) == count:
            return package, found
    raise AssertionError(f"{env}: fewer than {count} demonstrations with a recovered failed call")


@pytest.mark.parametrize("env", ENVS)
def test_a_hinted_demonstration_is_the_sdpo_teacher_context(env):
    """Token for token: the hinted demonstration = the hint-free one with `message_ids(hint)` inserted right before
    the recovery turn's assistant header (what `SiteFinder._site` builds), the hint from the trainer's registry, and
    the error the demonstration reports is the one the env's own server reports for that call."""
    package, found = _failed_demos(env)
    tok = load_embedded_tokenizer(env)
    hints = HintRegistry.from_config(None, reason_hints=package.reason_hints)  # as ComposerGRPOTrainer builds it
    header = generation_prompt_ids(tok)
    session = package.local_session(max_tool_calls=20)
    for index, demo, at in found:
        kind, meta = demo.errors[at]
        hint = hints.hint(kind, meta)
        assert hint, (env, kind, meta)
        plain = tokenize_episode(tok, demonstration_messages(demo), trained_turns=demo.imitate, tools=demo.tools)
        hinted = tokenize_episode(tok, demonstration_messages(demo, hints), trained_turns=demo.imitate,
                                  tools=demo.tools)
        ids = plain["input_ids"]
        # the recovery turn's header: the (at + 1)-th assistant header after the prompt's
        starts = [j for j in range(len(ids)) if ids[j:j + len(header)] == header]
        h = starts[at + 1]
        inserted = message_ids(tok, hint, "user")
        assert hinted["input_ids"] == ids[:h] + inserted + ids[h:], (env, index)
        # the hint is context, never a label; the trained tokens are the same ones
        assert hinted["assistant_masks"] == plain["assistant_masks"][:h] + [0] * len(inserted) + \
            plain["assistant_masks"][h:]
        # the env's server reports the same error for that call (so training's hint is this one)
        session.reset(0, f"warmstart-{index}")
        for k, (name, args) in enumerate(demo.calls[:at + 1]):
            content, error_kind, error_meta, _, _ = session.call(name, args)
        assert (content, error_kind) == (demo.replies[at], kind), (env, index)
        assert hints.hint(error_kind, error_meta) == hint, (env, index)


def test_hint_rate_shows_hints_in_its_share_and_zero_is_the_old_data():
    tok = load_embedded_tokenizer("envs.tool_env")
    old = solver_examples(tok, seed=0, n_episodes=64)
    assert solver_examples(tok, seed=0, n_episodes=64, hint_rate=0.0) == old
    half = solver_examples(tok, seed=0, n_episodes=64, hint_rate=0.5)
    changed = [i for i in range(64) if half[i] != old[i]]
    package = load_env_package("envs.tool_env")
    failed = [i for i in range(64) if any(package.demonstration(0, i, 0.3).errors)]
    assert set(changed) <= set(failed) and 0.2 * len(failed) < len(changed) < 0.8 * len(failed), (changed, failed)
    assert solver_examples(tok, seed=0, n_episodes=64, hint_rate=1.0) != half


def test_hint_rate_keys_the_cache_and_leaves_the_config_digest_of_runs_without_it():
    assert RunConfig().digest() == RunConfig.model_validate({"warmstart": {"hint_rate": 0.0}}).digest()
    assert RunConfig().digest() != RunConfig.model_validate({"warmstart": {"hint_rate": 0.5}}).digest()
    tok = load_embedded_tokenizer("envs.tool_env")
    cfg = tiny_model_config(tok, 0)
    where = embedded_tokenizer_dir("envs.tool_env")
    old = _default_cache_key(0, 200, cfg, "envs.tool_env", where)
    assert _default_cache_key(0, 200, cfg, "envs.tool_env", where, 0.0, {"timeout": "x"}) == old
    hinted = _default_cache_key(0, 200, cfg, "envs.tool_env", where, 0.5)
    assert hinted != old != _default_cache_key(0, 200, cfg, "envs.tool_env", where, 0.5, {"timeout": "x"}) != hinted


def test_a_bad_hint_rate_is_a_one_line_config_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[warmstart]\nhint_rate = 1.5\n")
    with pytest.raises(ConfigError, match="warmstart.hint_rate") as e:
        load_config(path)
    assert "\n" not in str(e.value)


# -- a teacher that knows more: a successful peer attempt of the GRPO group ([loss] sdpo_peer_demo_reward) -------
def _episode(key: str, reward: float, calls: list[tuple[str, dict, str | None]]) -> Episode:
    turns = [Turn("user", "q")]
    for name, args, error in calls:
        turns += [Turn("assistant", "", {"name": name, "arguments": args}), Turn("tool", "r", error_kind=error)]
    return Episode(seed=0, episode_id=key, turns=turns, tools=[], prompt_ids=[], reward=reward)


def test_peer_demos_show_another_successful_episode_of_the_same_group():
    lookup, add, submit = ("lookup", {"item": "fig"}, None), ("add", {"a": 1, "b": 2}, None), ("submit", {"answer": 3}, None)
    episodes = [
        _episode("t1", 0.0, [("lookup", {"item": "apple"}, "execution_error"), lookup]),
        _episode("t1", 1.0, [lookup, ("sum", {}, "tool_not_found"), add, submit]),  # its failed call is left out
        _episode("t2", 1.0, [add, submit]),  # alone in its group: no other attempt to show
        _episode("t1", 1.0, [add, submit]),  # a tie with the second: the earlier one is shown
        _episode("t2", 0.5, [submit]),  # below the bar
    ]
    demos = peer_demos(episodes, min_reward=1.0)
    solved = [("lookup", {"item": "fig"}), ("add", {"a": 1, "b": 2}), ("submit", {"answer": 3})]
    assert demos == [solved, [("add", {"a": 1, "b": 2}), ("submit", {"answer": 3})], None, solved, solved[1:]]
    assert successful_calls(episodes[1].turns) == solved
    assert peer_demos(episodes, min_reward=2.0) == [None] * 5


def test_the_teacher_hint_puts_the_peer_attempt_before_the_error_hint():
    demo = [("lookup", {"item": "fig"}), ("submit", {"answer": 3})]
    assert teacher_hint("Check the arguments.", demo) == \
        'A successful attempt called: lookup {"item": "fig"}; submit {"answer": 3}. Check the arguments.'
    assert teacher_hint("Check the arguments.", None) == "Check the arguments."
    assert teacher_hint(None, demo).startswith("A successful attempt called: lookup")
    assert teacher_hint(None, None) is None and teacher_hint("", []) is None
    with pytest.raises(ValueError):
        peer_demo_text([])


def test_a_peer_demo_warm_start_shows_the_demonstrations_own_solution_as_the_teacher_would():
    package, found = _failed_demos("envs.tool_env", count=2)
    hints = HintRegistry.from_config(None, reason_hints=package.reason_hints)
    for _, demo, at in found:
        messages = demonstration_messages(demo, hints, peer_demo=True)
        solution = [c for c, e in zip(demo.calls, demo.errors) if e is None]
        assert messages[2 + 2 * at + 1] == {"role": "user",
                                            "content": teacher_hint(hints.hint(*demo.errors[at]), solution)}
