"""Chat messages from episodes, and tool calls from model output: the one place for both.

The warm start (``composer_diloco.policy``) and the rollout code both go through this module, so the
text a policy is trained on and the text it is parsed from cannot drift apart.

Message format: OpenAI-style chat messages, as accepted by ``tokenizer.apply_chat_template(messages,
tools=...)`` and by TRL's chat templates. Tool-call format: Qwen3 / Hermes, i.e. the assistant turn
holds ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, which is what Qwen3's chat
template (and TRL's copy of it, ``trl/chat_templates/qwen3.jinja``) renders an assistant
``tool_calls`` entry to; or Llama 3.1 / 3.2's, a turn that is one bare JSON object ``{"name": ..., "parameters":
{...}}`` (``trl/chat_templates/llama3_1.jinja``), optionally after ``<|python_tag|>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ParsedCall", "episode_messages", "parse_tool_call", "task_text"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
_PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a JSON tool call with it
_THINK_BLOCK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    """One tool call parsed from an assistant turn, or why none could be.

    Exactly one of the two holds: ``error is None`` and ``name``/``arguments`` are set, or ``error`` is
    a one-line reason and ``name``/``arguments`` are None.

    Attributes:
        name: the called tool's name, e.g. ``"lookup"`` (not checked against any tool list).
        arguments: the call's arguments as a JSON object (``dict``); values keep their JSON types.
        error: ``None`` on success, else one of ``"no tool call"``, ``"malformed json: <reason>"``,
            ``"malformed call: <reason>"`` (valid JSON of the wrong shape).
    """

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None

    @property
    def ok(self) -> bool:
        """True when a call was parsed (``error is None``)."""
        return self.error is None


def task_text(value: Any) -> str:
    """The task text of a prompt value: a string as it is; chat messages (``[{"role", "content"}]``) as their user
    contents joined by blank lines (every message's when none is a user's); anything else ``""``. Reads a dataset
    row's prompt (`composer_diloco.rollout.tasks`) and a reset observation's task (`composer_diloco.rollout.mcp`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        users = [m for m in value if m.get("role") == "user"] or list(value)
        return "\n\n".join(str(m.get("content") or "") for m in users if m.get("content"))
    return ""


def episode_messages(
    question: str, calls: list[tuple[str, dict[str, Any]]], results: list[str]
) -> list[dict[str, Any]]:
    """Chat messages of an episode: the question, then one assistant tool call and one tool reply per step.

    Args:
        question: the user prompt of the episode.
        calls: the agent's tool calls so far, ``(tool name, arguments)`` in order.
        results: the tool replies (the content shown to the agent, e.g. ``"7"`` or ``"error: ..."``),
            one per call in ``calls`` or one fewer (a last call still waiting for its reply).

    Returns:
        ``[{"role": "user", "content": question}]`` then, per call, ``{"role": "assistant", "content":
        "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}`` and
        (when its result is known) ``{"role": "tool", "content": result}``. Arguments stay dicts; the
        chat template serialises them with ``tojson``.

    Raises:
        ValueError: if ``len(results)`` is neither ``len(calls)`` nor ``len(calls) - 1``.

    Example:
        >>> msgs = episode_messages("What is the price of fig plus the price of kiwi?",
        ...                         [("lookup", {"item": "fig"})], ["3"])
        >>> [m["role"] for m in msgs]
        ['user', 'assistant', 'tool']
        >>> msgs[1]["tool_calls"][0]["function"]
        {'name': 'lookup', 'arguments': {'item': 'fig'}}
    """
    if len(results) not in (len(calls), len(calls) - 1):
        raise ValueError(
            f"episode_messages: got {len(calls)} calls and {len(results)} results; "
            "expected one result per call (or one fewer)"
        )
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for i, (name, arguments) in enumerate(calls):
        messages.append({
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
        })
        if i < len(results):
            messages.append({"role": "tool", "content": results[i]})
    return messages


def parse_tool_call(text: str) -> ParsedCall:
    """Parse the first Qwen3/Hermes tool call (or a Llama 3.1 / 3.2 bare JSON call) out of a decoded assistant turn;
    never raises.

    Accepts surrounding whitespace, an optional leading ``<think>...</think>`` block (Qwen3's empty
    ``<think>\\n\\n</think>`` included), a trailing end-of-turn token left in by the decoder, and a
    missing ``</tool_call>`` (a turn cut at the end tag). Text after the first call is ignored.

    Args:
        text: the assistant's generated text (decoded with or without special tokens).

    Returns:
        A :class:`ParsedCall`. Errors: ``"no tool call"`` (no ``<tool_call>`` tag),
        ``"malformed json: <json error>"``, ``"malformed call: <reason>"`` (the JSON is not an object
        with a string ``"name"`` and an object ``"arguments"``).

    Examples:
        >>> parse_tool_call('<tool_call>\\n{"name": "add", "arguments": {"a": 3, "b": 4}}\\n</tool_call>')
        ParsedCall(name='add', arguments={'a': 3, 'b': 4}, error=None)
        >>> parse_tool_call('<think>\\n\\n</think>\\n\\n<tool_call>\\n{"name": "submit", '
        ...                 '"arguments": {"answer": 7}}\\n</tool_call><|im_end|>').name
        'submit'
        >>> parse_tool_call("The answer is 7.").error
        'no tool call'
        >>> parse_tool_call('{"name": "add", "parameters": {"a": 3, "b": 4}}<|eot_id|>')
        ParsedCall(name='add', arguments={'a': 3, 'b': 4}, error=None)
        >>> parse_tool_call('<tool_call>\\n{"name": "add", "arguments": {"a": 3,}}\\n</tool_call>').error
        'malformed json: Expecting property name enclosed in double quotes: line 1 column 38 (char 37)'
    """
    body = _THINK_BLOCK.sub("", text, count=1)
    start = body.find(_OPEN)
    if start < 0:
        return _parse_bare_json(body)
    body = body[start + len(_OPEN):]
    end = body.find(_CLOSE)
    payload = (body if end < 0 else body[:end]).strip()
    return _parse_payload(payload, "arguments")


def _strip_stops(payload: str) -> str:
    for stop in _STOP_TOKENS:
        payload = payload.removesuffix(stop).rstrip()
    return payload


def _parse_bare_json(body: str) -> ParsedCall:
    """Llama 3.1 / 3.2: the whole turn is ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` first, maybe).
    Any other text without ``<tool_call>`` is no tool call."""
    payload = _strip_stops(body.strip().removeprefix(_PYTHON_TAG).strip())
    if not (payload.startswith("{") and '"name"' in payload):
        return ParsedCall(None, None, "no tool call")
    return _parse_payload(payload, "parameters")


def _parse_payload(payload: str, arguments_key: str) -> ParsedCall:
    """The JSON object of one call: a string ``name`` and an object under ``arguments_key`` (or ``arguments``)."""
    payload = _strip_stops(payload)
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as exc:
        return ParsedCall(None, None, f"malformed json: {exc}")
    if not isinstance(obj, dict):
        return ParsedCall(None, None, f"malformed call: expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str):
        return ParsedCall(None, None, "malformed call: missing string 'name'")
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models emit arguments as a JSON-encoded string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ParsedCall(None, None, f"malformed json: arguments: {exc}")
    if not isinstance(arguments, dict):
        return ParsedCall(None, None,
                          f"malformed call: 'arguments' must be an object, got {type(arguments).__name__}")
    return ParsedCall(name, arguments, None)
