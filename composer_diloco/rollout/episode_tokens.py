"""Where each turn of a played episode lies in its token ids, and the template's tokens for extra messages.

A played `Episode` carries ``prompt_ids + completion_ids`` exactly as sampled; ``env_mask`` runs of 1 are the
policy's turns (generated tokens, ending with EOS) and runs of 0 are the environment's (the chat template's
rendering of a tool reply followed by the next assistant header). Reading the runs gives every turn's span in
one linear pass, with no re-tokenization (the collator's cost is linear in episode length).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from composer_diloco.rollout.episodes import Episode


@dataclass(frozen=True)
class TurnSpan:
    """Token span of one turn after the prompt, in ``prompt_ids + completion_ids`` coordinates.

    Attributes:
        turn: index into ``episode.turns``.
        role: "assistant" or "tool".
        start, end: ``[start, end)`` of the turn's tokens (for a tool turn: its rendering and the next
            assistant header; for an assistant turn: the generated tokens, EOS included when present).
        content_end: for an assistant turn, the end of its content tokens (EOS excluded); else ``end``.
    """

    turn: int
    role: str
    start: int
    end: int
    content_end: int


def turn_spans(episode: Episode, eos_token_id: int | None) -> list[TurnSpan]:
    """The spans of the episode's assistant and tool turns, in order.

    Raises:
        ValueError: the ``env_mask`` runs do not match the assistant/tool turns of ``episode.turns``.
    """
    episode.check()
    runs: list[tuple[int, int, int]] = []  # (value, start, end) in completion coordinates
    for i, v in enumerate(episode.env_mask):
        if runs and runs[-1][0] == v and runs[-1][2] == i:
            runs[-1] = (v, runs[-1][1], i + 1)
        else:
            runs.append((v, i, i + 1))
    turns = [(k, t.role) for k, t in enumerate(episode.turns) if t.role in ("assistant", "tool")]
    # A tool turn that ended the episode has no rendered suffix (nothing followed it).
    if turns and turns[-1][1] == "tool" and len(runs) == len(turns) - 1:
        turns = turns[:-1]
    if len(runs) != len(turns):
        raise ValueError(f"episode {episode.episode_id}: {len(runs)} token runs for {len(turns)} assistant/tool turns")
    offset = len(episode.prompt_ids)
    ids = episode.completion_ids
    spans = []
    for (value, s, e), (k, role) in zip(runs, turns):
        expected = 1 if role == "assistant" else 0
        if value != expected:
            raise ValueError(f"episode {episode.episode_id}: turn {k} is {role} but its tokens have env_mask={value}")
        content_end = e - 1 if role == "assistant" and e > s and ids[e - 1] == eos_token_id else e
        spans.append(TurnSpan(k, role, offset + s, offset + e, offset + content_end))
    return spans


@lru_cache(maxsize=64)
def _render_pair(tokenizer: Any, second_role: str, second_content: str) -> tuple[str, str, str]:
    first = [{"role": "user", "content": "x"}]
    p1 = tokenizer.apply_chat_template(first, tokenize=False)
    p1_gen = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    p2 = tokenizer.apply_chat_template(first + [{"role": second_role, "content": second_content}], tokenize=False,
                                       add_generation_prompt=True)
    return p1, p1_gen, p2


def generation_prompt_ids(tokenizer: Any) -> list[int]:
    """Token ids the template appends for ``add_generation_prompt=True`` (the assistant header)."""
    p1, p1_gen, _ = _render_pair(tokenizer, "user", "y")
    if not p1_gen.startswith(p1):
        raise ValueError("chat template: the generation prompt is not a suffix of the rendered conversation")
    return tokenizer(p1_gen[len(p1):], add_special_tokens=False)["input_ids"]


def message_ids(tokenizer: Any, content: str, role: str = "user") -> list[int]:
    """Token ids of one extra message as the template renders it between two turns (no assistant header).

    Used for the SDPO teacher: the hint message inserted before the recovery turn.
    Raises ValueError if the template renders earlier messages differently once this one follows.
    """
    p1, p1_gen, p2 = _render_pair(tokenizer, role, content)
    if not p2.startswith(p1):
        raise ValueError(f"chat template: a {role} message changes how the messages before it render")
    block = p2[len(p1):]
    header = p1_gen[len(p1):]
    if header and block.endswith(header):
        block = block[: -len(header)]
    return tokenizer(block, add_special_tokens=False)["input_ids"]


def header_start(episode: Episode, span: TurnSpan, header_ids: list[int]) -> int:
    """Index where the assistant header before the assistant turn ``span`` begins (start of the turn's scaffold).

    The header is the tail of the previous tool turn's tokens (or of the prompt for the first turn).
    Raises ValueError if the header tokens are not found right before the turn.
    """
    ids = episode.prompt_ids + episode.completion_ids
    h = span.start - len(header_ids)
    if h < 0 or ids[h:span.start] != header_ids:
        raise ValueError(f"episode {episode.episode_id}: no assistant header before turn {span.turn}")
    return h


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of tool replies (and the next assistant header) following an assistant turn that ended in EOS.

    The method of TRL ``GRPOTrainer._get_tool_suffix_ids`` (render a dummy conversation with and without the tool
    messages, slice after the assistant's EOS), for code outside a trainer: trace replay, tests, benchmarks.
    The trainer itself calls TRL's. Raises ValueError if the rendering is not prefix-stable.
    """
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    # the model's own template when it is prefix-stable (Llama 3.1's, for which TRL has no patch), else TRL's patched
    # variant (Qwen3's), as `ComposerGRPOTrainer` chooses
    template = (tokenizer.chat_template if is_chat_template_prefix_preserving(tokenizer)
                else get_training_chat_template(tokenizer))
    name = tool_messages[0].get("name", "tool")
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                  "function": {"name": name, "arguments": {}}}]}]
    prefix = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False, chat_template=template)
    full = tokenizer.apply_chat_template(dummy + tool_messages, tokenize=True, return_dict=False,
                                         add_generation_prompt=True, chat_template=template)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("chat template: the EOS-trimmed prefix is not a prefix of the rendering with tool replies")
    return full[len(prefix):]
