"""Teachers of trace-replay DPO: named policies that propose a tool call at an assistant turn of a played episode.

A teacher's proposal becomes one more candidate of the turn (`dpo_pairs.collect_pairs`), rendered as the assistant
turn the chat template would produce for that call (`render_tool_call`) and scored by the environment like any
other candidate. Teachers are built per run from the env contract (`composer_diloco.rollout.env_package`): the
``"scripted"`` teacher follows the env package's ``script``; this module names no env.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from composer_diloco.rollout.episodes import Episode

if TYPE_CHECKING:
    from composer_diloco.rollout.env_package import EnvPackage, ScriptFn

__all__ = ["SOURCES", "TEACHERS", "ProgressFn", "TeacherFn", "ToolCall", "make_teachers", "render_tool_call",
           "script_progress", "script_remaining", "scripted_teacher"]

ToolCall = tuple[str, dict[str, Any]]
"""One tool call: ``(tool name, arguments)``."""

TeacherFn = Callable[[Episode, int], ToolCall | None]
"""A teacher: ``(episode, turn) -> (tool, arguments)`` it would call at assistant turn ``turn`` (an index into
``episode.turns``), or None when it has no proposal there. It may read only the turns before ``turn``."""

SOURCES = ("recorded", "policy", "policy+hint")
"""The candidate sources `collect_pairs` builds in; no teacher may take one of these names."""


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


def script_remaining(script: ScriptFn, episode: Episode, turn: int) -> list[ToolCall] | None:
    """The scripted solver's calls not yet made successfully before assistant turn ``turn``, in script order.

    A call counts as made when an earlier assistant turn called it (same name and arguments) and its tool reply has
    no ``error_kind``; a successful off-script call (a lookup of another item, a write of wrong code) removes nothing.

    Args:
        script: the env package's ``script(seed, episode_id, question)`` (`EnvPackage.script`).
        episode: a played episode (its first turn is the user question).
        turn: index into ``episode.turns``; only the turns before it are read.
    Returns:
        The calls left, or None when the script does not know the episode's question (or the episode has no turns).
    """
    if not episode.turns:
        return None
    remaining = script(episode.seed, episode.episode_id, episode.turns[0].content)
    if remaining is None:
        return None
    remaining = list(remaining)
    for k in range(min(turn, len(episode.turns) - 1)):
        t, reply = episode.turns[k], episode.turns[k + 1]
        if t.role == "assistant" and t.tool_call is not None and reply.role == "tool" and reply.error_kind is None:
            made = (t.tool_call["name"], t.tool_call["arguments"])
            if made in remaining:
                remaining.remove(made)
    return remaining


ProgressFn = Callable[[Episode, int], "list[ToolCall] | None"]
"""``(episode, turn) -> the calls that make progress at that assistant turn`` (None: unknown, every call counts)."""


def script_progress(env: EnvPackage) -> ProgressFn | None:
    """The env's progress function for DPO scoring (``[loss] dpo_score = "script_progress"``): `script_remaining` of
    the env package's ``script``, or None when the package has no script."""
    if env.script is None:
        return None
    script = env.script
    return lambda episode, turn: script_remaining(script, episode, turn)


def scripted_teacher(script: ScriptFn) -> TeacherFn:
    """The teacher that proposes the env's scripted solver's next correct call.

    Args:
        script: the env package's ``script(seed, episode_id, question) -> [(tool, arguments), ...] | None``
            (`EnvPackage.script`): e.g. for ``envs.tool_env`` lookup x, lookup y, the operation, submit; for the
            coding env read ``solution.py``, write the reference solution, run the tests, submit.

    Returns:
        A `TeacherFn`. At assistant turn ``turn`` it proposes the first script call not yet made successfully before
        ``turn`` (`script_remaining`): for an episode that follows the script that is ``script[k]``, k the number of
        successful calls so far, and a successful off-script call does not make it skip a step. It proposes None
        when the script does not know the episode's question (returns None) or every script call has been made.
    """

    def propose(episode: Episode, turn: int) -> ToolCall | None:
        remaining = script_remaining(script, episode, turn)
        return remaining[0] if remaining else None

    return propose


def _scripted(env: EnvPackage) -> TeacherFn | None:
    return scripted_teacher(env.script) if env.script is not None else None


TEACHERS: dict[str, Callable[[EnvPackage], TeacherFn | None]] = {"scripted": _scripted}
"""Teacher factories by name, for ``[preference] teachers``: ``env package -> TeacherFn`` (None: the env cannot
support it, e.g. no ``script``; the teacher then proposes nothing). Add entries to extend it; a name must not be one
of `SOURCES`."""


def make_teachers(names: Sequence[str], env: EnvPackage,
                  registry: Mapping[str, Callable[[EnvPackage], TeacherFn | None]] | None = None) -> dict[str, TeacherFn]:
    """The teachers named in ``names`` for ``env``, in that order (those the env cannot support are left out).

    Raises:
        ValueError: a name is not in the registry (default `TEACHERS`), or is one of `SOURCES`.
    """
    registry = TEACHERS if registry is None else registry
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"unknown teacher(s) {unknown}; known: {sorted(registry)}")
    clash = [n for n in names if n in SOURCES]
    if clash:
        raise ValueError(f"teacher name(s) {clash} clash with the built-in sources {list(SOURCES)}")
    built = {n: registry[n](env) for n in names}
    return {n: fn for n, fn in built.items() if fn is not None}
