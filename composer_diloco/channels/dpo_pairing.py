"""Pairing for trace-replay DPO: scored candidates of one assistant turn -> DPO pairs ``(x, y_w, y_l)``.

DPO: Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290. This module is pure (no model, no
environment): the candidates (`Candidate`) and their environment scores come from `dpo_pairs.collect_pairs`; the
pairing rules (exhaustive vs best-vs-worst, a minimum score difference, a cap per turn, skip counters) follow the DPO
trajectory builder of NVIDIA's NeMo Agent toolkit, except that identical responses and ties never form a pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from composer_diloco.channels.base import Counts
from composer_diloco.channels.replay import Candidate

__all__ = ["Candidate", "PairMode", "PairStats", "PreferencePair", "TurnCandidates", "build_pairs", "check_pairing"]

PairMode = Literal["exhaustive", "best_vs_worst"]


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
        chosen_mask: ``(Tw,)`` 0/1, which of ``chosen_ids`` DPO scores (a multi-turn chosen, e.g. a recovery of
            `composer_diloco.channels.dpo_recovery`, holds env replies that are context, not response); None = all.
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
    chosen_mask: tuple[int, ...] | None = None

    @property
    def score_diff(self) -> float:
        """``chosen_score - rejected_score`` (> 0)."""
        return self.chosen_score - self.rejected_score


@dataclass
class PairStats(Counts):
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


def check_pairing(mode: str, min_score_diff: float, max_pairs_per_turn: int) -> None:
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
    check_pairing(mode, min_score_diff, max_pairs_per_turn)
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
