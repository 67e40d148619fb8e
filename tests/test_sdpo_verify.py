"""Replay-verified SDPO sites (`composer_diloco.channels.sdpo_verify`, ``[loss] sdpo_verify_samples``): the scores are
the env's verdict on the sampled recovery calls, and a site whose hinted teacher does not beat the student is
dropped and counted. Real warm-started policy, real tool_env environment in this process, real tensors."""

from __future__ import annotations

import pytest
import torch
from conftest import SMOKE
from episode_support import scripted_episode, tool_call_text
from pydantic import ValidationError

from composer_diloco.channels.sdpo import SdpoChannel, SdpoSettings
from composer_diloco.channels.hints import DEFAULT_HINTS
from composer_diloco.channels.sdpo_verify import site_scores, verify_sites
from composer_diloco.config import LossConfig, RunConfig, load_config
from composer_diloco.channels.sdpo_sites import SdpoStats, SiteFinder
from composer_diloco.policy import load_policy
from composer_diloco.rollout.chat import parse_tool_call
from composer_diloco.rollout.env_package import load_env_package
from envs.tool_env.tasks import ITEM_VOCAB, TOOL_SCHEMAS, execute, make_task

SEED, EPISODE = 0, "verify-1"
NEAR_GREEDY = 1e-4  # sampling at this temperature picks the argmax token (the logits' gaps are >> 1e-4 here)


@pytest.fixture(scope="module")
def policy(warm_cache):
    cfg = load_config(SMOKE)
    model, tok = load_policy(None, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps)
    return model.eval(), tok


@pytest.fixture(scope="module")
def session():
    s = load_env_package("envs.tool_env.server").local_session(max_tool_calls=8)
    yield s
    s.close()


def _episode(tok):
    """Lookup of an item outside the catalogue (an execution_error), then the right lookup: one SDPO site."""
    task = make_task(SEED, EPISODE)
    outside = next(item for item in ITEM_VOCAB if item not in task.catalogue)
    calls = [("lookup", {"item": outside}), ("lookup", {"item": task.x})]
    steps = []
    for name, args in calls:
        content, kind, meta = execute(task, name, args)
        steps.append((tool_call_text(tok, name, args), content, kind, meta))
    ep = scripted_episode(tok, seed=SEED, episode_id=EPISODE, question=task.question, tools=TOOL_SCHEMAS, steps=steps)
    for (name, args), k in zip(calls, (1, 3)):  # the assistant turns' calls, as play_episodes records them
        ep.turns[k].tool_call = {"name": name, "arguments": args}
    return ep, task


def _sites(tok, ep):
    stats = SdpoStats()
    sites = SiteFinder(tok, hints=DEFAULT_HINTS).sites_from_episode(ep, stats)
    assert stats.sdpo_sites == len(sites) == 1
    return [(ep, site) for site in sites]


@pytest.mark.timeout(120)
def test_site_scores_are_the_envs_verdict_on_the_sampled_calls(policy, session):
    """Near-greedy, every sample of a context is the greedy turn; its score is what tool_env's own `execute` says of
    the parsed call (1.0 for a call that runs, 0.0 for an error or no call)."""
    model, tok = policy
    ep, task = _episode(tok)
    sites = _sites(tok, ep)
    torch.manual_seed(0)
    [(student, teacher)] = site_scores(model, tok, sites, session, samples=3, max_turn_tokens=40,
                                       temperature=NEAR_GREEDY)
    site = sites[0][1]
    for scores, ids, idx in ((student, site.student_ids, site.student_idx), (teacher, site.teacher_ids,
                                                                                 site.teacher_idx)):
        context = torch.tensor([ids[:idx[0]]])
        out = model.generate(input_ids=context, attention_mask=torch.ones_like(context), do_sample=False,
                             max_new_tokens=40, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        new = out[0, context.shape[1]:].tolist()
        call = parse_tool_call(tok.decode(new, skip_special_tokens=False)) if new[-1] == tok.eos_token_id else None
        expected = 0.0 if call is None or not call.ok else float(execute(task, call.name, call.arguments)[1] is None)
        assert scores == [expected] * 3


@pytest.mark.timeout(120)
def test_a_site_whose_teacher_is_no_better_is_dropped_and_counted(policy, session):
    """`SdpoChannel.build` keeps a site iff `verify_sites` (same RNG) says the teacher beats the student; a dropped
    site moves from ``sdpo_sites`` to ``sdpo_skipped_unverified``. Without verification the site is always kept."""
    model, tok = policy
    ep, _ = _episode(tok)
    torch.manual_seed(1)
    [(student, teacher)] = site_scores(model, tok, _sites(tok, ep), session, samples=4, max_turn_tokens=40,
                                       temperature=1.0)
    torch.manual_seed(1)
    assert verify_sites(model, tok, _sites(tok, ep), session, samples=4, max_turn_tokens=40,
                        temperature=1.0) == [sum(teacher) > sum(student)]

    for k in (0, 4):
        config = RunConfig.model_validate({"loss": {"sdpo_verify_samples": k}})
        channel = SdpoChannel(0.2, SiteFinder(tok, hints=DEFAULT_HINTS), SdpoSettings.of(config.loss), session=session,
                              config=config)
        stats = SdpoStats()
        torch.manual_seed(1)
        rows = channel.build(model, [ep], stats)
        kept = k == 0 or sum(teacher) > sum(student)
        assert (rows is not None) == kept
        assert (stats.sdpo_sites, stats.sdpo_skipped_unverified) == ((1, 0) if kept else (0, 1))


def test_config_and_channel_refuse_bad_verification_settings(policy):
    with pytest.raises(ValidationError, match="sdpo_verify_samples"):
        LossConfig(sdpo_verify_samples=-1)
    with pytest.raises(ValidationError, match="sdpo_verify_samples"):
        LossConfig(sdpo_verify_samples=65)
    _, tok = policy
    with pytest.raises(ValueError, match="needs an env session"):
        SdpoChannel(0.2, SiteFinder(tok), SdpoSettings(sdpo_verify_samples=2))
    with pytest.raises(ValueError, match="samples >= 1"):
        site_scores(None, tok, [], None, samples=0, max_turn_tokens=40, temperature=1.0)
