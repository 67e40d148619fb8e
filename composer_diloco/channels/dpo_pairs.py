"""Trace-replay preference pairs for the DPO channel of the inner loss: error sites -> candidates -> env scores -> pairs.

DPO (Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290) trains on pairs ``(x, y_w, y_l)``: a
prompt, a preferred and a dispreferred response. Here a pair lives at one assistant turn of a played episode;
`collect_pairs` runs the four jobs, each in its own module:

1. Pick comparable turns: error sites (`replay.error_sites`), assistant turns whose tool call came back with an
   ``error_kind``.
2. At each site gather candidate actions (`dpo_pairing.Candidate`): the recorded failed call (``"recorded"``),
   samples of the policy on the student context (``"policy"``), samples of the same policy with a hint about the
   error inserted before the turn (``"policy+hint"``, the SDPO teacher context, `composer_diloco.channels.hints`),
   and calls proposed by teachers (`dpo_teachers`; ``"scripted"`` is the env package's scripted solver).
3. Score each candidate by replaying the environment to the site and running it (`replay.score_candidate`): the
   score is the environment's own verdict on that one action, not a judge's opinion.
4. Pair candidates of one turn by score (`dpo_pairing.build_pairs`). The pair's prompt is always the *student*
   context: DPO must teach the policy to take the better action without the hint.

How this differs from the DPO trajectory builder of NVIDIA's NeMo Agent toolkit (``nvidia-nat-nemo-customizer``, the
design reference): there, the candidates of a turn and their scores arrive ready-made in the agent's trace (the
``TTC_END`` events of a test-time-compute step, scored by whatever scorer or judge that step used), and the builder
only groups and pairs them. Here the builder makes the candidates itself, from several sources, and every score is
grounded in the environment: the episode is re-run from its ``(seed, episode_id)`` up to the turn and the candidate's
call is executed. That needs a deterministic environment; a replay that diverges from the recorded trace raises
`ReplayError` (counted, not raised, by `collect_pairs`).

This module also re-exports the public names of the three job modules (``from composer_diloco.channels.dpo_pairs
import build_pairs`` keeps working).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from composer_diloco.channels.dpo_pairing import (
    Candidate,
    PairMode,
    PairStats,
    PreferencePair,
    TurnCandidates,
    build_pairs,
    check_pairing,
)
from composer_diloco.channels.replay import (
    ReplayError, check_assistant_turn, error_sites, recorded_sites, replay_to, score_candidate,
)
from composer_diloco.channels.dpo_teachers import (
    SOURCES,
    TEACHERS,
    ProgressFn,
    TeacherFn,
    ToolCall,
    make_teachers,
    render_tool_call,
    scripted_teacher,
)
from composer_diloco.channels.hints import DEFAULT_HINTS, HintRegistry
from composer_diloco.rollout.chat import ParsedCall, parse_tool_call
from composer_diloco.rollout.episode_tokens import TurnSpan, generation_prompt_ids, header_start, message_ids, turn_spans
from composer_diloco.rollout.episodes import Episode, EnvSession, generate_turns

__all__ = [
    "TEACHERS",
    "Candidate",
    "PairMode",
    "PairStats",
    "PreferencePair",
    "ReplayError",
    "TeacherFn",
    "ToolCall",
    "TurnCandidates",
    "build_pairs",
    "collect_pairs",
    "error_sites",
    "make_teachers",
    "render_tool_call",
    "replay_to",
    "score_candidate",
    "scripted_teacher",
    "site_contexts",
]

log = logging.getLogger(__name__)

_TRUNCATED = "truncated: no end-of-turn token within max_turn_tokens"


def site_contexts(episode: Episode, turn: int, tokenizer: Any, hint: str | None) -> tuple[list[int], list[int] | None]:
    """The student and teacher contexts of assistant turn ``turn``.

    Returns:
        ``(student, teacher)``. ``student`` ``(P,)``: ``prompt_ids + completion_ids`` up to the turn's first
        generated token, i.e. up to and including its assistant header (what the policy saw when it generated the
        turn). ``teacher`` ``(P + H,)``: the student context with ``message_ids(tokenizer, hint)`` (the template's
        rendering of a user message holding the hint, H tokens) inserted right before that header; None when
        ``hint`` is None.

    Raises:
        ValueError: if ``turn`` is not an assistant turn, the episode's token runs do not match its turns, or the
            assistant header is not found before the turn (`composer_diloco.rollout.episode_tokens`).
    """
    check_assistant_turn(episode, turn)
    for span in turn_spans(episode, tokenizer.eos_token_id):
        if span.turn == turn:
            return _contexts(episode, span, tokenizer, hint)
    raise ValueError(f"episode {episode.episode_id}: assistant turn {turn} has no tokens")


def _contexts(episode: Episode, span: TurnSpan, tokenizer: Any, hint: str | None) -> tuple[list[int], list[int] | None]:
    """`site_contexts` for a known span (no pass over the episode's tokens)."""
    ids = episode.prompt_ids + episode.completion_ids
    student = ids[: span.start]
    if hint is None:
        return student, None
    h = header_start(episode, span, generation_prompt_ids(tokenizer))
    return student, ids[:h] + message_ids(tokenizer, hint) + ids[h: span.start]


@dataclass
class _Site:
    """One error site on its way to a `TurnCandidates`: its contexts and the candidates gathered so far."""

    episode: Episode
    turn: int
    student: list[int]
    teacher: list[int] | None
    candidates: list[Candidate] = field(default_factory=list)


def _call_key(call: ParsedCall) -> str:
    return json.dumps([call.name, call.arguments], sort_keys=True)


def collect_pairs(
    model: nn.Module,
    tokenizer: Any,
    episodes: Sequence[Episode],
    session: EnvSession,
    *,
    hints: HintRegistry | None = DEFAULT_HINTS,
    teachers: Mapping[str, TeacherFn] | None = None,
    mode: PairMode = "best_vs_worst",
    min_score_diff: float = 0.5,
    max_pairs_per_turn: int = 2,
    max_sites: int = 4,
    max_turn_tokens: int = 40,
    temperature: float = 1.0,
    samples_per_source: int = 1,
    seed: int | None = None,
    progress: ProgressFn | None = None,
) -> tuple[list[PreferencePair], PairStats]:
    """Trace-replay DPO pairs for a batch of played episodes: error sites -> candidates -> env scores -> pairs.

    For each error site (`error_sites`, in episode order, at most ``max_sites``), the candidates are, in this order
    (which decides which of two identical candidates is kept): the recorded failed turn (``"recorded"``, score 0.0
    by definition of a site), ``samples_per_source`` policy samples on the student context (``"policy"``) and on the
    hinted teacher context (``"policy+hint"``; none when ``hints`` has no hint for the error, counted in
    ``no_hint``), then one candidate per teacher that has a proposal (rendered with `render_tool_call`). All samples
    of the batch come from one batched generation. Each distinct call is scored once per site with
    `score_candidate`; a site whose replay fails is dropped and counted in ``replay_errors``. Pairs come from
    `build_pairs`, with the student context as prompt.

    Args:
        model: the policy (causal LM); sampling runs on its device, without gradients.
        tokenizer: its tokenizer (the one the episodes were played with).
        episodes: played episodes (`composer_diloco.rollout.play.play_episodes`).
        session: an environment session of the episodes' environment, used serially for every replay.
        hints: hint registry for the ``"policy+hint"`` source; None turns that source off.
        teachers: ``{name: TeacherFn}`` (`make_teachers`), in the order their candidates are added; None = none.
        mode, min_score_diff, max_pairs_per_turn: see `build_pairs`.
        max_sites: >= 1, the most error sites examined in this call.
        max_turn_tokens: >= 1, new tokens per sampled turn; a sample without EOS by then scores 0.0.
        temperature: > 0, sampling temperature.
        samples_per_source: >= 0 samples per sampled source and site (0: no sampling).
        seed: if set, sampling runs under ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` (reproducible,
            and the global RNG is left alone); None samples from the global RNG.
        progress: if set, ``(episode, turn) -> calls that make progress there`` (`dpo_teachers.script_progress`): a
            call the env accepts but that is not one of them scores 0.0, like an error, so it is never chosen over
            the failed call (None from the function, or no function: every accepted call scores as
            `score_candidate` says). On the warm-started embedded default 22 % of the chosen calls of the plain
            score are such off-script calls, e.g. an arithmetic call on made-up numbers (BENCHMARKS.md, 1c).

    Returns:
        ``(pairs, stats)``; ``stats.sites == (sites given to build_pairs) + stats.replay_errors``.

    Raises:
        ValueError: a teacher named like a built-in source, a bad argument (see above and `build_pairs`), or an
            episode whose tokens do not match its turns. Errors of the session itself (e.g. a lost server) propagate.
    """
    teachers = dict(teachers or {})
    clash = [t for t in teachers if t in SOURCES]
    if clash:
        raise ValueError(f"teacher name(s) {clash} clash with the built-in sources {list(SOURCES)}")
    if max_sites < 1 or max_turn_tokens < 1 or samples_per_source < 0 or not temperature > 0.0:
        raise ValueError(
            f"need max_sites >= 1, max_turn_tokens >= 1, samples_per_source >= 0, temperature > 0; got {max_sites}, "
            f"{max_turn_tokens}, {samples_per_source}, {temperature}"
        )
    check_pairing(mode, min_score_diff, max_pairs_per_turn)
    extra = PairStats()
    sites = _find_sites(episodes, tokenizer, hints, max_sites, extra)                          # 1. sites
    _sample_candidates(model, tokenizer, sites, samples_per_source, max_turn_tokens, temperature, seed)  # 2. samples
    _teacher_candidates(tokenizer, sites, teachers)                                            # 3. teachers
    groups = _score_sites(session, sites, extra, progress)                                     # 4. env scores
    pairs, stats = build_pairs(groups, mode=mode, min_score_diff=min_score_diff,               # 5. pairs
                               max_pairs_per_turn=max_pairs_per_turn)
    stats = stats + extra
    log.debug("DPO pairs: %s", stats.as_dict())
    return pairs, stats


def _find_sites(episodes: Sequence[Episode], tokenizer: Any, hints: HintRegistry | None, max_sites: int,
                extra: PairStats) -> list[_Site]:
    """Step 1: the error sites (at most ``max_sites``) with their student/teacher contexts; the recorded turn is each
    site's first candidate. Counts ``sites_over_cap`` and ``no_hint`` into ``extra``."""
    found, over_cap = recorded_sites(episodes, tokenizer.eos_token_id, max_sites)
    extra.sites_over_cap += over_cap
    sites: list[_Site] = []
    for found_site in found:
        ep, turn, span = found_site.episode, found_site.turn, found_site.span
        reply = ep.turns[turn + 1]
        hint = hints.hint(reply.error_kind, reply.error_meta) if hints is not None else None
        if hints is not None and hint is None:
            extra.no_hint += 1
        student, teacher = _contexts(ep, span, tokenizer, hint)
        text = ep.turns[turn].content
        site = _Site(ep, turn, student, teacher)
        site.candidates.append(Candidate("recorded", text, found_site.recorded, parse_tool_call(text)))
        sites.append(site)
    return sites


def _sample_candidates(model: nn.Module, tokenizer: Any, sites: list[_Site], samples_per_source: int,
                       max_turn_tokens: int, temperature: float, seed: int | None) -> None:
    """Step 2: one batched generation for every sampled candidate of the batch (``"policy"``, ``"policy+hint"``),
    appended to each site's candidates in request order."""
    requests: list[tuple[_Site, str, list[int]]] = []
    for site in sites:
        for _ in range(samples_per_source):
            requests.append((site, "policy", site.student))
        if site.teacher is not None:
            for _ in range(samples_per_source):
                requests.append((site, "policy+hint", site.teacher))
    if not requests:
        return
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=rng_devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        generated, _ = generate_turns(model, tokenizer, [ctx for _, _, ctx in requests], max_turn_tokens, temperature)
    for (site, source, _), new_ids in zip(requests, generated):
        text = tokenizer.decode(new_ids, skip_special_tokens=False)
        ended = bool(new_ids) and new_ids[-1] == eos
        call = parse_tool_call(text) if ended else ParsedCall(None, None, _TRUNCATED)
        site.candidates.append(Candidate(source, text, list(new_ids), call))


def _teacher_candidates(tokenizer: Any, sites: list[_Site], teachers: Mapping[str, TeacherFn]) -> None:
    """Step 3: each teacher's proposal at each site, rendered as an assistant turn (`render_tool_call`)."""
    for site in sites:
        for name, teacher in teachers.items():
            proposal = teacher(site.episode, site.turn)
            if proposal is None:
                continue
            text, ids = render_tool_call(tokenizer, *proposal)
            site.candidates.append(Candidate(name, text, ids, parse_tool_call(text)))


def _score_sites(session: EnvSession, sites: list[_Site], extra: PairStats,
                 progress: ProgressFn | None = None) -> list[TurnCandidates]:
    """Step 4: the environment's score of every candidate, one replay per distinct call and site (0.0 without a
    replay for an accepted-looking call that ``progress`` rules out). A site whose replay diverges is dropped, logged
    and counted (``replay_errors`` and ``sites`` of ``extra``)."""
    groups: list[TurnCandidates] = []
    for site in sites:
        recorded = site.candidates[0].call
        cache: dict[str, float] = {_call_key(recorded): 0.0} if recorded.ok else {}
        useful = progress(site.episode, site.turn) if progress is not None else None
        if useful is not None:
            cache.update({_call_key(c.call): 0.0 for c in site.candidates
                          if c.call.ok and (c.call.name, c.call.arguments) not in useful})
        try:
            scores = []
            for cand in site.candidates:
                if not cand.call.ok:
                    scores.append(0.0)
                    continue
                key = _call_key(cand.call)
                if key not in cache:
                    cache[key] = score_candidate(session, site.episode, site.turn, cand)
                scores.append(cache[key])
        except ReplayError as exc:
            log.warning("dropping DPO site: %s", exc)
            extra.replay_errors += 1
            extra.sites += 1
            continue
        groups.append(TurnCandidates(site.episode.episode_id, site.turn, site.student, site.candidates, scores))
    return groups
