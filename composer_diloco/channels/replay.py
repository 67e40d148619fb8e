"""Replaying a played episode in its environment, and scoring one candidate action there: what trace-replay DPO's
pairs (`composer_diloco.channels.dpo_pairs`) and SDPO's verification (`composer_diloco.channels.sdpo_verify`) share.

The score of a candidate is the environment's own verdict on that one action: the episode is re-run from its
``(seed, episode_id)`` up to the turn and the candidate's call is executed. That needs a deterministic environment;
a replay that diverges from the recorded trace raises `ReplayError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from collections.abc import Sequence

from composer_diloco.rollout.chat import ParsedCall
from composer_diloco.rollout.episode_tokens import TurnSpan, turn_spans
from composer_diloco.rollout.episodes import Episode, EnvSession


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



__all__ = ["Candidate", "RecordedSite", "ReplayError", "check_assistant_turn", "error_sites", "recorded_sites",
           "replay_to", "score_candidate"]


class ReplayError(RuntimeError):
    """Replaying an episode in its environment did not reproduce the recorded trace (or could not be done)."""


def error_sites(episode: Episode) -> list[int]:
    """Indices into ``episode.turns`` of the assistant turns whose tool call came back with an ``error_kind``.

    An assistant turn counts when the turn right after it is a tool turn with ``error_kind is not None``. In order.
    """
    turns = episode.turns
    return [
        k for k in range(len(turns) - 1)
        if turns[k].role == "assistant" and turns[k + 1].role == "tool" and turns[k + 1].error_kind is not None
    ]


@dataclass(frozen=True)
class RecordedSite:
    """A tool-error site of a played episode, located in its tokens.

    Attributes:
        episode: the played episode.
        turn: index into ``episode.turns`` of the assistant turn whose call failed (`error_sites`).
        span: that turn's tokens in ``episode.prompt_ids + episode.completion_ids`` (`turn_spans`).
    """

    episode: Episode
    turn: int
    span: TurnSpan

    @property
    def student(self) -> list[int]:
        """``(S,)`` token ids before the failed turn: the context the policy generated it in (the student's)."""
        return (self.episode.prompt_ids + self.episode.completion_ids)[: self.span.start]

    @property
    def recorded(self) -> list[int]:
        """``(T,)`` the failed turn's token ids after its header, EOS included when present."""
        return (self.episode.prompt_ids + self.episode.completion_ids)[self.span.start: self.span.end]


def recorded_sites(episodes: Sequence[Episode], eos_token_id: int | None,
                   max_sites: int) -> tuple[list[RecordedSite], int]:
    """The tool-error sites of ``episodes`` in episode order, at most ``max_sites`` of them: where DPO's pairings
    (`composer_diloco.channels.dpo_pairs`, `composer_diloco.channels.dpo_recovery`) look.

    Returns:
        ``(sites, over_cap)``: the sites kept, and how many more there were past ``max_sites``.
    Raises:
        ValueError: an episode's tokens do not match its turns (`turn_spans`).
    """
    sites: list[RecordedSite] = []
    over_cap = 0
    for ep in episodes:
        found = error_sites(ep)
        if not found:
            continue
        spans = {s.turn: s for s in turn_spans(ep, eos_token_id)}
        for turn in found:
            if len(sites) >= max_sites:
                over_cap += 1
            else:
                sites.append(RecordedSite(ep, turn, spans[turn]))
    return sites, over_cap


def check_assistant_turn(episode: Episode, turn: int) -> None:
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
    check_assistant_turn(episode, turn)
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
    check_assistant_turn(episode, turn)
    if not candidate.call.ok:
        return 0.0
    replay_to(session, episode, turn)
    _content, kind, _meta, reward, done = session.call(candidate.call.name, candidate.call.arguments)
    if kind is not None:
        return 0.0
    return float(reward) if done else 1.0
