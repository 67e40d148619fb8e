"""Trace-replay DPO pairs (`composer_diloco.channels.dpo_pairs`): the pure pairing rules, then replay and scoring against a
real tool-environment server process, on episodes played by `play_episodes` with a scripted stand-in for
the sampler (so their token layout is exactly the rollout's)."""

from __future__ import annotations

import copy
import itertools
import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

from composer_diloco.rollout import episodes as rollout

from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.chat import ParsedCall, episode_messages, parse_tool_call
from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.rollout.episode_tokens import generation_prompt_ids, message_ids, turn_spans
from composer_diloco.channels.hints import DEFAULT_HINTS, HintRegistry
from composer_diloco.policy import build_tiny_model, load_default_tokenizer, tokenize_episode
from composer_diloco.channels.dpo_pairs import (
    TEACHERS,
    make_teachers,
    Candidate,
    PairStats,
    ReplayError,
    TurnCandidates,
    build_pairs,
    collect_pairs,
    error_sites,
    render_tool_call,
    replay_to,
    score_candidate,
    scripted_teacher,
    site_contexts,
)
from composer_diloco.rollout.episodes import Episode, OpenEnvSession, Turn
from composer_diloco.rollout.env_package import load_env_package
from envs.tool_env import demos as tool_demos
from envs.tool_env.tasks import ITEM_VOCAB, execute, make_task, solve

TOOL_ENV = load_env_package("envs.tool_env.server")
SCRIPTED = make_teachers(["scripted"], TOOL_ENV)
"""The ``"scripted"`` teacher of the tool env, as the trainer builds it from the env contract."""

MAX_TOOL_CALLS = 8
SEED = 3


# ------------------------------------------------------------------------------------------------ build_pairs


def _cand(source: str, ids: list[int]) -> Candidate:
    return Candidate(source, f"text-{source}", ids, ParsedCall(None, None, "no tool call"))


def _group(scores: list[float], *, turn: int = 1, ids: list[list[int]] | None = None) -> TurnCandidates:
    ids = ids or [[10 + i] for i in range(len(scores))]
    cands = [_cand(f"s{i}", x) for i, x in enumerate(ids)]
    return TurnCandidates("ep", turn, [1, 2, 3], cands, scores)


@pytest.mark.timeout(10)
def test_exhaustive_pairs_all_above_threshold_sorted_by_difference():
    pairs, stats = build_pairs([_group([0.0, 1.0, 0.5, 0.0])], mode="exhaustive", min_score_diff=0.5,
                               max_pairs_per_turn=10)
    got = [(p.chosen_source, p.rejected_source, p.score_diff) for p in pairs]
    # 1.0 beats both 0.0s by 1.0 (first), then 0.5 vs 1.0-0.5 and 0.5 vs the 0.0s; 0.0 vs 0.0 is no preference.
    assert got == [("s1", "s0", 1.0), ("s1", "s3", 1.0), ("s1", "s2", 0.5), ("s2", "s0", 0.5), ("s2", "s3", 0.5)]
    assert all(p.chosen_score > p.rejected_score for p in pairs)
    assert pairs[0].prompt_ids == [1, 2, 3] and pairs[0].chosen_ids == [11] and pairs[0].rejected_ids == [10]
    assert stats == PairStats(sites=1, candidates=4, pairs=5, skipped_no_score_diff=1)


@pytest.mark.timeout(10)
def test_best_vs_worst_is_one_pair_first_best_against_first_worst():
    pairs, stats = build_pairs([_group([0.0, 1.0, 0.5, 1.0, 0.0])], mode="best_vs_worst", min_score_diff=0.5,
                               max_pairs_per_turn=10)
    assert [(p.chosen_source, p.rejected_source) for p in pairs] == [("s1", "s0")]
    assert stats == PairStats(sites=1, candidates=5, pairs=1)


@pytest.mark.timeout(10)
def test_min_score_diff_filters_and_counts():
    groups = [_group([0.0, 0.3, 0.6])]
    pairs, stats = build_pairs(groups, mode="exhaustive", min_score_diff=0.5, max_pairs_per_turn=10)
    assert [(p.chosen_source, p.rejected_source) for p in pairs] == [("s2", "s0")]
    assert stats.skipped_no_score_diff == 2 and stats.pairs == 1
    pairs, stats = build_pairs(groups, mode="best_vs_worst", min_score_diff=0.7, max_pairs_per_turn=10)
    assert pairs == [] and stats.skipped_no_score_diff == 1
    # min_score_diff 0 still never pairs a tie.
    pairs, stats = build_pairs([_group([1.0, 1.0])], mode="exhaustive", min_score_diff=0.0, max_pairs_per_turn=10)
    assert pairs == [] and stats.skipped_no_score_diff == 1


@pytest.mark.timeout(10)
def test_max_pairs_per_turn_caps_the_largest_differences_first():
    pairs, stats = build_pairs([_group([0.0, 1.0, 0.5, 0.0])], mode="exhaustive", min_score_diff=0.5,
                               max_pairs_per_turn=2)
    assert [p.score_diff for p in pairs] == [1.0, 1.0]
    assert stats.capped == 3 and stats.pairs == 2
    # n (n - 1) / 2 candidate pairs are all accounted for.
    assert stats.pairs + stats.capped + stats.skipped_no_score_diff == 4 * 3 // 2


@pytest.mark.timeout(10)
def test_single_candidate_and_duplicates_are_skipped_and_counted():
    groups = [
        _group([1.0], turn=1),  # one candidate
        _group([0.0, 1.0, 1.0], turn=3, ids=[[7, 8], [7, 8], [9]]),  # s1 duplicates s0's tokens: dropped
        _group([0.0, 1.0], turn=5, ids=[[4], [4]]),  # the only two are identical: a single distinct candidate
    ]
    pairs, stats = build_pairs(groups, mode="exhaustive", min_score_diff=0.5, max_pairs_per_turn=4)
    assert [(p.turn, p.chosen_source, p.rejected_source) for p in pairs] == [(3, "s2", "s0")]
    assert stats == PairStats(sites=3, candidates=6, pairs=1, skipped_single_candidate=2, skipped_duplicate=2)
    assert all(p.chosen_ids != p.rejected_ids for p in pairs)
    _, stats = build_pairs(groups, mode="best_vs_worst", min_score_diff=0.5, max_pairs_per_turn=4)
    assert (stats.pairs, stats.skipped_single_candidate, stats.skipped_duplicate) == (1, 2, 2)


@pytest.mark.timeout(10)
def test_build_pairs_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        build_pairs([], mode="all", min_score_diff=0.5, max_pairs_per_turn=1)
    with pytest.raises(ValueError, match="min_score_diff"):
        build_pairs([], mode="exhaustive", min_score_diff=-0.1, max_pairs_per_turn=1)
    with pytest.raises(ValueError, match="max_pairs_per_turn"):
        build_pairs([], mode="exhaustive", min_score_diff=0.5, max_pairs_per_turn=0)
    with pytest.raises(ValueError, match="2 candidates but 1 scores"):
        TurnCandidates("ep", 1, [], [_cand("a", [1]), _cand("b", [2])], [1.0])
    assert build_pairs([], mode="exhaustive", min_score_diff=0.5, max_pairs_per_turn=1) == ([], PairStats())


@pytest.mark.timeout(10)
def test_pair_stats_add():
    a, b = PairStats(sites=1, pairs=2, no_hint=1), PairStats(sites=2, replay_errors=1)
    assert (a + b).as_dict() == {**PairStats().as_dict(), "sites": 3, "pairs": 2, "no_hint": 1, "replay_errors": 1}


# ------------------------------------------------------------------------------------- rendering and teachers


@pytest.fixture(scope="module")
def tok():
    return load_default_tokenizer()


@pytest.mark.timeout(30)
def test_render_tool_call_is_what_the_warm_start_trains_on(tok):
    calls = [("lookup", {"item": "fig"}), ("add", {"a": 3, "b": 4}), ("submit", {"answer": 7})]
    enc = tokenize_episode(tok, episode_messages("What is the price of fig plus the price of kiwi?", calls,
                                                 ["3", "7", "submitted 7"]))
    trained = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    rendered = [render_tool_call(tok, name, args) for name, args in calls]
    assert trained == [i for _, ids in rendered for i in ids]
    text, ids = rendered[0]
    assert text.endswith(tok.eos_token) and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert parse_tool_call(text) == ParsedCall("lookup", {"item": "fig"}, None)


def _episode_with_calls(seed: int, episode_id: str, calls) -> Episode:
    """A token-free Episode (turns only) playing ``calls`` through the pure task logic."""
    task = make_task(seed, episode_id)
    turns = [Turn("user", task.question)]
    for name, args in calls:
        content, kind, meta = execute(task, name, args)
        turns += [Turn("assistant", "", {"name": name, "arguments": args}), Turn("tool", content, None, kind, meta)]
    return Episode(seed, episode_id, turns, [], [])


@pytest.mark.timeout(10)
def test_scripted_teacher_proposes_the_call_the_failed_one_attempted():
    scripted = scripted_teacher(tool_demos.script)
    for i in range(40):
        task = make_task(SEED, f"t{i}")
        calls = solve(task, random.Random(i), 1.0)  # one failed call, right before the call it attempts
        ep = _episode_with_calls(SEED, f"t{i}", calls)
        (site,) = error_sites(ep)
        at = (site - 1) // 2  # index of the failed call in `calls`
        assert scripted(ep, site) == calls[at + 1]
    # An off-script successful call does not make it skip a step; a foreign episode gets no proposal.
    task = make_task(SEED, "off")
    other = next(item for item in task.catalogue if item not in (task.x, task.y))
    ep = _episode_with_calls(SEED, "off", [("lookup", {"item": other}), ("sum", {})])
    assert scripted(ep, 3) == ("lookup", {"item": task.x})
    ep.turns[0] = Turn("user", "Something else?")
    assert scripted(ep, 3) is None
    assert set(TEACHERS) == {"scripted"} and set(SCRIPTED) == {"scripted"}


@pytest.mark.timeout(30)
def test_scripted_teacher_writes_the_reference_after_a_failed_coding_call():
    """On a coding episode the teacher follows the coding env's script: at a failed run_tests after a wrong write
    (an error site), it proposes writing the reference solution; after that, running the tests."""
    from envs.coding_env.tasks import make_task as coding_task

    scripted = make_teachers(["scripted"], load_env_package("envs.coding_env.server"))["scripted"]
    for source in ("generated", "mixed"):
        task = coding_task(SEED, f"c-{source}", source)
        wrong = {"path": "solution.py", "content": task.starter}
        turns = [Turn("user", task.question)]
        for name, args, kind in [("read_file", {"path": "solution.py"}, None), ("write_file", wrong, None),
                                 ("run_tests", {}, "execution_error")]:
            turns += [Turn("assistant", "", {"name": name, "arguments": args}), Turn("tool", "x", None, kind, {})]
        ep = Episode(SEED, f"c-{source}", turns, [], [])
        assert error_sites(ep) == [5]
        assert scripted(ep, 5) == ("write_file", {"path": "solution.py", "content": task.reference})
        ep.turns[3] = Turn("assistant", "", {"name": "write_file",
                                             "arguments": {"path": "solution.py", "content": task.reference}})
        assert scripted(ep, 5) == ("run_tests", {})


@pytest.mark.timeout(10)
def test_error_sites_are_assistant_turns_followed_by_a_failed_tool_turn():
    task = make_task(SEED, "sites")
    outside = next(item for item in ITEM_VOCAB if item not in task.catalogue)
    ep = _episode_with_calls(SEED, "sites", [("lookup", {"item": outside}), ("lookup", {"item": task.x}),
                                            ("sum", {"a": 1}), ("add", {"x": 1})])
    assert error_sites(ep) == [1, 5, 7]
    assert error_sites(Episode(0, "e", [Turn("user", "q")], [], [])) == []


# ------------------------------------------------------------------------ real env server, real rollout layout


@pytest.fixture(scope="module")
def server():
    env = start_env_server()
    try:
        yield env
    finally:
        env.stop()


@pytest.fixture(scope="module")
def session(server):
    s = OpenEnvSession(server.url, max_tool_calls=MAX_TOOL_CALLS)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, seed=0)


def _turn_ids(tok, name: str, args: dict) -> list[int]:
    """A generated tool-call turn, written out by hand in the Qwen3/Hermes format, ending with EOS."""
    text = "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _play_scripted(tok, url: str, keys, scripts, monkeypatch) -> list[Episode]:
    """Play episodes through `play_episodes` against the server; the sampler emits the scripted calls.

    Tool replies are rendered with TRL's own ``GRPOTrainer._get_tool_suffix_ids`` (what the trainer passes in).
    """
    # As `ComposerGRPOTrainer` sets it up: Qwen3's template is not prefix-preserving, so TRL's training template.
    template = None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)
    trl_self = SimpleNamespace(processing_class=tok, chat_template=template, chat_template_kwargs={}, _is_vlm=False,
                               _tokenizer=tok)
    step = itertools.count()

    def scripted_generate(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        j = next(step)
        active = [s for s in scripts if len(s) > j]  # every script ends with a correct submit
        assert len(contexts) == len(active)
        ids = [_turn_ids(tok, *s[j]) for s in active]
        return ids, [[-0.5] * len(x) for x in ids]

    sessions = [OpenEnvSession(url, max_tool_calls=MAX_TOOL_CALLS) for _ in keys]
    try:
        with monkeypatch.context() as m:
            m.setattr(rollout, "generate_turns", scripted_generate)
            episodes = play_episodes(
                None, tok, sessions, keys, tool_suffix_ids=lambda msgs: GRPOTrainer._get_tool_suffix_ids(trl_self,
                                                                                                         msgs),
                max_tool_calls=MAX_TOOL_CALLS, max_turn_tokens=64, max_seq_len=4096, temperature=1.0,
            )
    finally:
        for s in sessions:
            s.close()
    for ep, script in zip(episodes, scripts):
        assert ep.end_reason == "done" and ep.reward == 1.0, (ep.end_reason, script)
        assert len(ep.turns) == 1 + 2 * len(script)
    return episodes


@pytest.fixture(scope="module")
def two_episodes(server, tok):
    """Episode "a": a lookup of an unknown item first; episode "b": an unknown tool at the operation step."""
    task_a, task_b = make_task(SEED, "a"), make_task(SEED, "b")
    outside = next(item for item in ITEM_VOCAB if item not in task_a.catalogue)
    good_a = solve(task_a, random.Random(0), 0.0)
    good_b = solve(task_b, random.Random(0), 0.0)
    scripts = [
        [("lookup", {"item": outside})] + good_a,
        good_b[:2] + [("sum", dict(good_b[2][1]))] + good_b[2:],
    ]
    with pytest.MonkeyPatch.context() as mp:
        return _play_scripted(tok, server.url, [(SEED, "a"), (SEED, "b")], scripts, mp)


@pytest.mark.timeout(60)
def test_replay_reproduces_the_recorded_trace(two_episodes, session, tok):
    a, b = two_episodes
    assert error_sites(a) == [1] and error_sites(b) == [5]
    assert a.turns[2].error_kind == "execution_error" and b.turns[6].error_kind == "tool_not_found"
    for ep in (a, b):
        for turn in [k for k, t in enumerate(ep.turns) if t.role == "assistant"]:
            replay_to(session, ep, turn)  # raises on any difference
            # The session now stands right before `turn`: its recorded call gives the recorded reply.
            call = ep.turns[turn].tool_call
            content, kind, _, _, _ = session.call(call["name"], call["arguments"])
            assert (content, kind) == (ep.turns[turn + 1].content, ep.turns[turn + 1].error_kind)
    with pytest.raises(ValueError, match="not an assistant turn"):
        replay_to(session, b, 2)


@pytest.mark.timeout(60)
def test_replay_error_names_episode_and_turn(two_episodes, session):
    b = copy.deepcopy(two_episodes[1])
    b.turns[4].content = "999"  # the second lookup's recorded reply
    with pytest.raises(ReplayError, match=r"episode b \(seed 3\) to turn 5: turn 3 call lookup"):
        replay_to(session, b, 5)


@pytest.mark.timeout(60)
def test_scores_scripted_one_recorded_zero(two_episodes, session, tok):
    for ep in two_episodes:
        (site,) = error_sites(ep)
        recorded = ep.turns[site]
        rec = Candidate("recorded", recorded.content, [], parse_tool_call(recorded.content))
        assert score_candidate(session, ep, site, rec) == 0.0
        text, ids = render_tool_call(tok, *SCRIPTED["scripted"](ep, site))
        assert score_candidate(session, ep, site, Candidate("scripted", text, ids, parse_tool_call(text))) == 1.0
        junk = Candidate("policy", "no call", [5], parse_tool_call("no call"))
        assert score_candidate(session, ep, site, junk) == 0.0
    # A call that ends the episode scores the env's reward: at b's submit turn, the right answer 1.0, a wrong 0.0.
    b = two_episodes[1]
    submit_turn = len(b.turns) - 2
    answer = make_task(SEED, "b").answer
    for value, expected in ((answer, 1.0), (answer + 1, 0.0)):
        text, ids = render_tool_call(tok, "submit", {"answer": value})
        assert score_candidate(session, b, submit_turn, Candidate("x", text, ids, parse_tool_call(text))) == expected


@pytest.mark.timeout(30)
def test_site_contexts_student_is_the_rollout_context_teacher_adds_the_hint(two_episodes, tok):
    b = two_episodes[1]
    (site,) = error_sites(b)
    span = next(s for s in turn_spans(b, tok.eos_token_id) if s.turn == site)
    ids = b.prompt_ids + b.completion_ids
    hint = DEFAULT_HINTS.hint(b.turns[site + 1].error_kind, b.turns[site + 1].error_meta)
    student, teacher = site_contexts(b, site, tok, hint)
    assert student == ids[: span.start]
    header = generation_prompt_ids(tok)
    assert student[-len(header):] == header
    h = len(student) - len(header)
    assert teacher == student[:h] + message_ids(tok, hint) + student[h:]
    assert "There is no tool 'sum'" in tok.decode(teacher[h:])
    assert site_contexts(b, site, tok, None) == (student, None)


def _check_stats(pairs, stats, n_sites, per_site):
    assert stats.pairs == len(pairs)
    assert stats.sites == n_sites and stats.replay_errors == 0
    assert stats.candidates == n_sites * per_site
    assert stats.skipped_duplicate >= 0 and stats.skipped_single_candidate == 0


@pytest.mark.timeout(120)
def test_collect_pairs_prefers_the_scripted_teacher(two_episodes, session, tok, model):
    episodes = list(two_episodes)
    pairs, stats = collect_pairs(model, tok, episodes, session, teachers=SCRIPTED, mode="exhaustive",
                                 min_score_diff=0.5, max_pairs_per_turn=4, max_sites=8, max_turn_tokens=16,
                                 temperature=1.0, samples_per_source=2, seed=0)
    # Per site: recorded + 2 policy + 2 policy+hint + scripted.
    _check_stats(pairs, stats, n_sites=2, per_site=6)
    assert stats.no_hint == 0 and stats.sites_over_cap == 0
    scripted = [p for p in pairs if p.chosen_source == "scripted"]
    assert {p.episode_id for p in scripted} == {"a", "b"}
    for p in scripted:
        assert p.rejected_source in ("recorded", "policy", "policy+hint")
        assert (p.chosen_score, p.rejected_score) == (1.0, 0.0)
        ep = episodes[0] if p.episode_id == "a" else episodes[1]
        assert p.prompt_ids == site_contexts(ep, p.turn, tok, None)[0]  # the student context, never the hint's
    recorded = [p for p in pairs if p.rejected_source == "recorded"]
    assert recorded
    for p in recorded:  # the recorded turn's own tokens, right after the prompt, EOS included
        ep = episodes[0] if p.episode_id == "a" else episodes[1]
        ids = ep.prompt_ids + ep.completion_ids
        assert p.rejected_ids == ids[len(p.prompt_ids): len(p.prompt_ids) + len(p.rejected_ids)]
        assert p.rejected_ids[-1] == tok.eos_token_id
    # Exhaustive accounting: with d distinct candidates per site, d (d - 1) / 2 candidate pairs.
    distinct = stats.candidates - stats.skipped_duplicate
    assert stats.pairs + stats.capped + stats.skipped_no_score_diff <= distinct * (distinct - 1) // 2

    # Same seed, same pairs; best_vs_worst gives one pair per site.
    again, _ = collect_pairs(model, tok, episodes, session, teachers=SCRIPTED, mode="exhaustive",
                             min_score_diff=0.5, max_pairs_per_turn=4, max_sites=8, max_turn_tokens=16,
                             temperature=1.0, samples_per_source=2, seed=0)
    assert again == pairs
    bvw, stats = collect_pairs(model, tok, episodes, session, hints=HintRegistry({}), teachers=SCRIPTED,
                               mode="best_vs_worst", min_score_diff=0.5, max_pairs_per_turn=4, max_sites=1,
                               max_turn_tokens=16, temperature=1.0, samples_per_source=1, seed=0)
    assert [(p.episode_id, p.chosen_source) for p in bvw] == [("a", "scripted")]
    assert stats.no_hint == 1 and stats.sites_over_cap == 1
    _check_stats(bvw, stats, n_sites=1, per_site=3)  # recorded + policy + scripted: no hint, no hinted sample


@pytest.mark.timeout(60)
def test_script_progress_scores_an_accepted_off_script_call_like_an_error(two_episodes, session, tok, model):
    """Episode "a" failed a lookup of an unknown item. An "offscript" teacher looks up a catalogue item the question
    does not ask about: the env accepts it, so the plain score prefers it to the failed call; with the env's
    `script_progress` it scores 0.0, forms no pair with the failed call, and only the scripted call is chosen."""
    from composer_diloco.channels.dpo_teachers import script_progress, script_remaining

    a = two_episodes[0]
    task = make_task(SEED, "a")
    other = next(item for item in task.catalogue if item not in (task.x, task.y))
    teachers = {"offscript": lambda ep, turn: ("lookup", {"item": other}), **SCRIPTED}
    (site,) = error_sites(a)
    assert script_remaining(tool_demos.script, a, site) == solve(task, random.Random(0), 0.0)
    progress = script_progress(TOOL_ENV)
    assert progress(a, site) == script_remaining(tool_demos.script, a, site)
    kw = dict(teachers=teachers, mode="exhaustive", min_score_diff=0.5, max_pairs_per_turn=8, max_sites=1,
              max_turn_tokens=8, temperature=1.0, samples_per_source=0, hints=None)
    plain, _ = collect_pairs(model, tok, [a], session, **kw)
    assert {(p.chosen_source, p.rejected_source) for p in plain} == {("offscript", "recorded"),
                                                                     ("scripted", "recorded")}
    fixed, stats = collect_pairs(model, tok, [a], session, progress=progress, **kw)
    assert {(p.chosen_source, p.rejected_source, p.chosen_score, p.rejected_score) for p in fixed} == {
        ("scripted", "recorded", 1.0, 0.0), ("scripted", "offscript", 1.0, 0.0)}
    assert stats.skipped_no_score_diff == 1  # offscript against recorded: both 0.0
    # an env without a script: every accepted call scores as before
    assert collect_pairs(model, tok, [a], session, progress=lambda ep, turn: None, **kw)[0] == plain


@pytest.mark.timeout(60)
def test_collect_pairs_counts_replay_errors_instead_of_raising(two_episodes, session, tok, model):
    a, b = two_episodes
    bad = copy.deepcopy(b)
    bad.turns[4].content = "999"
    pairs, stats = collect_pairs(model, tok, [a, bad], session, teachers=SCRIPTED, max_turn_tokens=8,
                                 samples_per_source=0)
    assert stats.replay_errors == 1 and stats.sites == 2
    assert {p.episode_id for p in pairs} == {"a"}
    with pytest.raises(ValueError, match="unknown teacher"):
        make_teachers(["oracle"], TOOL_ENV)
    with pytest.raises(ValueError, match="clash with the built-in sources"):
        collect_pairs(model, tok, [a], session, teachers={"policy": SCRIPTED["scripted"]})


@pytest.mark.timeout(120)
def test_collect_pairs_batch_of_eight(server, session, tok, model):
    """Eight solver episodes with one failed call each (every error kind), one batched generation."""
    keys = [(SEED, f"batch-{i}") for i in range(8)]
    scripts = [solve(make_task(s, e), random.Random(f"fail-{i}"), 1.0) for i, (s, e) in enumerate(keys)]
    with pytest.MonkeyPatch.context() as mp:
        episodes = _play_scripted(tok, server.url, keys, scripts, mp)
    assert {ep.turns[s + 1].error_kind for ep in episodes for s in error_sites(ep)} == {
        "tool_not_found", "invalid_args", "execution_error"}
    start = time.perf_counter()
    pairs, stats = collect_pairs(model, tok, episodes, session, teachers=SCRIPTED, mode="best_vs_worst",
                                 min_score_diff=0.5, max_pairs_per_turn=4, max_sites=64, max_turn_tokens=40,
                                 temperature=1.0, samples_per_source=1, seed=0)
    elapsed = time.perf_counter() - start
    print(f"collect_pairs: 8 episodes, {stats.sites} sites, {stats.pairs} pairs in {elapsed:.2f} s")
    _check_stats(pairs, stats, n_sites=8, per_site=4)
    assert len(pairs) == 8 and all(p.chosen_source == "scripted" for p in pairs)


# ------------------------------------------------------------------------------ recovery pairs (dpo_score = "recovery")
@pytest.mark.timeout(60)
def test_a_recovery_is_token_for_token_the_episode_that_follows_the_script(two_episodes, session, tok):
    """Both episodes recovered by following the script after their failed call, so the recovery played from the site
    is their own continuation: the same calls, replies and headers, token for token, the replies masked out (the
    rollout's env mask), ending in the correct submit (reward 1)."""
    from composer_diloco.channels.dpo_recovery import play_recovery

    for ep in two_episodes:
        (site,) = error_sites(ep)
        spans = {s.turn: s for s in turn_spans(ep, tok.eos_token_id)}
        start = spans[site + 2].start  # the first call after the failed one
        recovery = play_recovery(session, ep, site, tok, TOOL_ENV.script)
        assert recovery is not None and recovery.reward == 1.0, recovery
        assert recovery.calls == (len(ep.turns) - 1 - (site + 2)) // 2 + 1
        assert recovery.token_ids == (ep.prompt_ids + ep.completion_ids)[start:]
        assert recovery.mask == ep.env_mask[start - len(ep.prompt_ids):]
        assert recovery.mask[-1] == 1 and 0 in recovery.mask  # it ends on the submit's EOS; replies are context
        assert "submit" in tok.decode([t for t, m in zip(recovery.token_ids, recovery.mask) if m])


@pytest.mark.timeout(60)
def test_recovery_pairs_one_per_site_chosen_the_recovery_rejected_the_failed_call(two_episodes, session, tok):
    from composer_diloco.channels.dpo_recovery import recovery_pairs

    episodes = list(two_episodes)
    pairs, stats = recovery_pairs(tok, episodes, session, TOOL_ENV.script, max_sites=8)
    assert [p.episode_id for p in pairs] == ["a", "b"]
    assert (stats.sites, stats.pairs, stats.candidates, stats.replay_errors) == (2, 2, 4, 0)
    for p, ep in zip(pairs, episodes):
        (site,) = error_sites(ep)
        ids = ep.prompt_ids + ep.completion_ids
        span = next(s for s in turn_spans(ep, tok.eos_token_id) if s.turn == site)
        assert p.turn == site and p.prompt_ids == site_contexts(ep, site, tok, None)[0]  # the student context
        assert p.rejected_ids == ids[span.start: span.end] and p.rejected_source == "recorded"
        assert (p.chosen_source, p.chosen_score, p.rejected_score) == ("recovery", 1.0, 0.0)
        assert len(p.chosen_mask) == len(p.chosen_ids)
    # a bar the recoveries' reward does not reach, and the cap on sites: counted, never silently dropped
    none, stats = recovery_pairs(tok, episodes, session, TOOL_ENV.script, min_score_diff=1.5)
    assert none == [] and stats.skipped_no_score_diff == 2
    one, stats = recovery_pairs(tok, episodes, session, TOOL_ENV.script, max_sites=1)
    assert [p.episode_id for p in one] == ["a"] and stats.sites_over_cap == 1
    # a script that knows nothing of the episodes: no recovery, no pair
    none, stats = recovery_pairs(tok, episodes, session, lambda seed, episode_id, question: None)
    assert none == [] and stats.skipped_single_candidate == 2
    with pytest.raises(ValueError, match="max_sites"):
        recovery_pairs(tok, episodes, session, TOOL_ENV.script, max_sites=0)


@pytest.mark.timeout(60)
def test_dpo_rows_score_only_the_recoverys_calls(two_episodes, session, tok, model):
    """The chosen row's response mask is the recovery's mask after the prompt (the replies add nothing to log p), and
    the reference log-prob is the sum over exactly those tokens."""
    from composer_diloco.channels.dpo import DpoStats
    from composer_diloco.channels.dpo_recovery import recovery_pairs
    from composer_diloco.channels.dpo_rows import dpo_rows
    from composer_diloco.channels.losses import sequence_logprobs

    pairs, _ = recovery_pairs(tok, list(two_episodes), session, TOOL_ENV.script)
    stats = DpoStats()
    rows = dpo_rows(pairs, model, pad_token_id=tok.pad_token_id or 0, max_length=4096, stats=stats)
    assert stats.dpo_pairs == 2
    for i, p in enumerate(pairs):
        n = len(p.prompt_ids)
        mask = rows["dpo_chosen_response_mask"][i]
        assert mask[:n].sum() == 0 and mask[n: n + len(p.chosen_ids)].tolist() == list(p.chosen_mask)
        assert mask[n + len(p.chosen_ids):].sum() == 0
        rejected = rows["dpo_rejected_response_mask"][i]
        assert rejected[n: n + len(p.rejected_ids)].sum() == len(p.rejected_ids)  # a single call: all of it
        ids = rows["dpo_chosen_ids"][i: i + 1]
        logits = model(input_ids=ids, attention_mask=rows["dpo_chosen_attention_mask"][i: i + 1]).logits.float()
        expected = sequence_logprobs(logits, ids, mask[None])
        assert torch.allclose(rows["dpo_ref_chosen_logps"][i], expected[0], atol=1e-4)


@pytest.mark.timeout(60)
def test_the_dpo_channel_builds_recovery_pairs_and_refuses_an_env_without_a_script(two_episodes, session, tok, model):
    """``[loss] dpo_score = "recovery"``: the channel's rows are the recovery pairs' (no sampled candidate); an env
    package without a scripted solver is refused when the channel is built, in one line naming the package."""
    import dataclasses

    from composer_diloco.channels.base import ChannelContext
    from composer_diloco.channels.dpo import DpoChannel, DpoStats
    from composer_diloco.config import RunConfig

    config = RunConfig(loss={"beta_dpo": 0.2, "dpo_score": "recovery"})
    ctx = ChannelContext(config=config, model=model, tokenizer=tok, sessions=[session], env=TOOL_ENV,
                         hints=DEFAULT_HINTS)
    channel = DpoChannel.from_context(ctx)
    stats = DpoStats()
    rows = channel.build(model, list(two_episodes), stats)
    assert stats.pair_stats.pairs == stats.dpo_pairs == 2 and rows["dpo_chosen_ids"].shape[0] == 2
    assert rows["dpo_chosen_response_mask"].sum() < rows["dpo_chosen_attention_mask"].sum()  # replies are context
    no_script = dataclasses.replace(TOOL_ENV, script=None)
    with pytest.raises(ValueError, match=r"dpo_score = 'recovery' .* 'envs.tool_env' has none") as e:
        DpoChannel.from_context(dataclasses.replace(ctx, env=no_script))
    assert "\n" not in str(e.value)
    assert RunConfig().digest() == RunConfig(loss={"dpo_score": "accepted"}).digest()  # the default's digest stays
