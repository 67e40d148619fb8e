"""The channels' rows: SDPO sites and their alignment (episodes and raw traces, two chat templates:
`channels.sdpo_sites`), DPO rows with the reference log-probs (`channels.dpo_rows`)."""


import pytest
import torch
from trl.chat_template_utils import get_training_chat_template

from composer_diloco.channels.dpo import DpoStats
from composer_diloco.channels.dpo_pairing import PreferencePair
from composer_diloco.channels.dpo_rows import dpo_rows
from composer_diloco.channels.sdpo_sites import SdpoStats, SiteFinder
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.channels.hints import DEFAULT_HINTS
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.rollout.episodes import Turn
from envs.tool_env.tasks import TOOL_SCHEMAS, execute, make_task
from episode_support import scripted_episode, tool_call_text

TRL_TEMPLATES = __import__("pathlib").Path(__import__("trl").__file__).parent / "chat_templates"


@pytest.fixture(scope="module")
def qwen_tok():
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def llama_tok():
    tok = load_default_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                          "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = (TRL_TEMPLATES / "llama3_1.jinja").read_text()
    tok.eos_token = "<|eot_id|>"
    tok.bos_token = "<|begin_of_text|>"
    return tok


def failing_steps(tok, task, n_errors: int, n_turns: int):
    """Assistant texts (calls rendered by ``tok``'s template) and env replies: ``n_errors`` wrong calls, each
    followed by a correct recovery call."""
    bad = [("sum", {"a": 1, "b": 2}), ("lookup", {"item": "zzz"}), ("add", {"x": 3})]
    good = [("lookup", {"item": task.x}), ("lookup", {"item": task.y})]
    steps = []
    for k in range(n_turns):
        name, args = bad[(k // 2) % 3] if (k % 2 == 0 and k // 2 < n_errors) else good[k % 2]
        content, kind, meta = execute(task, name, args)
        steps.append((tool_call_text(tok, name, args), content, kind, meta))
    return steps


def episode_sites(finder: SiteFinder, episodes) -> tuple[list, SdpoStats]:
    """The sites of ``episodes`` as the SDPO channel finds them, and their counts."""
    stats = SdpoStats()
    return [site for ep in episodes for site in finder.sites_from_episode(ep, stats)], stats


def check_sites(collator, sites, turns_text):
    for site in sites:
        s, t = torch.tensor(site.student_ids), torch.tensor(site.teacher_ids)
        assert torch.equal(s[site.student_idx], t[site.teacher_idx])  # aligned token by token
        region = collator.tokenizer.decode(s[site.student_idx].tolist())
        assert region == turns_text[site.turn]  # exactly the recovery turn's content
        # the teacher is the student with one inserted block holding the hint, before the region
        hint_len = len(site.teacher_ids) - len(site.student_ids)
        assert hint_len > 0 and site.teacher_idx == [i + hint_len for i in site.student_idx]
        start = next(i for i, (a, b) in enumerate(zip(site.student_ids, site.teacher_ids)) if a != b)
        block = site.teacher_ids[start:start + hint_len]
        assert site.student_ids[start:] == site.teacher_ids[start + hint_len:]
        assert site.hint in collator.tokenizer.decode(block)
        assert start + hint_len <= site.teacher_idx[0]  # hint tokens carry no loss


def test_episode_sites_align_and_cover_only_the_recovery(qwen_tok):
    task = make_task(0, "c1")
    steps = failing_steps(qwen_tok, task, n_errors=2, n_turns=6)
    ep = scripted_episode(qwen_tok, seed=0, episode_id="c1", question=task.question, tools=TOOL_SCHEMAS, steps=steps)
    collator = SiteFinder(qwen_tok)
    sites, stats = episode_sites(collator, [ep])
    assert stats.sdpo_sites == 2 and len(sites) == 2
    texts = {k: steps[(k - 1) // 2][0] for k in range(1, len(ep.turns), 2)}
    check_sites(collator, sites, texts)
    tensors = collator.tensors(sites)
    assert tensors["sdpo_student_ids"].shape[0] == 2
    # masks and index tensors say the same thing; hint tokens carry no loss
    for row, site in enumerate(sites):
        assert tensors["sdpo_student_mask"][row].nonzero().flatten().tolist() == site.student_idx
        assert tensors["sdpo_teacher_mask"][row].nonzero().flatten().tolist() == site.teacher_idx
        hint_ids = site.teacher_ids[len(site.teacher_ids) - len(site.student_ids):]
        assert collator.tokenizer.decode(site.teacher_ids).count("Use one of") + \
            collator.tokenizer.decode(site.teacher_ids).count("unknown item") >= 1 and hint_ids
    # the student is a prefix of the very ids the GRPO channel trains on
    full = ep.prompt_ids + ep.completion_ids
    for site in sites:
        assert full[: len(site.student_ids)] == site.student_ids


@pytest.mark.parametrize("template", ["qwen", "llama"])
def test_raw_traces_under_two_chat_templates(template, qwen_tok, llama_tok):
    tok = qwen_tok if template == "qwen" else llama_tok
    task = make_task(1, "c2")
    steps = failing_steps(qwen_tok, task, n_errors=1, n_turns=4)
    turns = [Turn("user", task.question)]
    for text, reply, kind, meta in steps:
        turns += [Turn("assistant", text), Turn("tool", reply, None, kind, meta)]
    collator = SiteFinder(tok, max_length=8192)
    stats = SdpoStats()
    ids, sites = collator.sites_from_trace(turns, TOOL_SCHEMAS, stats)
    assert len(sites) == 1 and stats.sdpo_sites == 1
    check_sites(collator, sites, {k: t.content for k, t in enumerate(turns)})
    assert ids[: len(sites[0].student_ids)] == sites[0].student_ids


def _trace_with_recovery(tok, task, recovery: str) -> list[Turn]:
    """user, a failed call (as ``tok``'s template renders it), its tool error, then an assistant recovery turn with
    text ``recovery``, a tool reply."""
    name, args = "sum", {"a": 1, "b": 2}
    content, kind, meta = execute(task, name, args)
    assert kind is not None
    return [Turn("user", task.question), Turn("assistant", tool_call_text(tok, name, args)),
            Turn("tool", content, None, kind, meta), Turn("assistant", recovery), Turn("tool", "ok")]


@pytest.mark.parametrize("template", ["qwen", "llama"])
@pytest.mark.parametrize("recovery", ["", "   ", "\n"])
def test_raw_trace_empty_recovery_is_skipped_and_counted(template, recovery, qwen_tok, llama_tok):
    """An empty or whitespace-only recovery turn is no site: counted in sdpo_skipped_empty_recovery, not an error
    (it used to raise 'chat template: no assistant header before turn 3')."""
    tok = qwen_tok if template == "qwen" else llama_tok
    stats = SdpoStats()
    ids, sites = SiteFinder(tok, max_length=8192).sites_from_trace(
        _trace_with_recovery(tok, make_task(1, "empty"), recovery), TOOL_SCHEMAS, stats)
    assert sites == [] and len(ids) > 0
    assert stats.sdpo_skipped_empty_recovery == 1 and stats.sdpo_sites == 0


@pytest.mark.parametrize("template", ["qwen", "llama"])
@pytest.mark.parametrize("recovery", ["end", "assistant", "im", "eot"])
def test_raw_trace_short_recovery_found_in_its_own_turn(template, recovery, qwen_tok, llama_tok):
    """A recovery text that also occurs in the template's text between the tool reply and the turn (``end`` in
    ``<|im_end|>``, ``assistant`` in the header) is located after the assistant header, in the turn itself."""
    tok = qwen_tok if template == "qwen" else llama_tok
    collator = SiteFinder(tok, max_length=8192)
    turns = _trace_with_recovery(tok, make_task(1, "short"), recovery)
    stats = SdpoStats()
    ids, sites = collator.sites_from_trace(turns, TOOL_SCHEMAS, stats)
    assert len(sites) == 1 and stats.sdpo_sites == 1
    (site,) = sites
    assert site.turn == 3
    check_sites(collator, sites, {3: recovery})
    # the region ends right where the turn's content ends: what follows is the template's end of turn
    rendered = tok.apply_chat_template([{"role": t.role, "content": t.content} for t in turns[:4]],
                                       tools=TOOL_SCHEMAS, tokenize=False)
    assert tok.decode(site.student_ids).endswith(recovery) and rendered.rstrip().count(recovery) >= 1


def test_32_turn_trace_with_8_error_sites(qwen_tok):
    task = make_task(2, "c3")
    steps = failing_steps(qwen_tok, task, n_errors=8, n_turns=32)
    ep = scripted_episode(qwen_tok, seed=2, episode_id="c3", question=task.question, tools=TOOL_SCHEMAS, steps=steps)
    collator = SiteFinder(qwen_tok, max_length=4096)
    sites, stats = episode_sites(collator, [ep])
    assert stats.sdpo_sites == 8
    texts = {k: steps[(k - 1) // 2][0] for k in range(1, len(ep.turns), 2)}
    check_sites(collator, sites, texts)


def test_skips_are_counted(qwen_tok):
    task = make_task(3, "c4")
    steps = failing_steps(qwen_tok, task, n_errors=2, n_turns=4)
    ep = scripted_episode(qwen_tok, seed=3, episode_id="c4", question=task.question, tools=TOOL_SCHEMAS, steps=steps)
    no_hints = DEFAULT_HINTS.copy()
    no_hints.register("tool_not_found", "")  # an empty template turns a kind off
    _, stats = episode_sites(SiteFinder(qwen_tok, hints=no_hints), [ep])
    assert stats.sdpo_sites == 1 and stats.sdpo_skipped_no_hint == 1
    # an error on the last turn has no recovery
    last = scripted_episode(qwen_tok, seed=3, episode_id="c5", question=task.question, tools=TOOL_SCHEMAS,
                            steps=steps[:1])
    _, stats = episode_sites(SiteFinder(qwen_tok), [last])
    assert stats.sdpo_sites == 0 and stats.sdpo_skipped_no_recovery == 1


def test_truncation_keeps_the_region_or_drops_the_site(qwen_tok):
    task = make_task(4, "c6")
    steps = failing_steps(qwen_tok, task, n_errors=8, n_turns=32)
    ep = scripted_episode(qwen_tok, seed=4, episode_id="c6", question=task.question, tools=TOOL_SCHEMAS, steps=steps)
    full, _ = episode_sites(SiteFinder(qwen_tok, max_length=4096), [ep])
    longest = max(len(s.teacher_ids) for s in full)
    short, stats = episode_sites(SiteFinder(qwen_tok, max_length=longest - 40), [ep])
    assert stats.sdpo_sites == 8 and all(len(s.teacher_ids) <= longest - 40 for s in short)
    texts = {k: steps[(k - 1) // 2][0] for k in range(1, len(ep.turns), 2)}
    check_sites(SiteFinder(qwen_tok), short, texts)
    _, stats = episode_sites(SiteFinder(qwen_tok, max_length=20), [ep])
    assert stats.sdpo_sites == 0 and stats.sdpo_skipped_truncated == 8


def Pair(prompt_ids: list, chosen_ids: list, rejected_ids: list) -> PreferencePair:
    """A `PreferencePair` of these tokens (the rest of its fields do not reach the rows)."""
    return PreferencePair("e0", 1, prompt_ids, chosen_ids, rejected_ids, 1.0, 0.0, "policy", "recorded")


def test_dpo_tensors_and_reference_logps(qwen_tok):
    model = build_tiny_model(qwen_tok, seed=0)
    pairs = [Pair([1, 5, 7, 9], [11, 12, qwen_tok.eos_token_id], [13, qwen_tok.eos_token_id]),
             Pair([2, 3], [14, qwen_tok.eos_token_id], [15, 16, 17, qwen_tok.eos_token_id])]
    stats = DpoStats()
    t = dpo_rows(pairs, model, pad_token_id=qwen_tok.pad_token_id, max_length=1024, stats=stats)
    assert t["dpo_chosen_ids"].shape[0] == 2 and stats.dpo_pairs == 2 and stats.dpo_skipped_truncated == 0
    assert t["dpo_chosen_response_mask"][0].tolist()[:7] == [0, 0, 0, 0, 1, 1, 1]
    with torch.no_grad():
        logits = torch.log_softmax(model(input_ids=torch.tensor([[1, 5, 7, 9, 11, 12, qwen_tok.eos_token_id]])).logits, -1)
    hand = sum(logits[0, i - 1, tok].item() for i, tok in [(4, 11), (5, 12), (6, qwen_tok.eos_token_id)])
    assert abs(t["dpo_ref_chosen_logps"][0].item() - hand) < 1e-4
    # a pair whose response reaches max_length is dropped and counted; none left: no rows
    stats = DpoStats()
    assert dpo_rows(pairs[1:], model, pad_token_id=qwen_tok.pad_token_id, max_length=4, stats=stats) == {}
    assert (stats.dpo_pairs, stats.dpo_skipped_truncated) == (0, 1)


def test_tool_suffix_matches_trl(qwen_tok):
    from trl import GRPOTrainer

    fake = GRPOTrainer.__new__(GRPOTrainer)
    fake.processing_class, fake._tokenizer, fake._is_vlm = qwen_tok, qwen_tok, False
    fake.chat_template, fake.chat_template_kwargs = get_training_chat_template(qwen_tok), {}
    msgs = [{"role": "tool", "name": "lookup", "content": "7"}]
    assert tool_suffix_ids(qwen_tok, msgs) == GRPOTrainer._get_tool_suffix_ids(fake, msgs)


def test_episode_record_views_and_length_errors(qwen_tok):
    task = make_task(5, "c7")
    ep = scripted_episode(qwen_tok, seed=5, episode_id="c7", question=task.question, tools=TOOL_SCHEMAS,
                          steps=failing_steps(qwen_tok, task, n_errors=1, n_turns=2))
    assert ep.full_ids == ep.prompt_ids + ep.completion_ids and len(ep.full_mask) == len(ep.full_ids)
    assert sum(ep.full_mask) == sum(ep.env_mask) > 0
    ep.logprobs.pop()
    with pytest.raises(ValueError) as err:
        ep.check()
    n = len(ep.completion_ids)
    assert f"logprobs has {n - 1} entries but completion_ids has {n}" in str(err.value)


def test_the_sdpo_channel_shows_its_teacher_a_solving_peer_of_the_group(qwen_tok):
    """``[loss] sdpo_peer_demo_reward``: the teacher rows of a failed episode hold the successful calls of another
    episode of its GRPO group (same key), before the error hint; without the setting, the hint only."""
    from composer_diloco.channels.sdpo import SdpoChannel, SdpoSettings

    task = make_task(0, "g1")
    failing = scripted_episode(qwen_tok, seed=0, episode_id="g1", question=task.question, tools=TOOL_SCHEMAS,
                               steps=failing_steps(qwen_tok, task, n_errors=1, n_turns=2))
    solved_steps = [(tool_call_text(qwen_tok, n, a), *execute(task, n, a)) for n, a in
                    (("lookup", {"item": task.x}), ("lookup", {"item": task.y}))]
    solved = scripted_episode(qwen_tok, seed=0, episode_id="g1", question=task.question, tools=TOOL_SCHEMAS,
                              steps=solved_steps, reward=1.0)
    demo = f'A successful attempt called: lookup {{"item": "{task.x}"}}; lookup {{"item": "{task.y}"}}.'
    for setting, expected in ((None, None), (1.0, demo)):
        channel = SdpoChannel(0.2, SiteFinder(qwen_tok), SdpoSettings(alpha_sdpo=0.2, sdpo_peer_demo_reward=setting))
        rows = channel.build(None, [failing, solved], SdpoStats())
        teacher = qwen_tok.decode(rows["sdpo_teacher_ids"][0])
        assert rows["sdpo_teacher_ids"].shape[0] == 1 and "unknown tool" not in teacher.split("<tool_response>")[0]
        assert (demo in teacher) == (expected is not None), teacher
