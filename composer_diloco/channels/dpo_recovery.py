"""Recovery pairs for trace-replay DPO (``[loss] dpo_score = "recovery"``): at a tool-error site the chosen response is
the env's scripted remainder played from the site to the episode's end, the rejected one the recorded failed call.

Why (issue 40; BENCHMARKS.md 1c, the coding env): with single-call candidates a pair compares the failed call with
the next call of a recovery. On the coding env the failed call is a ``run_tests`` or ``submit`` of wrong code and the
chosen a ``write_file``, which the env always accepts, so every pair pushes down the calls that check or finish the
work, and DPO took the policy to a writer that never submits. Here the chosen is the whole recovery (write the fix,
run the tests, submit): the checking and finishing calls are in it, at the contexts where they pass, so a pair cannot
prefer never finishing. Its score is the episode's final reward when the remainder is played, and only a remainder
that ends the episode with a reward above the failed call's 0 (by at least ``min_score_diff``) forms a pair.

The chosen's tokens are those the policy would have generated and seen: each call as `render_tool_call` renders it
(EOS included), and between two calls the env's reply as the rollout renders it (`tool_suffix_ids` of the reply, cut
to ``max_tool_reply_tokens`` as `composer_diloco.rollout.episodes` does, with the next assistant header). The replies
and headers are context, not response: `PreferencePair.chosen_mask` is 0 on them, so DPO's log p(y_w | x) sums the
calls' tokens only (`composer_diloco.channels.dpo_rows.dpo_rows`).

DPO: Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290. Needs an env package with a scripted solver
(``demos.script``) and a deterministic env, as every replay does (`composer_diloco.channels.replay`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from composer_diloco.channels.dpo_pairing import PairStats, PreferencePair
from composer_diloco.channels.dpo_teachers import render_tool_call, script_remaining
from composer_diloco.channels.replay import ReplayError, recorded_sites, replay_to
from composer_diloco.rollout.env_package import ScriptFn
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.episodes import Episode, EnvSession, cut_reply

__all__ = ["Recovery", "play_recovery", "recovery_pairs"]

log = logging.getLogger(__name__)

SOURCE = "recovery"
"""`PreferencePair.chosen_source` of a recovery pair (its rejected source is ``"recorded"``)."""


@dataclass(frozen=True)
class Recovery:
    """The env's scripted remainder played from a site to the episode's end.

    Attributes:
        token_ids: ``(T,)`` the calls' turn tokens (EOS included) with the replies and next assistant headers between
            them, as the episode would have continued.
        mask: ``(T,)`` 1 on the calls' tokens, 0 on the replies and headers.
        reward: the env's reward when the last call ended the episode (0.0 when the remainder ran out first).
        calls: how many calls were played.
    """

    token_ids: list[int]
    mask: list[int]
    reward: float
    calls: int


def play_recovery(session: EnvSession, episode: Episode, turn: int, tokenizer: Any, script: ScriptFn, *,
                  max_tool_reply_tokens: int | None = None) -> Recovery | None:
    """Replay ``episode`` to assistant turn ``turn`` and play the script's calls still to make from there.

    Args:
        session: an environment session of the episode's env (its call budget the run's ``max_tool_calls``).
        episode: a played episode; ``turn`` indexes one of its assistant turns (a tool-error site).
        tokenizer: the policy's tokenizer (the episode's).
        script: the env package's scripted solver (`EnvPackage.script`).
        max_tool_reply_tokens: ``[env] max_tool_reply_tokens``: replies cut as the rollout cuts them.
    Returns:
        The `Recovery`, or None when the script does not know the episode, has no call left, or one of its calls
        comes back with an ``error_kind`` (the env disagrees with the script: nothing to show).
    Raises:
        ValueError: ``turn`` is not an assistant turn.
        ReplayError: the replay diverges from the record (`replay_to`).
    """
    remaining = script_remaining(script, episode, turn)
    if not remaining:
        return None
    replay_to(session, episode, turn)
    ids: list[int] = []
    mask: list[int] = []
    for n, (name, arguments) in enumerate(remaining, start=1):
        _, call_ids = render_tool_call(tokenizer, name, arguments)
        ids += call_ids
        mask += [1] * len(call_ids)
        content, kind, _meta, reward, done = session.call(name, arguments)
        if kind is not None:
            log.debug("episode %s turn %d: the script's call %s came back with %s", episode.episode_id, turn, name,
                      kind)
            return None
        if done:
            return Recovery(ids, mask, float(reward), n)
        if max_tool_reply_tokens is not None:
            content = cut_reply(tokenizer, content, max_tool_reply_tokens)
        suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": name, "content": content}])
        ids += suffix
        mask += [0] * len(suffix)
    return Recovery(ids, mask, 0.0, len(remaining))  # the script ran out before the episode ended


def recovery_pairs(tokenizer: Any, episodes: Sequence[Episode], session: EnvSession, script: ScriptFn, *,
                   max_sites: int = 4, min_score_diff: float = 0.5,
                   max_tool_reply_tokens: int | None = None) -> tuple[list[PreferencePair], PairStats]:
    """One DPO pair per tool-error site (at most ``max_sites``, in episode order): chosen = the scripted recovery
    (`play_recovery`, ``chosen_mask`` set), rejected = the recorded failed call, prompt = the student context.

    Args:
        tokenizer: the policy's tokenizer.
        episodes: played episodes (`composer_diloco.rollout.play.play_episodes`).
        session: an environment session of their env, used serially for every replay.
        script: the env package's scripted solver.
        max_sites: >= 1, the most error sites examined.
        min_score_diff: >= 0: a recovery forms a pair when its reward is > 0 and >= this (the failed call scores 0).
        max_tool_reply_tokens: as in `play_recovery`.
    Returns:
        ``(pairs, stats)``: ``stats.sites`` examined (replay failures included, counted in ``replay_errors``),
        ``skipped_single_candidate`` (no recovery: the script knows no call left or the env refused one),
        ``skipped_no_score_diff`` (a recovery whose reward is too low), ``sites_over_cap``, ``pairs``.
    Raises:
        ValueError: ``max_sites`` < 1 or ``min_score_diff`` < 0. Errors of the session itself propagate.
    """
    if max_sites < 1 or not min_score_diff >= 0.0:
        raise ValueError(f"need max_sites >= 1 and min_score_diff >= 0; got {max_sites}, {min_score_diff}")
    stats = PairStats()
    pairs: list[PreferencePair] = []
    sites, stats.sites_over_cap = recorded_sites(episodes, tokenizer.eos_token_id, max_sites)
    stats.sites = len(sites)  # replay failures included (``replay_errors``)
    for site in sites:
        try:
            recovery = play_recovery(session, site.episode, site.turn, tokenizer, script,
                                     max_tool_reply_tokens=max_tool_reply_tokens)
        except ReplayError as exc:
            log.warning("dropping DPO site: %s", exc)
            stats.replay_errors += 1
            continue
        stats.candidates += 1 + (recovery is not None)
        if recovery is None:
            stats.skipped_single_candidate += 1
            continue
        if not (recovery.reward > 0.0 and recovery.reward >= min_score_diff):
            stats.skipped_no_score_diff += 1
            continue
        pairs.append(PreferencePair(site.episode.episode_id, site.turn, site.student, recovery.token_ids,
                                    site.recorded, recovery.reward, 0.0, SOURCE, "recorded",
                                    chosen_mask=tuple(recovery.mask)))
    stats.pairs = len(pairs)
    return pairs, stats
