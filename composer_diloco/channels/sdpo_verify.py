"""Replay-verified SDPO sites: distill only where the hinted teacher is measurably better than the student.

SDPO (Hübotter et al., arXiv 2601.20802) pulls the student towards the same policy with a hint in its context. Its
premise is that the hinted teacher recovers from the error better than the student. On the warm-started embedded
default that premise fails on average (BENCHMARKS.md, section 1c, `bench/channel_diagnosis.py`): replayed in the
env, the teacher's recovery calls are accepted less often than the student's (0.30 against 0.53 at 59 sites) and are
useful as often (0.13 against 0.14); distilling towards a teacher that is not better is noise, and the tiny policy's
format breaks under it.

`verify_sites` checks the premise site by site, with the env as judge: at each site it samples ``samples`` recovery
turns from the student context and as many from the teacher context (one batched generation), scores every sampled
call by replaying the episode to the site and running the call (`composer_diloco.channels.replay.score_candidate`,
the score trace-replay DPO uses: 1 for a call that runs, the env's reward for one that ends the episode, 0 for a tool
error or no parsable call), and keeps the site only when the teacher's mean score is above the student's.

Config: ``[loss] sdpo_verify_samples`` (0 = off: every site is kept, SDPO as published).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from composer_diloco.channels.replay import Candidate, ReplayError, score_candidate
from composer_diloco.channels.sdpo_sites import SdpoSite
from composer_diloco.rollout.chat import ParsedCall, parse_tool_call
from composer_diloco.rollout.episodes import Episode, EnvSession, generate_turns

__all__ = ["site_scores", "verify_sites"]

log = logging.getLogger(__name__)


def site_scores(model: nn.Module, tokenizer: Any, sites: Sequence[tuple[Episode, SdpoSite]], session: EnvSession, *,
                samples: int, max_turn_tokens: int, temperature: float) -> list[tuple[list[float], list[float]]]:
    """Env scores of ``samples`` student and ``samples`` teacher recovery turns sampled at each site.

    Args:
        model: the policy (causal LM); sampling runs on its device, without gradients, from the global RNG.
        tokenizer: its tokenizer (``eos_token_id``, ``pad_token_id``, ``decode``).
        sites: ``(episode, site)`` pairs: the played episode and one of its SDPO sites
            (`composer_diloco.channels.sdpo_sites.SiteFinder.sites_from_episode`).
        session: an env session of the episodes' env, used serially for every replay.
        samples: >= 1 turns sampled per context and site.
        max_turn_tokens: >= 1 new tokens per sampled turn; a turn without EOS by then scores 0.
        temperature: > 0, sampling temperature.
    Returns:
        Per site, ``(student_scores, teacher_scores)``: ``samples`` floats each in [0, 1]
        (`composer_diloco.channels.replay.score_candidate`). A site whose replay diverges from the record
        scores 0 on both sides (logged).
    Raises:
        ValueError: ``samples`` or ``max_turn_tokens`` below 1, or ``temperature`` not > 0.
    """
    if samples < 1 or max_turn_tokens < 1 or not temperature > 0:
        raise ValueError(f"need samples >= 1, max_turn_tokens >= 1, temperature > 0; got {samples}, "
                         f"{max_turn_tokens}, {temperature}")
    if not sites:
        return []
    contexts: list[list[int]] = []
    for _, site in sites:
        student = site.student_ids[:site.student_idx[0]]  # up to and including the recovery turn's header
        teacher = site.teacher_ids[:site.teacher_idx[0]]  # the same, with the hint message before the header
        contexts += [student] * samples + [teacher] * samples
    with torch.no_grad():
        generated, _ = generate_turns(model, tokenizer, contexts, max_turn_tokens, temperature)
    eos = tokenizer.eos_token_id
    out = []
    for k, (episode, site) in enumerate(sites):
        rows = generated[2 * samples * k: 2 * samples * (k + 1)]
        cache: dict[str, float] = {}
        scores: list[float] = []
        try:
            for ids in rows:
                text = tokenizer.decode(ids, skip_special_tokens=False)
                call = parse_tool_call(text) if ids and ids[-1] == eos else ParsedCall(None, None, "truncated")
                if not call.ok:
                    scores.append(0.0)
                    continue
                key = json.dumps([call.name, call.arguments], sort_keys=True)
                if key not in cache:
                    cache[key] = score_candidate(session, episode, site.turn, Candidate("sdpo", text, list(ids), call))
                scores.append(cache[key])
        except ReplayError as exc:
            log.warning("SDPO site not verified: %s", exc)
            scores = [0.0] * (2 * samples)
        out.append((scores[:samples], scores[samples:]))
    return out


def verify_sites(model: nn.Module, tokenizer: Any, sites: Sequence[tuple[Episode, SdpoSite]], session: EnvSession, *,
                 samples: int, max_turn_tokens: int, temperature: float) -> list[bool]:
    """Whether each site's hinted teacher beats its student by env replay: mean teacher score > mean student score
    over `site_scores` (a tie, e.g. both always right or both always wrong, is not verified).

    Args and Raises: as `site_scores`.
    Returns:
        One bool per site, in order.
    """
    scored = site_scores(model, tokenizer, sites, session, samples=samples, max_turn_tokens=max_turn_tokens,
                         temperature=temperature)
    return [sum(teacher) > sum(student) for student, teacher in scored]
