"""Test helpers for episodes: a tool call's assistant text, and an `Episode` as `play_episodes` would record it.

A tool call is rendered by the chat template (`composer_diloco.channels.dpo_pairs.render_tool_call`, the format the
warm start trains on and the rollout parses), so tests and the production code share one rendering.
"""

from __future__ import annotations

from typing import Any

from composer_diloco.channels.dpo_pairs import render_tool_call
from composer_diloco.rollout.chat import parse_tool_call
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.episodes import Episode, Turn

__all__ = ["scripted_episode", "tool_call_ids", "tool_call_text"]


def tool_call_text(tokenizer: Any, name: str, arguments: dict[str, Any]) -> str:
    """An assistant turn's text for one tool call, as ``tokenizer``'s chat template renders it (EOS excluded).

    Raises:
        ValueError: from `render_tool_call`, when the template does not render a tool call as generation prompt +
            call + EOS.
    """
    text, _ = render_tool_call(tokenizer, name, arguments)
    return text[: -len(tokenizer.eos_token)]


def tool_call_ids(tokenizer: Any, name: str, arguments: dict[str, Any]) -> list[int]:
    """The token ids a policy generates for one tool call: the rendered call, then EOS (`render_tool_call`).

    Raises:
        ValueError: as `tool_call_text`.
    """
    return render_tool_call(tokenizer, name, arguments)[1]


def scripted_episode(tokenizer: Any, *, seed: int, episode_id: str, question: str, tools: list[dict[str, Any]],
                     steps: list[tuple[str, str, str | None, dict[str, Any]]], reward: float = 0.0) -> Episode:
    """An `Episode` with the token ids `composer_diloco.rollout.play.play_episodes` would produce had the policy
    written ``steps``.

    Args:
        tokenizer: a tokenizer with a chat template that renders ``tools`` and tool replies.
        seed, episode_id: the episode's key.
        question: the user prompt.
        tools: tool schemas (OpenAI function format) the prompt is rendered with.
        steps: ``(assistant text, tool reply, error_kind, error_meta)`` per turn; the last reply may be "" to end
            the episode on the assistant turn's tool call (no suffix rendered, as in a finished episode).
        reward: the episode's reward.
    Raises:
        ValueError: from `tool_suffix_ids` when the template's rendering of tool replies is not prefix-stable.
    """
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=tools,
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    ep = Episode(seed, episode_id, [Turn("user", question)], tools, list(prompt), reward=reward, end_reason="done")
    eos = tokenizer.eos_token_id
    for k, (text, reply, kind, meta) in enumerate(steps):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        ep.completion_ids += ids
        ep.env_mask += [1] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        call = parse_tool_call(text)  # as `composer_diloco.rollout.episodes` records a played turn
        ep.turns.append(Turn("assistant", tokenizer.decode(ids),
                             {"name": call.name, "arguments": call.arguments} if call.ok else None))
        ep.turns.append(Turn("tool", reply, None, kind, dict(meta)))
        if k == len(steps) - 1 and reply == "":
            break
        suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "tool", "content": reply}])
        ep.completion_ids += suffix
        ep.env_mask += [0] * len(suffix)
        ep.logprobs += [0.0] * len(suffix)
    return ep
