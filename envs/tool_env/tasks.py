"""Procedurally generated price-arithmetic tasks for the tool environment (pure, no server).

An episode shows a catalogue of 4 items with integer prices 1..9 (hidden from the agent) and asks
"What is the price of X plus the price of Y?" (or minus / times). The agent must call
``lookup(item=X)``, ``lookup(item=Y)``, ``<op>(a=px, b=py)`` and ``submit(answer=result)``.

Everything here is a pure function of ``(seed, episode_id)`` or of an explicit ``random.Random``;
the global RNG is never used.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

from envs.schema import function_schema

__all__ = [
    "ERROR_KINDS",
    "ITEM_VOCAB",
    "OPS",
    "TOOL_NAMES",
    "TOOL_SCHEMAS",
    "ErrorKind",
    "Task",
    "execute",
    "make_task",
    "solve",
]

ITEM_VOCAB: tuple[str, ...] = (
    "apple", "pear", "plum", "fig", "kiwi", "lime",
    "lemon", "mango", "peach", "grape", "melon", "cherry",
)
"""Fixed vocabulary the catalogues are drawn from."""

CATALOGUE_SIZE = 4
MIN_PRICE, MAX_PRICE = 1, 9

OPS: dict[str, str] = {"add": "plus", "subtract": "minus", "multiply": "times"}
"""Arithmetic tool name -> the word the question uses for it."""

ErrorKind = Literal["tool_not_found", "invalid_args", "execution_error"]
ERROR_KINDS: tuple[str, ...] = ("tool_not_found", "invalid_args", "execution_error")


_AB = {"a": ("integer", "First number."), "b": ("integer", "Second number.")}
TOOL_SCHEMAS: list[dict[str, Any]] = [
    function_schema("lookup", "Look up the price of an item.",
                    {"item": ("string", "Item name, e.g. apple.")}),
    function_schema("add", "Return a + b.", _AB),
    function_schema("subtract", "Return a - b.", _AB),
    function_schema("multiply", "Return a * b.", _AB),
    function_schema("submit", "Submit the final answer. Ends the episode.",
                    {"answer": ("integer", "The final answer.")}),
]
"""Tool schemas in OpenAI function format (``apply_chat_template(..., tools=TOOL_SCHEMAS)``)."""

TOOL_NAMES: tuple[str, ...] = tuple(s["function"]["name"] for s in TOOL_SCHEMAS)
_PARAMS: dict[str, dict[str, Any]] = {s["function"]["name"]: s["function"]["parameters"]
                                      for s in TOOL_SCHEMAS}


@dataclass(frozen=True)
class Task:
    """One episode's task.

    Attributes:
        question: the user prompt, e.g. "What is the price of apple plus the price of pear?".
        catalogue: item name -> integer price in [1, 9] (4 items).
        x: first item asked about (in ``catalogue``).
        y: second item asked about (in ``catalogue``, != x).
        op: one of ``OPS`` ("add", "subtract", "multiply").
        answer: the correct integer answer ``op(catalogue[x], catalogue[y])``.
    """

    question: str
    catalogue: dict[str, int] = field(hash=False)
    x: str
    y: str
    op: str
    answer: int


def _apply(op: str, a: int, b: int) -> int:
    """Apply arithmetic tool ``op`` to integers."""
    if op == "add":
        return a + b
    if op == "subtract":
        return a - b
    if op == "multiply":
        return a * b
    raise ValueError(f"unknown op {op!r}; expected one of {sorted(OPS)}")


def make_task(seed: int, episode_id: str) -> Task:
    """Build the task of episode ``(seed, episode_id)``; the same pair always gives the same task.

    Args:
        seed: run-level seed (any int).
        episode_id: episode identifier; combined with ``seed`` into a private RNG.
    """
    rng = random.Random(f"{seed}:{episode_id}")
    items = rng.sample(ITEM_VOCAB, CATALOGUE_SIZE)
    catalogue = {item: rng.randint(MIN_PRICE, MAX_PRICE) for item in items}
    x, y = rng.sample(items, 2)
    op = rng.choice(sorted(OPS))
    question = f"What is the price of {x} {OPS[op]} the price of {y}?"
    answer = _apply(op, catalogue[x], catalogue[y])
    return Task(question=question, catalogue=catalogue, x=x, y=y, op=op, answer=answer)


def _type_ok(value: Any, json_type: str) -> bool:
    """Strict JSON-schema type check: bools are not integers, numeric strings are not integers."""
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "string":
        return isinstance(value, str)
    raise ValueError(f"unsupported schema type {json_type!r}")


def _check_args(tool: str, arguments: Any) -> str | None:
    """Return why ``arguments`` do not fit ``tool``'s schema, or None when they do."""
    params = _PARAMS[tool]
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        return f"invalid arguments for {tool}: arguments must be an object, got {kind}"
    missing = [p for p in params["required"] if p not in arguments]
    extra = sorted(set(arguments) - set(params["properties"]))
    problems = []
    if missing:
        problems.append(f"missing argument(s) {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected argument(s) {', '.join(extra)}")
    for name, spec in params["properties"].items():
        if name in arguments and not _type_ok(arguments[name], spec["type"]):
            problems.append(f"argument {name} must be {spec['type']}, "
                            f"got {type(arguments[name]).__name__} {arguments[name]!r}")
    if not problems:
        return None
    return f"invalid arguments for {tool}: " + "; ".join(problems)


def _error(kind: str, meta: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """Package an error: the tool message shows ``"error: " + meta["message"]``."""
    return f"error: {meta['message']}", kind, meta


def execute(task: Task, tool: str, arguments: Any) -> tuple[str, ErrorKind | None, dict[str, Any]]:
    """Run one tool call against ``task``.

    Never raises for bad calls: a failed call is returned as data.

    Returns:
        ``(content, error_kind, error_meta)``. On success ``content`` is the result as text
        (an integer, or "submitted <answer>" for ``submit``), ``error_kind`` is None and
        ``error_meta`` is ``{}``. On failure ``content`` is ``"error: " + error_meta["message"]``
        and:
        ``tool_not_found`` -> meta ``{"tool", "available_tools", "message"}``;
        ``invalid_args`` -> meta ``{"tool", "expected_schema", "message"}`` (missing, extra or
        wrong-typed arguments; strict: bools and numeric strings are not integers);
        ``execution_error`` -> meta ``{"tool", "message"}`` (lookup of an item outside the
        catalogue).
        Whether a submitted answer is correct is for the caller to judge (``task.answer``).
    """
    if tool not in _PARAMS:
        return _error("tool_not_found", {
            "tool": tool,
            "available_tools": list(TOOL_NAMES),
            "message": f"unknown tool {tool!r}; available tools: {', '.join(TOOL_NAMES)}",
        })
    problem = _check_args(tool, arguments)
    if problem is not None:
        return _error("invalid_args", {
            "tool": tool, "expected_schema": _PARAMS[tool], "message": problem,
        })
    if tool == "lookup":
        item = arguments["item"]
        if item not in task.catalogue:
            known = ", ".join(task.catalogue)
            return _error("execution_error", {
                "tool": tool, "message": f"unknown item {item!r}; known items: {known}",
            })
        return str(task.catalogue[item]), None, {}
    if tool == "submit":
        return f"submitted {arguments['answer']}", None, {}
    return str(_apply(tool, arguments["a"], arguments["b"])), None, {}


_WRONG_TOOL_NAMES: dict[str, tuple[str, ...]] = {
    "lookup": ("price", "get", "find"),
    "add": ("sum", "plus"),
    "subtract": ("minus", "difference"),
    "multiply": ("times", "product"),
    "submit": ("answer", "finish"),
}


def _wrong_args(tool: str, args: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Arguments that fail ``tool``'s schema: a renamed key, a missing key, or a wrong type."""
    key = next(iter(args))
    value = args[key]
    variants = [
        {"x": value, **{k: v for k, v in args.items() if k != key}},  # wrong name
        {k: v for k, v in args.items() if k != key},                   # missing
        {**args, key: str(value) if isinstance(value, int) else 3},    # wrong type
    ]
    return rng.choice(variants)


def solve(task: Task, rng: random.Random, error_rate: float) -> list[tuple[str, dict[str, Any]]]:
    """Scripted solver: the 4 correct calls, with one failed call inserted w.p. ``error_rate``.

    The failed call (chosen uniformly among an unknown tool name, invalid arguments, and a lookup of
    an item outside the catalogue) goes right before the correct call it is a failed attempt at, so
    the call after it is the recovery.

    Args:
        task: the episode's task.
        rng: the solver's private RNG (decides whether and how to fail).
        error_rate: probability in [0, 1] of inserting one failed call.

    Raises:
        ValueError: if ``error_rate`` is outside [0, 1].
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    px, py = task.catalogue[task.x], task.catalogue[task.y]
    calls: list[tuple[str, dict[str, Any]]] = [
        ("lookup", {"item": task.x}),
        ("lookup", {"item": task.y}),
        (task.op, {"a": px, "b": py}),
        ("submit", {"answer": task.answer}),
    ]
    if rng.random() >= error_rate:
        return calls
    kind = rng.choice(ERROR_KINDS)
    if kind == "execution_error":
        at = rng.randrange(2)  # only lookups can fail at run time
        outside = [item for item in ITEM_VOCAB if item not in task.catalogue]
        wrong = ("lookup", {"item": rng.choice(outside)})
    else:
        at = rng.randrange(len(calls))
        tool, args = calls[at]
        if kind == "tool_not_found":
            wrong = (rng.choice(_WRONG_TOOL_NAMES[tool]), dict(args))
        else:
            wrong = (tool, _wrong_args(tool, args, rng))
    return calls[:at] + [wrong] + calls[at:]
