"""Trace-replay preference pairs for the DPO channel of the inner loss.

DPO (Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290) trains on pairs ``(x, y_w, y_l)``: a
prompt, a preferred and a dispreferred response. Here a pair lives at one assistant turn of a played episode:

1. Pick comparable turns: error sites first (`error_sites`), i.e. assistant turns whose tool call came back with an
   ``error_kind``.
2. At each site gather candidate actions (`Candidate`): the recorded failed call itself (``"recorded"``), samples of
   the policy on the student context (``"policy"``), samples of the same policy with a hint about the error inserted
   before the turn (``"policy+hint"``, the SDPO teacher context, see `composer_diloco.channels.sdpo_hints`), and calls proposed by
   named teachers (`TEACHERS`; ``"scripted"`` is the scripted solver of the env the episode was played on).
3. Score each candidate by replaying the environment to the site and running it (`replay_to`, `score_candidate`):
   the score is the environment's own verdict on that one action, not a judge's opinion.
4. Pair candidates of one turn by score (`build_pairs`). The pair's prompt is always the *student* context: DPO must
   teach the policy to take the better action without the hint.

How this differs from the DPO trajectory builder of NVIDIA's NeMo Agent toolkit (``nvidia-nat-nemo-customizer``, the
design reference): there, the candidates of a turn and their scores arrive ready-made in the agent's trace (the
``TTC_END`` events of a test-time-compute step, scored by whatever scorer or judge that step used), and the builder
only groups and pairs them, so a pair encodes how much the scorers disagreed about two responses. Here the builder
makes the candidates itself, from several sources (the recorded action, the policy with and without the hint,
scripted teachers), and every score is grounded in the environment: the episode is re-run from its ``(seed,
episode_id)`` up to the turn and the candidate's call is executed. That needs a deterministic environment; a replay
that diverges from the recorded trace raises `ReplayError` (counted, not raised, by `collect_pairs`). The pairing
rules (exhaustive vs best-vs-worst, a minimum score difference, a cap per turn, skip counters) follow the
reference's, as a pure function; unlike it, identical responses are never paired and ties never form a pair.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch
from torch import nn

from composer_diloco.rollout.chat import ParsedCall, parse_tool_call
from composer_diloco.rollout.episode_tokens import TurnSpan, generation_prompt_ids, header_start, message_ids, turn_spans
from composer_diloco.channels.sdpo_hints import DEFAULT_HINTS, HintRegistry
from composer_diloco.rollout.episodes import Episode, EnvSession, _generate
from envs.coding_env import demos as _coding_demos
from envs.tool_env import demos as _tool_demos

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
    "render_tool_call",
    "replay_to",
    "score_candidate",
    "scripted_teacher",
    "site_contexts",
]

log = logging.getLogger(__name__)

PairMode = Literal["exhaustive", "best_vs_worst"]
ToolCall = tuple[str, dict[str, Any]]
"""One tool call: ``(tool name, arguments)``."""

TeacherFn = Callable[[Episode, int], ToolCall | None]
"""A teacher: ``(episode, turn) -> (tool, arguments)`` it would call at assistant turn ``turn`` (an index into
``episode.turns``), or None when it has no proposal there. It may read only the turns before ``turn``."""

_TRUNCATED = "truncated: no end-of-turn token within max_turn_tokens"
_SOURCES = ("recorded", "policy", "policy+hint")


class ReplayError(RuntimeError):
    """Replaying an episode in its environment did not reproduce the recorded trace (or could not be done)."""


# --------------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Candidate:
    """One candidate action at an assistant turn.

    Attributes:
        source: where it came from: ``"recorded"``, ``"policy"``, ``"policy+hint"``, or a teacher's name.
        text: the assistant turn's text as the policy would decode it (special tokens kept, so it ends with the EOS
            token's text when the turn ended).
        token_ids: ``(T,)`` the turn's token ids after the assistant header, EOS included when present: the response
            DPO scores.
        call: the tool call parsed from ``text``. A sampled turn that hit ``max_turn_tokens`` without EOS gets
            ``error="truncated: ..."`` even when its text parses, as the rollout never runs such a call.
    """

    source: str
    text: str
    token_ids: list[int]
    call: ParsedCall


@dataclass
class TurnCandidates:
    """The scored candidates of one turn: the input of `build_pairs`.

    Attributes:
        episode_id: the episode the turn belongs to.
        turn: index of the assistant turn in ``episode.turns``.
        prompt_ids: ``(P,)`` the student context: the episode's token ids up to and including this turn's assistant
            header.
        candidates: the candidate actions, in priority order (a later duplicate of an earlier one is dropped).
        scores: one score per candidate (see `score_candidate`; any floats work, higher is better).

    Raises:
        ValueError: on construction, if ``scores`` and ``candidates`` differ in length.
    """

    episode_id: str
    turn: int
    prompt_ids: list[int]
    candidates: list[Candidate]
    scores: list[float]

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.candidates):
            raise ValueError(
                f"episode {self.episode_id} turn {self.turn}: {len(self.candidates)} candidates but "
                f"{len(self.scores)} scores"
            )


@dataclass(frozen=True)
class PreferencePair:
    """One DPO pair ``(x, y_w, y_l)`` (arXiv 2305.18290) at one assistant turn.

    Attributes:
        episode_id, turn: where it comes from (``turn`` indexes ``episode.turns``).
        prompt_ids: ``(P,)`` x: the student context (never the hinted teacher context).
        chosen_ids: ``(Tw,)`` y_w: the better candidate's turn tokens, EOS included when it ended.
        rejected_ids: ``(Tl,)`` y_l: the worse candidate's.
        chosen_score, rejected_score: their scores, ``chosen_score > rejected_score``.
        chosen_source, rejected_source: their `Candidate.source`.
    """

    episode_id: str
    turn: int
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    chosen_score: float
    rejected_score: float
    chosen_source: str
    rejected_source: str

    @property
    def score_diff(self) -> float:
        """``chosen_score - rejected_score`` (> 0)."""
        return self.chosen_score - self.rejected_score


@dataclass
class PairStats:
    """What pair building saw and dropped; all counts. Add two with ``+``.

    Attributes:
        sites: turns examined (with `collect_pairs`: error sites within ``max_sites``, replay failures included).
        candidates: candidates of the turns that were scored (duplicates included).
        pairs: pairs produced.
        skipped_single_candidate: turns with fewer than two distinct candidates.
        skipped_no_score_diff: ``"exhaustive"``: candidate pairs whose score difference is not > 0 and
            >= ``min_score_diff``; ``"best_vs_worst"``: turns whose best and worst are that close.
        skipped_duplicate: candidates dropped because an earlier candidate of their turn has the same token ids.
        capped: pairs dropped by ``max_pairs_per_turn``.
        replay_errors: sites dropped because the environment did not reproduce the trace (`ReplayError`).
        no_hint: sites where the hint registry had no hint, so no ``"policy+hint"`` candidate was sampled.
        sites_over_cap: error sites left out because ``max_sites`` was reached.

    In ``"exhaustive"`` mode, over the turns with >= 2 distinct candidates, ``sum(n * (n - 1) / 2) == pairs +
    skipped_no_score_diff + capped`` (n: distinct candidates of a turn).
    """

    sites: int = 0
    candidates: int = 0
    pairs: int = 0
    skipped_single_candidate: int = 0
    skipped_no_score_diff: int = 0
    skipped_duplicate: int = 0
    capped: int = 0
    replay_errors: int = 0
    no_hint: int = 0
    sites_over_cap: int = 0

    def __add__(self, other: PairStats) -> PairStats:
        if not isinstance(other, PairStats):
            return NotImplemented
        return PairStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        """The counts by name (for logging and metrics)."""
        return asdict(self)


# ------------------------------------------------------------------------------------------------- sites, replay


def error_sites(episode: Episode) -> list[int]:
    """Indices into ``episode.turns`` of the assistant turns whose tool call came back with an ``error_kind``.

    An assistant turn counts when the turn right after it is a tool turn with ``error_kind is not None``. In order.
    """
    turns = episode.turns
    return [
        k for k in range(len(turns) - 1)
        if turns[k].role == "assistant" and turns[k + 1].role == "tool" and turns[k + 1].error_kind is not None
    ]


def _check_assistant_turn(episode: Episode, turn: int) -> None:
    """Raise ValueError unless ``turn`` indexes an assistant turn of ``episode``."""
    if not 0 <= turn < len(episode.turns) or episode.turns[turn].role != "assistant":
        role = episode.turns[turn].role if 0 <= turn < len(episode.turns) else "out of range"
        raise ValueError(f"episode {episode.episode_id}: turn {turn} is not an assistant turn ({role})")


def replay_to(session: EnvSession, episode: Episode, turn: int) -> None:
    """Reset ``session`` to the episode and re-run every tool call made before assistant turn ``turn``.

    ``session.reset(episode.seed, episode.episode_id)``, then, in order, ``session.call`` of each earlier assistant
    turn that has a recorded tool reply, checking the reply against the record. Afterwards the session stands where
    the episode stood right before ``turn``: the next ``session.call`` is that turn's action.

    Args:
        session: an environment session (one episode at a time; its previous episode is abandoned). Its call budget
            must be at least the episode's.
        episode: a played episode; its environment must be deterministic in ``(seed, episode_id)`` and the calls.
        turn: index of an assistant turn in ``episode.turns``.

    Raises:
        ValueError: if ``turn`` is not an assistant turn.
        ReplayError: naming the episode, the site and the replayed turn, if the reset question, a reply's content or
            error kind differs from the record, or the environment ends the episode before ``turn``. Errors of the
            session itself (e.g. `composer_diloco.rollout.env_process.EnvServerError`) propagate unchanged.
    """
    _check_assistant_turn(episode, turn)
    where = f"replay of episode {episode.episode_id} (seed {episode.seed}) to turn {turn}"
    question, _ = session.reset(episode.seed, episode.episode_id)
    turns = episode.turns
    if turns and turns[0].role == "user" and question != turns[0].content:
        raise ReplayError(f"{where}: reset gave question {question!r}, recorded {turns[0].content!r}")
    for k in range(turn):
        call = turns[k].tool_call
        if turns[k].role != "assistant" or call is None:
            continue
        reply = turns[k + 1] if k + 1 < len(turns) and turns[k + 1].role == "tool" else None
        if reply is None:
            raise ReplayError(f"{where}: assistant turn {k} has a tool call but no recorded tool reply")
        content, kind, _meta, _reward, done = session.call(call["name"], call["arguments"])
        if content != reply.content or kind != reply.error_kind:
            raise ReplayError(
                f"{where}: turn {k} call {call['name']}({json.dumps(call['arguments'])}) gave "
                f"({content!r}, {kind!r}), recorded ({reply.content!r}, {reply.error_kind!r}); "
                "the environment is not deterministic, or the session is not the episode's environment"
            )
        if done:
            raise ReplayError(f"{where}: the environment ended the episode at turn {k}, before turn {turn}")


def score_candidate(session: EnvSession, episode: Episode, turn: int, candidate: Candidate) -> float:
    """The environment's verdict on one candidate action at assistant turn ``turn``, in [0, 1].

    Replays the episode to the turn (`replay_to`) and runs the candidate's call:

    - 0.0 if the candidate has no valid call (no tool call, malformed, or truncated: nothing is sent to the env);
    - 0.0 if the call comes back with an ``error_kind``;
    - the environment's reward if the call ends the episode (``envs.tool_env``: ``submit`` gives 1.0 for the
      correct answer, 0.0 otherwise; a call that spends the last of the call budget gives 0.0);
    - 1.0 otherwise (the call succeeded and the episode goes on).

    So a score says whether this one action was accepted, not whether it was the most useful one: a successful
    lookup of an item the question does not ask about also scores 1.0.

    Raises:
        ValueError: if ``turn`` is not an assistant turn.
        ReplayError: if the replay diverges from the record (see `replay_to`).
    """
    _check_assistant_turn(episode, turn)
    if not candidate.call.ok:
        return 0.0
    replay_to(session, episode, turn)
    _content, kind, _meta, reward, done = session.call(candidate.call.name, candidate.call.arguments)
    if kind is not None:
        return 0.0
    return float(reward) if done else 1.0


# ------------------------------------------------------------------------------------------------------ contexts


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
    _check_assistant_turn(episode, turn)
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


# ------------------------------------------------------------------------------------------------------ teachers


def render_tool_call(tokenizer: Any, name: str, arguments: Mapping[str, Any]) -> tuple[str, list[int]]:
    """One tool call as a generated assistant turn: the text the chat template renders for it, and its token ids.

    The text is what follows the assistant header when the template renders an assistant message with this
    ``tool_calls`` entry (Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``) plus the EOS
    token's text; the ids are that text's tokens (without EOS) followed by ``tokenizer.eos_token_id``. This is the
    format `composer_diloco.policy.tokenize_episode` trains the warm start on.

    Raises:
        ValueError: if the template's rendering of the conversation does not extend its generation prompt, or has
            no EOS token after the call.
    """
    first = [{"role": "user", "content": "x"}]
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": dict(arguments)}}]}
    # A tool reply after the call keeps Qwen3's template from adding an empty <think> block to a last message.
    prefix = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(first + [assistant, {"role": "tool", "content": "y"}], tokenize=False)
    eos = tokenizer.eos_token
    if not full.startswith(prefix) or eos not in full[len(prefix):]:
        raise ValueError("chat template: an assistant tool call does not render as generation prompt + call + EOS")
    body = full[len(prefix): full.index(eos, len(prefix))]
    ids = tokenizer(body, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return body + eos, ids


_SCRIPTS: tuple[Callable[[int, str, str], list[ToolCall] | None], ...] = (_tool_demos.script, _coding_demos.script)
"""The envs' scripted solvers, ``(seed, episode_id, question) -> calls or None`` (``envs/<env>/demos.py``)."""


def scripted_teacher(episode: Episode, turn: int) -> ToolCall | None:
    """The scripted solver's next correct call at assistant turn ``turn``, for an episode of tool_env or the coding env.

    The script is the env's ``demos.script(seed, episode_id, question)``: for tool_env lookup x, lookup y, the
    operation, submit; for the coding env read ``solution.py``, write the reference solution, run the tests, submit.
    The proposal is the first script call not yet made successfully before ``turn`` (matching name and arguments);
    for an episode that follows the script that is ``script[k]``, k the number of successful calls so far, and a
    successful off-script call (a lookup of another item, a write of wrong code) does not make it skip a step.

    Returns None for an episode of neither env (no script reproduces its question) or when every script call has
    been made.
    """
    if not episode.turns:
        return None
    question = episode.turns[0].content
    remaining = next((calls for calls in (f(episode.seed, episode.episode_id, question) for f in _SCRIPTS)
                      if calls is not None), None)
    if remaining is None:
        return None
    remaining = list(remaining)
    for k in range(min(turn, len(episode.turns) - 1)):
        t, reply = episode.turns[k], episode.turns[k + 1]
        if t.role == "assistant" and t.tool_call is not None and reply.role == "tool" and reply.error_kind is None:
            made = (t.tool_call["name"], t.tool_call["arguments"])
            if made in remaining:
                remaining.remove(made)
    return remaining[0] if remaining else None


TEACHERS: dict[str, TeacherFn] = {"scripted": scripted_teacher}
"""Teacher registry for ``collect_pairs(teachers=[...])``: name -> `TeacherFn`. Add entries to extend it; a name must
not be one of the built-in sources ("recorded", "policy", "policy+hint")."""


# ------------------------------------------------------------------------------------------------------- pairing


def _check_pairing(mode: str, min_score_diff: float, max_pairs_per_turn: int) -> None:
    """Raise ValueError naming the first bad pairing argument."""
    if mode not in ("exhaustive", "best_vs_worst"):
        raise ValueError(f"mode must be 'exhaustive' or 'best_vs_worst', got {mode!r}")
    if not min_score_diff >= 0.0:
        raise ValueError(f"min_score_diff must be >= 0, got {min_score_diff}")
    if max_pairs_per_turn < 1:
        raise ValueError(f"max_pairs_per_turn must be >= 1, got {max_pairs_per_turn}")


def build_pairs(
    groups: Sequence[TurnCandidates],
    *,
    mode: PairMode = "best_vs_worst",
    min_score_diff: float = 0.5,
    max_pairs_per_turn: int = 2,
) -> tuple[list[PreferencePair], PairStats]:
    """DPO pairs within each turn's scored candidates (pure: no model, no environment).

    Per turn: candidates whose token ids equal an earlier candidate's are dropped (``skipped_duplicate``); a turn left
    with fewer than two is skipped (``skipped_single_candidate``). A pair needs a score difference that is > 0 and
    >= ``min_score_diff``; the higher-scored candidate is chosen.

    - ``"exhaustive"``: every such pair, sorted by score difference (largest first; ties keep candidate order), then
      cut to ``max_pairs_per_turn`` (the rest counted in ``capped``).
    - ``"best_vs_worst"``: one pair, the first best-scored candidate against the first worst-scored one.

    Args:
        groups: scored candidates, one entry per turn.
        mode: ``"exhaustive"`` or ``"best_vs_worst"``.
        min_score_diff: >= 0, the smallest score difference that makes a pair.
        max_pairs_per_turn: >= 1, the most pairs one turn may give.

    Returns:
        ``(pairs, stats)``: pairs turn by turn, in the order of ``groups``; ``stats`` fills ``sites``,
        ``candidates``, ``pairs`` and the ``skipped_*`` / ``capped`` counts.

    Raises:
        ValueError: on an unknown ``mode``, ``min_score_diff < 0`` or ``max_pairs_per_turn < 1``.
    """
    _check_pairing(mode, min_score_diff, max_pairs_per_turn)
    stats = PairStats(sites=len(groups))
    pairs: list[PreferencePair] = []

    def enough(diff: float) -> bool:
        return diff > 0.0 and diff >= min_score_diff

    for group in groups:
        stats.candidates += len(group.candidates)
        seen: set[tuple[int, ...]] = set()
        distinct: list[tuple[Candidate, float]] = []
        for cand, score in zip(group.candidates, group.scores):
            key = tuple(cand.token_ids)
            if key in seen:
                stats.skipped_duplicate += 1
                continue
            seen.add(key)
            distinct.append((cand, float(score)))
        if len(distinct) < 2:
            stats.skipped_single_candidate += 1
            continue

        def pair(chosen: tuple[Candidate, float], rejected: tuple[Candidate, float]) -> PreferencePair:
            return PreferencePair(
                group.episode_id, group.turn, list(group.prompt_ids), list(chosen[0].token_ids),
                list(rejected[0].token_ids), chosen[1], rejected[1], chosen[0].source, rejected[0].source,
            )

        if mode == "best_vs_worst":
            best = max(distinct, key=lambda cs: cs[1])
            worst = min(distinct, key=lambda cs: cs[1])
            if enough(best[1] - worst[1]):
                pairs.append(pair(best, worst))
            else:
                stats.skipped_no_score_diff += 1
            continue

        ranked = sorted(distinct, key=lambda cs: -cs[1])  # stable: ties keep candidate order
        turn_pairs = []
        for i, hi in enumerate(ranked):
            for lo in ranked[i + 1:]:
                if enough(hi[1] - lo[1]):
                    turn_pairs.append(pair(hi, lo))
                else:
                    stats.skipped_no_score_diff += 1
        turn_pairs.sort(key=lambda p: -p.score_diff)
        stats.capped += max(0, len(turn_pairs) - max_pairs_per_turn)
        pairs.extend(turn_pairs[:max_pairs_per_turn])
    stats.pairs = len(pairs)
    return pairs, stats


# ------------------------------------------------------------------------------------------------------ pipeline


@dataclass
class _Site:
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
    teachers: Sequence[str] = ("scripted",),
    mode: PairMode = "best_vs_worst",
    min_score_diff: float = 0.5,
    max_pairs_per_turn: int = 2,
    max_sites: int = 4,
    max_turn_tokens: int = 40,
    temperature: float = 1.0,
    samples_per_source: int = 1,
    seed: int | None = None,
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
        episodes: played episodes (`composer_diloco.rollout.episodes.play_episodes`).
        session: an environment session of the episodes' environment, used serially for every replay.
        hints: hint registry for the ``"policy+hint"`` source; None turns that source off.
        teachers: names in `TEACHERS`.
        mode, min_score_diff, max_pairs_per_turn: see `build_pairs`.
        max_sites: >= 1, the most error sites examined in this call.
        max_turn_tokens: >= 1, new tokens per sampled turn; a sample without EOS by then scores 0.0.
        temperature: > 0, sampling temperature.
        samples_per_source: >= 0 samples per sampled source and site (0: no sampling).
        seed: if set, sampling runs under ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` (reproducible,
            and the global RNG is left alone); None samples from the global RNG.

    Returns:
        ``(pairs, stats)``; ``stats.sites == (sites given to build_pairs) + stats.replay_errors``.

    Raises:
        ValueError: on an unknown teacher, a bad argument (see above and `build_pairs`), or an episode whose tokens
            do not match its turns. Errors of the session itself (e.g. a lost server) propagate.
    """
    unknown = [t for t in teachers if t not in TEACHERS]
    if unknown:
        raise ValueError(f"unknown teacher(s) {unknown}; known: {sorted(TEACHERS)}")
    clash = [t for t in teachers if t in _SOURCES]
    if clash:
        raise ValueError(f"teacher name(s) {clash} clash with the built-in sources {list(_SOURCES)}")
    if max_sites < 1 or max_turn_tokens < 1 or samples_per_source < 0 or not temperature > 0.0:
        raise ValueError(
            f"need max_sites >= 1, max_turn_tokens >= 1, samples_per_source >= 0, temperature > 0; got {max_sites}, "
            f"{max_turn_tokens}, {samples_per_source}, {temperature}"
        )
    _check_pairing(mode, min_score_diff, max_pairs_per_turn)
    eos = tokenizer.eos_token_id
    extra = PairStats()

    # 1. Sites and their contexts; the recorded turn is the first candidate.
    sites: list[_Site] = []
    for ep in episodes:
        found = error_sites(ep)
        if not found:
            continue
        spans = {s.turn: s for s in turn_spans(ep, eos)}
        ids = ep.prompt_ids + ep.completion_ids
        for turn in found:
            if len(sites) >= max_sites:
                extra.sites_over_cap += 1
                continue
            reply = ep.turns[turn + 1]
            hint = hints.hint(reply.error_kind, reply.error_meta) if hints is not None else None
            if hints is not None and hint is None:
                extra.no_hint += 1
            span = spans[turn]
            student, teacher = _contexts(ep, span, tokenizer, hint)
            text = ep.turns[turn].content
            site = _Site(ep, turn, student, teacher)
            site.candidates.append(Candidate("recorded", text, ids[span.start: span.end], parse_tool_call(text)))
            sites.append(site)

    # 2. One batched generation for every sampled candidate of the batch.
    requests: list[tuple[_Site, str, list[int]]] = []
    for site in sites:
        for _ in range(samples_per_source):
            requests.append((site, "policy", site.student))
        if site.teacher is not None:
            for _ in range(samples_per_source):
                requests.append((site, "policy+hint", site.teacher))
    if requests:
        device = next(model.parameters()).device
        rng_devices = [device.index or 0] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=rng_devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            generated, _ = _generate(model, tokenizer, [ctx for _, _, ctx in requests], max_turn_tokens, temperature)
        for (site, source, _), new_ids in zip(requests, generated):
            text = tokenizer.decode(new_ids, skip_special_tokens=False)
            ended = bool(new_ids) and new_ids[-1] == eos
            call = parse_tool_call(text) if ended else ParsedCall(None, None, _TRUNCATED)
            site.candidates.append(Candidate(source, text, list(new_ids), call))

    # 3. Teachers' proposals.
    for site in sites:
        for name in teachers:
            proposal = TEACHERS[name](site.episode, site.turn)
            if proposal is None:
                continue
            text, ids = render_tool_call(tokenizer, *proposal)
            site.candidates.append(Candidate(name, text, ids, parse_tool_call(text)))

    # 4. Scores from the environment, one replay per distinct call and site.
    groups: list[TurnCandidates] = []
    for site in sites:
        recorded = site.candidates[0].call
        cache: dict[str, float] = {_call_key(recorded): 0.0} if recorded.ok else {}
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

    # 5. Pairs.
    pairs, stats = build_pairs(groups, mode=mode, min_score_diff=min_score_diff,
                               max_pairs_per_turn=max_pairs_per_turn)
    stats = stats + extra
    log.debug("DPO pairs: %s", stats.as_dict())
    return pairs, stats
