"""Hint text for SDPO's teacher (`composer_diloco.channels.hints`), on metadata from the real tool environment."""

from __future__ import annotations

import logging

import pytest

from composer_diloco.channels.hints import DEFAULT_HINTS, HintRegistry, render_signature
from envs.tool_env.tasks import TOOL_SCHEMAS, execute, make_task

TASK = make_task(0, "hints")
OUTSIDE = next(item for item in ("apple", "pear", "plum", "fig", "kiwi") if item not in TASK.catalogue)


def _fail(tool, arguments):
    content, kind, meta = execute(TASK, tool, arguments)
    assert kind is not None, content
    return kind, meta


def test_default_tool_not_found():
    kind, meta = _fail("sum", {"a": 1, "b": 2})
    assert kind == "tool_not_found"
    assert DEFAULT_HINTS.hint(kind, meta) == (
        "There is no tool 'sum'. Use one of: lookup, add, subtract, multiply, submit."
    )


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"x": 1, "b": 2}, "missing argument(s) a; unexpected argument(s) x."),
        ({"a": "1", "b": 2}, "argument a must be integer, got str '1'."),
        ([1, 2], "arguments must be an object, got list."),
    ],
)
def test_default_invalid_args(arguments, problem):
    kind, meta = _fail("add", arguments)
    assert kind == "invalid_args"
    assert DEFAULT_HINTS.hint(kind, meta) == f"Call add(a: integer, b: integer). Problem: {problem}"


def test_default_execution_error():
    kind, meta = _fail("lookup", {"item": OUTSIDE})
    assert kind == "execution_error"
    hint = DEFAULT_HINTS.hint(kind, meta)
    assert hint == f"lookup failed: {meta['message']}. Check the arguments."
    assert OUTSIDE in hint


def test_default_timeout_and_defaults_cover_every_env_error_kind():
    assert DEFAULT_HINTS.hint("timeout", {"tool": "run_code", "timeout_s": 5.0}) == (
        "run_code timed out after 5 s. Make the call faster or simpler."
    )
    assert DEFAULT_HINTS.hint("timeout", {}) == "The call timed out. Make the call faster or simpler."
    assert DEFAULT_HINTS.kinds() == ("execution_error", "invalid_args", "timeout", "tool_not_found")


def test_defaults_are_short_and_deterministic():
    sites = [_fail("sum", {}), _fail("add", {"a": True}), _fail("lookup", {"item": OUTSIDE}),
             ("timeout", {"tool": "run_code"})]
    for kind, meta in sites:
        first = DEFAULT_HINTS.hint(kind, meta)
        assert first == DEFAULT_HINTS.hint(kind, dict(meta))
        assert 0 < len(first) <= 160, first


def test_default_degrades_on_partial_meta():
    assert DEFAULT_HINTS.hint("tool_not_found", {"tool": "sum"}) == "There is no tool 'sum'."
    assert DEFAULT_HINTS.hint("tool_not_found", {}) is None
    assert DEFAULT_HINTS.hint("invalid_args", {"message": "bad"}) == "Wrong arguments: bad."
    assert DEFAULT_HINTS.hint("invalid_args", {}) is None
    assert DEFAULT_HINTS.hint("execution_error", {"tool": "lookup"}) is None
    assert DEFAULT_HINTS.hint("execution_error", None) is None


def test_unknown_kind_and_success_give_none():
    assert DEFAULT_HINTS.hint("disk_full", {"tool": "x", "message": "y"}) is None
    assert DEFAULT_HINTS.hint(None, {}) is None


def test_render_signature_from_env_schemas():
    signatures = [render_signature(s["function"]["name"], s) for s in TOOL_SCHEMAS]
    assert signatures == [
        "lookup(item: string)",
        "add(a: integer, b: integer)",
        "subtract(a: integer, b: integer)",
        "multiply(a: integer, b: integer)",
        "submit(answer: integer)",
    ]
    schema = {"properties": {"n": {"type": ["integer", "null"]}, "x": {}}, "required": ["x"]}
    assert render_signature("f", schema) == "f(x: any, n?: integer|null)"


def test_config_templates_override_and_extend():
    hints = HintRegistry.from_config({
        "tool_not_found": "No tool {tool!r}. Tools: {available_tools}.",
        "invalid_args": "Use {signature}.",
        "rate_limited": "Wait {wait_s} s before calling {tool} again.",
    })
    assert hints.hint(*_fail("sum", {})) == "No tool 'sum'. Tools: lookup, add, subtract, multiply, submit."
    assert hints.hint(*_fail("add", {"a": 1})) == "Use add(a: integer, b: integer)."
    assert hints.hint("rate_limited", {"tool": "add", "wait_s": 2}) == "Wait 2 s before calling add again."
    # Kinds the config does not name keep their defaults; the defaults themselves are untouched.
    assert hints.hint(*_fail("lookup", {"item": OUTSIDE})) == DEFAULT_HINTS.hint(*_fail("lookup", {"item": OUTSIDE}))
    assert DEFAULT_HINTS.hint(*_fail("sum", {})).startswith("There is no tool")
    assert "rate_limited" in hints and "rate_limited" not in DEFAULT_HINTS
    assert HintRegistry.from_config(None).kinds() == DEFAULT_HINTS.kinds()


def test_template_fields_render_schema_compactly():
    hints = HintRegistry({"invalid_args": "{tool} takes {expected_schema}."})
    assert hints.hint(*_fail("add", {"a": 1})) == "add takes a: integer, b: integer."


def test_missing_template_key_gives_none_and_logs_at_debug(caplog):
    hints = HintRegistry.from_config({"execution_error": "{tool} failed after {retries} retries."})
    with caplog.at_level(logging.DEBUG, logger="composer_diloco.channels.hints"):
        assert hints.hint(*_fail("lookup", {"item": OUTSIDE})) is None
    assert "retries" in caplog.text
    # Positional fields and bad attribute/index access are "missing keys" too.
    assert HintRegistry({"k": "{0}"}).hint("k", {}) is None
    assert HintRegistry({"k": "{tool.name}"}).hint("k", {"tool": "x"}) is None


def test_empty_template_disables_a_kind():
    hints = HintRegistry.from_config({"timeout": ""})
    assert hints.hint("timeout", {"tool": "run_code"}) is None


def test_function_hints_and_copy_are_independent():
    hints = DEFAULT_HINTS.copy()
    hints.register("tool_not_found", lambda meta: f"{meta['tool']}? no.")
    assert hints.hint("tool_not_found", {"tool": "sum"}) == "sum? no."
    assert hints.hint("tool_not_found", {}) is None  # a KeyError in a hint function counts as a missing key
    assert DEFAULT_HINTS.hint("tool_not_found", {"tool": "sum"}) == "There is no tool 'sum'."
    other = hints.copy()
    other.register("tool_not_found", "x")
    assert hints.hint("tool_not_found", {"tool": "sum"}) == "sum? no."


def test_registry_errors():
    with pytest.raises(TypeError, match="read-only"):
        DEFAULT_HINTS.register("timeout", "slow")
    with pytest.raises(ValueError, match="timeout"):
        HintRegistry.from_config({"timeout": "unclosed {brace"})
    with pytest.raises(ValueError, match="timeout"):
        HintRegistry.from_config({"timeout": 3})
    with pytest.raises(ValueError, match="non-empty"):
        HintRegistry().register("", "x")
    with pytest.raises(TypeError):
        HintRegistry().register("k", 3)
