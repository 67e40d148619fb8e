"""The echo env's task and tool, as pure functions: the word of an episode, the tool schema, one call's outcome."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["TOOL_SCHEMAS", "WORDS", "execute", "question_of", "word_of"]

WORDS: tuple[str, ...] = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "maple")

TOOL_SCHEMAS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Say a text back; echoing the asked word ends the episode with reward 1.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "The text."}},
                       "required": ["text"]},
    },
}]


def word_of(seed: int, episode_id: str) -> str:
    """The word episode ``(seed, episode_id)`` asks for (deterministic)."""
    return random.Random(f"{seed}:{episode_id}").choice(WORDS)


def question_of(seed: int, episode_id: str) -> str:
    """The episode's question."""
    return f"Echo the word {word_of(seed, episode_id)}."


def execute(word: str, tool: str, arguments: Any) -> tuple[str, str | None, dict[str, Any]]:
    """One call's ``(content, error_kind, error_meta)`` in an episode asking for ``word``.

    A wrong word is an ``execution_error`` with ``reason="wrong_word"`` (the demos' `REASON_HINTS` key).
    """
    if tool != "echo":
        message = f"unknown tool '{tool}'; available tools: echo"
        return "error: " + message, "tool_not_found", {"tool": tool, "message": message, "available_tools": ["echo"]}
    if not isinstance(arguments, dict) or set(arguments) != {"text"} or not isinstance(arguments["text"], str):
        message = "invalid arguments for echo: expected {'text': string}"
        return "error: " + message, "invalid_args", {
            "tool": tool, "message": message, "expected_schema": TOOL_SCHEMAS[0]["function"]["parameters"]}
    if arguments["text"] != word:
        message = f"'{arguments['text']}' is not the word asked for"
        return "error: " + message, "execution_error", {"tool": tool, "message": message, "reason": "wrong_word",
                                                         "said": arguments["text"]}
    return arguments["text"], None, {}
