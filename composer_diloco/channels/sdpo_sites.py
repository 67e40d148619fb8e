"""SDPO's rows: the tool-error sites of played episodes (or raw traces), as student/teacher token ids with aligned
indices, and their padded tensors (`SDPO_KEYS` of `composer_diloco.channels.sdpo`).

Hint distillation at tool-error sites (Hübotter et al., arXiv 2601.20802; the "SDPO" of TRL's
``trl/experimental/sdpo``). A site is an assistant turn whose tool call failed, followed by a non-empty recovery
turn, with a hint for the error (`composer_diloco.channels.hints`). The student context is the episode up to the
end of the recovery turn; the teacher context is the same tokens with the hint message (the chat template's rendering
of ``{"role": "user", "content": hint}``) inserted right before the recovery turn's assistant header. Student and
teacher are aligned by explicit indices (``student_response_idx[s, j]`` and ``teacher_response_idx[s, j]`` hold the
same token), covering the recovery turn's content tokens only: never the template's scaffolding, never the hint. Sites
without a hint or with an empty recovery are skipped and counted. The ids are the episode's own, what GRPO trains on.

Cost: linear in trace length. Episodes are read through their ``env_mask`` runs (`episode_tokens`); raw traces are
rendered once with offsets; nothing re-tokenizes a prefix (`bench/collator.py` compares with the prefix re-tokenizing
approach of the seed collator).

Truncation to ``max_length`` cuts context from the left, the same number of tokens from student and teacher, and never
inside the hint or the SDPO region; a site whose region and hint cannot fit is dropped and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_diloco.channels.base import Counts, pad_id, pad_rows
from composer_diloco.channels.hints import DEFAULT_HINTS, HintRegistry, teacher_hint
from composer_diloco.rollout.episode_tokens import generation_prompt_ids, header_start, message_ids, turn_spans
from composer_diloco.rollout.episodes import Episode, Turn

__all__ = ["SdpoSite", "SdpoStats", "SiteFinder", "peer_demos", "successful_calls"]


@dataclass
class SdpoSite:
    """One SDPO site: student and teacher token ids and the aligned indices of the recovery turn's content.

    Attributes:
        episode_id: the episode the site comes from.
        turn: index in the trace's turns of the recovery (assistant) turn.
        error_kind: the tool error that preceded it.
        hint: the hint text inserted into the teacher context.
        student_ids: (Ls,) student context, ending with the recovery turn.
        teacher_ids: (Lt,) = student_ids with the hint message inserted; Lt = Ls + len(hint tokens).
        student_idx: positions in student_ids of the recovery turn's content tokens.
        teacher_idx: the same tokens' positions in teacher_ids (``student_ids[s] == teacher_ids[t]`` pairwise).
    """

    episode_id: str
    turn: int
    error_kind: str
    hint: str
    student_ids: list[int]
    teacher_ids: list[int]
    student_idx: list[int]
    teacher_idx: list[int]


@dataclass
class SdpoStats(Counts):
    """What SDPO site building kept and skipped (counts of sites; per step, summed over a round).

    Attributes:
        sdpo_sites: sites kept.
        sdpo_skipped_no_hint: the hint registry had no hint for the error.
        sdpo_skipped_empty_recovery: the recovery turn has no content (empty or whitespace only).
        sdpo_skipped_no_recovery: the error is the trace's last turn, or no assistant turn follows it.
        sdpo_skipped_truncated: the hint or the recovery turn would not fit ``max_length``.
        sdpo_skipped_unverified: with ``[loss] sdpo_verify_samples``, the hinted teacher's sampled recovery did not
            beat the student's by env replay (`composer_diloco.channels.sdpo_verify`).
    """

    sdpo_sites: int = 0
    sdpo_skipped_no_hint: int = 0
    sdpo_skipped_empty_recovery: int = 0
    sdpo_skipped_no_recovery: int = 0
    sdpo_skipped_truncated: int = 0
    sdpo_skipped_unverified: int = 0


class SiteFinder:
    """Finds SDPO sites and pads them into SDPO's tensors (the module docstring has the method).

    Args:
        tokenizer: a tokenizer with a chat template (fast tokenizer with offsets for raw traces).
        hints: the hint registry (error kind + metadata -> hint text).
        max_length: maximum tokens of a student or teacher sequence.
        hint_role: role of the inserted hint message ("user" renders in every common template).
    """

    def __init__(self, tokenizer: Any, *, hints: HintRegistry = DEFAULT_HINTS, max_length: int = 1024,
                 hint_role: str = "user"):
        self.tokenizer, self.hints, self.max_length, self.hint_role = tokenizer, hints, max_length, hint_role
        self.pad_token_id = pad_id(tokenizer)
        self.header_ids = generation_prompt_ids(tokenizer)

    def sites_from_episode(self, episode: Episode, stats: SdpoStats,
                           demo: Sequence[tuple[str, dict[str, Any]]] | None = None) -> list[SdpoSite]:
        """SDPO sites of a played episode, from its token ids (one pass over its ``env_mask`` runs).

        Args:
            episode: a played episode (``prompt_ids`` (P,), ``completion_ids`` / ``env_mask`` (C,), its turns).
            stats: counts kept/skipped sites into its ``sdpo_*`` fields.
            demo: a successful peer attempt's calls (:func:`peer_demos`), shown to the teacher before the error hint
                at every site of the episode (`composer_diloco.channels.hints.teacher_hint`); None: the hint only.
        Returns:
            The sites in turn order (ids are the episode's own: what GRPO trains on).
        Raises:
            ValueError: the episode's token runs do not match its turns (`composer_diloco.rollout.episode_tokens`).
        """
        ids = episode.prompt_ids + episode.completion_ids
        spans = turn_spans(episode, self.tokenizer.eos_token_id)
        sites = []
        for i, span in enumerate(spans):
            tool = episode.turns[span.turn]
            if span.role != "tool" or tool.error_kind is None:
                continue
            recovery = spans[i + 1] if i + 1 < len(spans) else None
            if recovery is None:
                stats.sdpo_skipped_no_recovery += 1
                continue
            site = self._site(episode.episode_id, ids, recovery.turn, header_start(episode, recovery, self.header_ids),
                              recovery.start, recovery.content_end, tool, stats, demo)
            if site is not None:
                sites.append(site)
        return sites

    def sites_from_trace(self, turns: Sequence[Turn], tools: list[dict] | None, stats: SdpoStats,
                         episode_id: str = "") -> tuple[list[int], list[SdpoSite]]:
        """Render a raw trace once with the chat template and find its SDPO sites.

        Assistant turns are rendered with their raw text as content (the text the policy produced). Each turn's
        content is located once, left to right; an assistant turn's content is searched after its assistant header,
        so a short recovery text that also occurs in the template's scaffolding (``"end"`` in ``<|im_end|>``) is
        found in the turn itself. An empty or whitespace-only recovery turn is skipped and counted in
        ``sdpo_skipped_empty_recovery``.

        Args:
            turns: the trace, in order (``role``, ``content``, ``error_kind``, ``error_meta`` of tool turns).
            tools: the tool schemas the template renders into the system prompt, or None.
            stats: counts kept/skipped sites into its ``sdpo_*`` fields.
            episode_id: names the sites.
        Returns:
            ``(input_ids, sites)``: the single rendering's token ids (``(L,)``, what GRPO would train on) and the sites.
        Raises:
            ValueError: a message's content cannot be located in the rendering (a template that rewrites it), or a
                recovery turn has no assistant header after its tool reply.
        """
        messages = [{"role": t.role, "content": t.content} for t in turns]
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        starts = {s: k for k, (s, e) in enumerate(offsets) if e > s}
        header_text = self.tokenizer.decode(self.header_ids)
        char_spans, headers = _locate_turns(text, turns, header_text)
        sites = []
        for k in range(1, len(turns) - 1):
            tool = turns[k]
            if tool.role != "tool" or tool.error_kind is None:
                continue
            nxt = k + 1
            if turns[nxt].role != "assistant":
                stats.sdpo_skipped_no_recovery += 1
                continue
            if not turns[nxt].content.strip():  # nothing to distil: counted like an empty played recovery turn
                stats.sdpo_skipped_empty_recovery += 1
                continue
            cs, ce = char_spans[nxt]
            h_char = headers[nxt]
            if h_char < char_spans[k][1] or h_char not in starts:
                raise ValueError(f"chat template: no assistant header before turn {nxt}")
            tok_s = _token_at_or_after(offsets, cs)
            tok_e = _token_at_or_after(offsets, ce)
            while tok_e > tok_s and offsets[tok_e - 1][1] > ce:  # a token running into the scaffolding
                tok_e -= 1
            site = self._site(episode_id, ids, nxt, starts[h_char], tok_s, tok_e, tool, stats)
            if site is not None:
                sites.append(site)
        return ids, sites

    def _site(self, episode_id: str, ids: list[int], turn: int, header: int, content_start: int, content_end: int,
              tool: Turn, stats: SdpoStats, demo: Sequence[tuple[str, dict[str, Any]]] | None = None
              ) -> SdpoSite | None:
        if content_end <= content_start:
            stats.sdpo_skipped_empty_recovery += 1
            return None
        hint = teacher_hint(self.hints.hint(tool.error_kind, tool.error_meta), demo)
        if not hint:
            stats.sdpo_skipped_no_hint += 1
            return None
        hint_ids = message_ids(self.tokenizer, hint, self.hint_role)
        student = ids[:content_end]
        teacher = student[:header] + hint_ids + student[header:]
        cut = max(0, len(teacher) - self.max_length)
        if cut > header:  # the hint or the region would be cut: drop the site rather than lose loss tokens
            stats.sdpo_skipped_truncated += 1
            return None
        student, teacher = student[cut:], teacher[cut:]
        s_idx = list(range(content_start - cut, content_end - cut))
        t_idx = [s + len(hint_ids) for s in s_idx]
        stats.sdpo_sites += 1
        return SdpoSite(episode_id, turn, tool.error_kind, hint, student, teacher, s_idx, t_idx)

    # -- the tensors ---------------------------------------------------------------------------------
    def tensors(self, sites: Sequence[SdpoSite]) -> dict[str, torch.Tensor]:
        """Pad S >= 1 sites into SDPO's tensors: ``sdpo_student_ids`` (S, Ls) long, ``sdpo_student_attention_mask``
        (S, Ls), ``sdpo_teacher_ids`` (S, Lt), ``sdpo_teacher_attention_mask`` (S, Lt), ``student_response_idx`` /
        ``teacher_response_idx`` (S, R) long, ``student_response_valid`` / ``teacher_response_valid`` (S, R) bool, and
        ``sdpo_student_mask`` (S, Ls) / ``sdpo_teacher_mask`` (S, Lt) bool (the same tokens as masks). Padding is on
        the right with ``pad_token_id``."""
        s_ids, s_att = pad_rows([s.student_ids for s in sites], self.pad_token_id)
        t_ids, t_att = pad_rows([s.teacher_ids for s in sites], self.pad_token_id)
        r = max(len(s.student_idx) for s in sites)
        s_idx = torch.zeros((len(sites), r), dtype=torch.long)
        t_idx = torch.zeros((len(sites), r), dtype=torch.long)
        valid = torch.zeros((len(sites), r), dtype=torch.bool)
        s_mask = torch.zeros_like(s_ids, dtype=torch.bool)
        t_mask = torch.zeros_like(t_ids, dtype=torch.bool)
        for row, site in enumerate(sites):
            n = len(site.student_idx)
            s_idx[row, :n] = torch.tensor(site.student_idx)
            t_idx[row, :n] = torch.tensor(site.teacher_idx)
            valid[row, :n] = True
            s_mask[row, site.student_idx] = True
            t_mask[row, site.teacher_idx] = True
        return {
            "sdpo_student_ids": s_ids, "sdpo_student_attention_mask": s_att,
            "sdpo_teacher_ids": t_ids, "sdpo_teacher_attention_mask": t_att,
            "student_response_idx": s_idx, "teacher_response_idx": t_idx,
            "student_response_valid": valid, "teacher_response_valid": valid.clone(),
            "sdpo_student_mask": s_mask, "sdpo_teacher_mask": t_mask,
        }


def _locate_turns(text: str, turns: Sequence[Turn], header_text: str) -> tuple[list[tuple[int, int]], list[int]]:
    """Where each turn's (stripped) content lies in the rendered ``text``, and each assistant turn's header.

    Each content is located once, left to right (linear in the text's length); an assistant turn's content is
    searched after its own header, so a short content that also occurs in the scaffolding before it is not
    matched there. Returns ``(char_spans, headers)``: ``[(start, end)]`` character offsets per turn (an empty
    content is the empty span at the cursor), and per turn the character offset of its assistant header (-1 for
    other roles, or when no header follows the previous turn).

    Raises:
        ValueError: a turn's content is not in the rendering after the previous turn's.
    """
    cursor, char_spans, headers = 0, [], []
    for t in turns:
        header = -1
        if t.role == "assistant":  # the content follows the turn's header: search after it, not at the cursor
            header = text.find(header_text, cursor)
            cursor = header + len(header_text) if header >= 0 else cursor
        content = t.content.strip()
        pos = text.find(content, cursor) if content else cursor
        if pos < 0:
            raise ValueError(f"chat template: content of a {t.role} turn not found in the rendering")
        char_spans.append((pos, pos + len(content)))
        headers.append(header)
        cursor = pos + len(content)
    return char_spans, headers


def _token_at_or_after(offsets: Sequence[tuple[int, int]], char: int) -> int:
    """Index of the first token whose span starts at or after ``char`` (binary search over offsets)."""
    lo, hi = 0, len(offsets)
    while lo < hi:
        mid = (lo + hi) // 2
        if offsets[mid][0] < char:
            lo = mid + 1
        else:
            hi = mid
    return lo


def successful_calls(turns: Sequence[Turn]) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls of ``turns`` (an episode's, or a prefix of them) that ran without a tool error, in order:
    ``[(name, arguments), ...]``; a call whose reply is not in ``turns`` is left out."""
    return [(t.tool_call["name"], t.tool_call["arguments"]) for t, reply in zip(turns, turns[1:])
            if t.role == "assistant" and t.tool_call is not None and reply.role == "tool" and reply.error_kind is None]


def peer_demos(episodes: Sequence[Episode], min_reward: float) -> list[list[tuple[str, dict[str, Any]]] | None]:
    """Per episode, a successful peer attempt to show SDPO's teacher: the calls (:func:`successful_calls`) of the
    highest-reward *other* episode of its GRPO group (same ``(seed, episode_id)``) whose reward is at least
    ``min_reward``, the earliest on a tie; None when the group has none (SDPO's reprompting with successful peer
    rollouts, arXiv 2601.20802, without the episode's own rollout).

    Args:
        episodes: the step's episodes (groups in any order).
        min_reward: the least reward of an attempt that counts as successful (``[loss] sdpo_peer_demo_reward``).
    Returns:
        A list aligned with ``episodes``.
    """
    groups: dict[tuple[int, str], list[int]] = {}
    for i, ep in enumerate(episodes):
        groups.setdefault((ep.seed, ep.episode_id), []).append(i)
    out: list[list[tuple[str, dict[str, Any]]] | None] = []
    for i, ep in enumerate(episodes):
        peers = [j for j in groups[(ep.seed, ep.episode_id)] if j != i and episodes[j].reward >= min_reward]
        best = max(peers, key=lambda j: (episodes[j].reward, -j), default=None)
        calls = successful_calls(episodes[best].turns) if best is not None else []
        out.append(calls or None)
    return out
