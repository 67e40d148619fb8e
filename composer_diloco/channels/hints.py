"""Hint text from a failed tool call's ``error_kind`` and ``error_meta``: SDPO's teacher context, and the
hint-conditioned candidates of trace-replay DPO (`composer_diloco.channels.dpo_pairs`).

SDPO (Hübotter et al., "Reinforcement Learning via Self-Distillation", arXiv 2601.20802) distills the policy
towards itself conditioned on feedback. Here the feedback is a short hint about a failed tool call: the teacher
sees the student's context plus the hint, and the student is pulled towards what the teacher would have emitted.

An environment reports a failed call as ``error_kind`` and ``error_meta`` (the kinds of OpenEnv's
``ToolErrorType``, `composer_diloco.rollout.mcp`):

- ``tool_not_found``: ``{"tool", "available_tools", "message"}``;
- ``invalid_args``: ``{"tool", "expected_schema", "message"}`` (``expected_schema``: the JSON schema of the tool's
  parameters);
- ``execution_error``: ``{"tool", "message"}``;
- ``timeout``: ``{"tool", "message"}`` and maybe ``timeout_s`` and ``test`` (the test that hung).

An env may add a ``reason`` to ``execution_error`` metadata (e.g. ``tests_failed`` with ``test`` and ``detail``) and
ship a hint template per reason in its package (``REASON_HINTS``, the env contract's ``reason_hints``,
`composer_diloco.rollout.env_package`): `default_hints` takes them, and falls back to the generic hint. This module
names no env.

A tiny model reads the hints, so they are one or two short sentences, and a pure function of the metadata.
"""

from __future__ import annotations

import functools
import json
import logging
import string
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

__all__ = ["DEFAULT_HINTS", "HintFn", "HintRegistry", "default_hints", "peer_demo_text", "render_signature",
           "teacher_hint"]

logger = logging.getLogger(__name__)

HintFn = Callable[[Mapping[str, Any]], str | None]
"""A hint function: error metadata -> hint text, or None for no hint at this error site."""


def _params_schema(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``{"properties", "required"}`` part of a schema, also when wrapped in OpenAI function format."""
    if isinstance(schema.get("function"), Mapping):
        schema = schema["function"]
    if isinstance(schema.get("parameters"), Mapping):
        schema = schema["parameters"]
    return schema


def _type_name(spec: Any) -> str:
    """The JSON type of one property spec: ``integer``, ``integer|string`` for a list, ``any`` when absent."""
    if not isinstance(spec, Mapping):
        return "any"
    kind = spec.get("type")
    if isinstance(kind, str):
        return kind
    if isinstance(kind, Sequence) and kind:
        return "|".join(str(k) for k in kind)
    return "any"


def _render_args(schema: Mapping[str, Any]) -> str:
    """``a: integer, b: integer``: required arguments first (schema order), then optional ones as ``name?``."""
    params = _params_schema(schema)
    props = params.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = [str(r) for r in params.get("required", ()) if isinstance(r, str)]
    optional = [p for p in props if p not in required]
    parts = [f"{name}: {_type_name(props.get(name))}" for name in required]
    parts += [f"{name}?: {_type_name(props[name])}" for name in optional]
    return ", ".join(parts)


def render_signature(tool: str, schema: Mapping[str, Any]) -> str:
    """A compact call signature from a JSON schema, e.g. ``add(a: integer, b: integer)``.

    Args:
        tool: the tool name.
        schema: the tool's parameter schema (``{"type": "object", "properties", "required"}``), or a whole tool
            schema in OpenAI function format. Required arguments come first, in schema order, then optional ones
            marked ``name?``; a property without a type shows ``any``.
    """
    return f"{tool}({_render_args(schema)})"


def _template_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The values a template sees: meta with lists joined by ", ", schemas rendered, and ``signature`` added."""
    fields: dict[str, Any] = {}
    for key, value in meta.items():
        if isinstance(value, Mapping) and ("properties" in value or "parameters" in value or "function" in value):
            fields[key] = _render_args(value)
        elif isinstance(value, (list, tuple)):
            fields[key] = ", ".join(str(v) for v in value)
        else:
            fields[key] = value
    schema = meta.get("expected_schema")
    if "tool" in meta and isinstance(schema, Mapping) and "signature" not in meta:
        fields["signature"] = render_signature(str(meta["tool"]), schema)
    return fields


def _check_template(kind: str, template: str) -> None:
    """Raise ValueError when ``template`` is not valid ``str.format`` syntax (e.g. an unmatched brace)."""
    try:
        list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"hint template for {kind!r} is not a valid str.format template: {template!r} ({exc})"
        ) from exc


def _template_fn(kind: str, template: str) -> HintFn:
    """A hint function that fills ``template`` from the metadata (see `HintRegistry.register`)."""
    _check_template(kind, template)

    def fill(meta: Mapping[str, Any]) -> str | None:
        try:
            return template.format(**_template_fields(meta))
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
            logger.debug("no %s hint: template %r does not fit meta keys %s (%r)", kind, template,
                         sorted(meta), exc)
            return None

    fill.__doc__ = f"Template hint for {kind!r}: {template!r}"
    return fill


class HintRegistry:
    """Maps a tool error kind to a hint function ``(meta) -> str | None``.

    Args:
        hints: optional initial ``kind -> hint function or template`` entries (see `register`).
        read_only: if True, `register` raises; `copy` gives a writable copy. `DEFAULT_HINTS` is read-only so
            that no caller changes the defaults for everyone.

    Example::

        hints = HintRegistry.from_config({"tool_not_found": "No tool {tool!r}. Tools: {available_tools}."})
        hints.hint("tool_not_found", meta)   # -> "No tool 'sum'. Tools: lookup, add, ..."
    """

    def __init__(self, hints: Mapping[str, HintFn | str] | None = None, *, read_only: bool = False):
        self._hints: dict[str, HintFn] = {}
        self._read_only = False
        for kind, hint in (hints or {}).items():
            self.register(kind, hint)
        self._read_only = read_only

    def register(self, kind: str, hint: HintFn | str) -> None:
        """Set (or replace) the hint of ``kind``.

        Args:
            kind: an error kind, e.g. ``"invalid_args"``.
            hint: a function ``(meta) -> str | None``, or a ``str.format`` template over the meta keys. A
                template sees every meta key, with lists joined by ``", "`` and a JSON schema rendered as
                ``a: integer, b: integer``, plus ``signature`` (e.g. ``add(a: integer, b: integer)``) when the meta
                has ``tool`` and ``expected_schema``. An empty template turns the kind's hints off.

        Raises:
            ValueError: if ``kind`` is not a non-empty string or the template has bad ``str.format`` syntax.
            TypeError: if ``hint`` is neither callable nor a string, or the registry is read-only.
        """
        if self._read_only:
            raise TypeError("this HintRegistry is read-only (DEFAULT_HINTS); register on a .copy() instead")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"error kind must be a non-empty string, got {kind!r}")
        if isinstance(hint, str):
            self._hints[kind] = _template_fn(kind, hint)
        elif callable(hint):
            self._hints[kind] = hint
        else:
            raise TypeError(f"hint for {kind!r} must be a template string or a callable, got {type(hint).__name__}")

    def hint(self, kind: str | None, meta: Mapping[str, Any] | None) -> str | None:
        """The hint text for one error site, or None for no hint.

        None when ``kind`` has no registered hint (including None: a successful call), when a template needs a key
        the meta lacks (logged at debug level), or when the hint comes out empty. A hint function's own
        ``KeyError`` counts as a missing key; other exceptions from a user's function propagate.

        Args:
            kind: the ``error_kind`` the environment reported.
            meta: the ``error_meta`` the environment reported (None is treated as ``{}``).
        """
        fn = self._hints.get(kind) if kind is not None else None
        if fn is None:
            logger.debug("no hint registered for error kind %r", kind)
            return None
        try:
            text = fn(meta or {})
        except KeyError as exc:
            logger.debug("no %s hint: meta lacks key %s", kind, exc)
            return None
        if text is None:
            return None
        text = str(text).strip()
        return text or None

    def kinds(self) -> tuple[str, ...]:
        """The error kinds that have a hint, sorted."""
        return tuple(sorted(self._hints))

    def __contains__(self, kind: object) -> bool:
        return kind in self._hints

    def copy(self) -> HintRegistry:
        """A writable copy (the hint functions are shared; they are stateless)."""
        return HintRegistry(self._hints)

    @classmethod
    def from_config(cls, mapping: Mapping[str, str] | None, *, base: HintRegistry | None = None,
                    reason_hints: Mapping[str, str] | None = None) -> HintRegistry:
        """The defaults (or ``base``), overridden and extended by templates from a config table.

        Args:
            mapping: the ``[hints]`` table, ``kind = "template"`` (see `register` for the template fields). An
                empty template turns that kind's hints off. None or ``{}`` gives the defaults.
            base: the registry to start from (default: `default_hints` of ``reason_hints``); it is not modified.
            reason_hints: the env's ``{reason: template}`` hints (`EnvPackage.reason_hints`); ignored with ``base``.

        Raises:
            ValueError: if a value is not a string or not a valid template (naming the kind).
        """
        registry = (base if base is not None else default_hints(reason_hints)).copy()
        for kind, template in (mapping or {}).items():
            if not isinstance(template, str):
                raise ValueError(
                    f"[hints] {kind} must be a template string, got {type(template).__name__} {template!r}"
                )
            registry.register(kind, template)
        return registry


# ---------------------------------------------------------------------------------------------------------------
# Default hints: one or two short sentences each.


def _sentence(text: str) -> str:
    """``text`` stripped, ending with exactly one period (unless it ends with other punctuation)."""
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _tool_not_found(meta: Mapping[str, Any]) -> str | None:
    """``There is no tool 'sum'. Use one of: lookup, add, subtract, multiply, submit.``"""
    tool, tools = meta.get("tool"), meta.get("available_tools")
    listed = ", ".join(str(t) for t in tools) if isinstance(tools, (list, tuple)) and tools else None
    if tool is None and listed is None:
        return None
    first = f"There is no tool {str(tool)!r}." if tool is not None else "That tool does not exist."
    return f"{first} Use one of: {listed}." if listed else first


def _invalid_args(meta: Mapping[str, Any]) -> str | None:
    """``Call add(a: integer, b: integer). Problem: missing argument(s) a.``"""
    tool, schema, message = meta.get("tool"), meta.get("expected_schema"), meta.get("message")
    problem = None
    if isinstance(message, str) and message.strip():
        problem = message.strip()
        prefix = f"invalid arguments for {tool}:"
        if problem.startswith(prefix):  # the env's own wording; the tool name is already in the signature
            problem = problem[len(prefix):].strip()
    if tool is not None and isinstance(schema, Mapping):
        call = f"Call {render_signature(str(tool), schema)}."
        return f"{call} Problem: {_sentence(problem)}" if problem else call
    if problem:
        return f"Wrong arguments: {_sentence(problem)}"
    return None


_NO_REASONS: Mapping[str, str] = MappingProxyType({})


def _by_reason(meta: Mapping[str, Any], reasons: Mapping[str, str]) -> str | None:
    """The ``reasons`` template for ``meta["reason"]``, filled, or None (no reason, or a key it needs is missing)."""
    template = reasons.get(meta.get("reason")) if isinstance(meta.get("reason"), str) else None
    if template is None:
        return None
    try:
        return template.format(**_template_fields(meta))
    except (KeyError, IndexError, AttributeError, ValueError, TypeError):
        return None


def _execution_error(meta: Mapping[str, Any], reasons: Mapping[str, str] = _NO_REASONS) -> str | None:
    """``lookup failed: unknown item 'kiwi'; known items: apple, pear. Check the arguments.``

    With a ``meta["reason"]`` that ``reasons`` (the env's ``REASON_HINTS``) has a template for, that template
    filled, e.g. ``test_2 failed: f(2) returned 3, expected 4. Fix solution.py, then run the tests again.``
    """
    by_reason = _by_reason(meta, reasons)
    if by_reason:
        return by_reason
    tool, message = meta.get("tool"), meta.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    who = f"{tool} failed" if tool is not None else "The call failed"
    return f"{who}: {_sentence(message)} Check the arguments."


def _timeout(meta: Mapping[str, Any]) -> str:
    """``run_code timed out after 5 s. Make the call faster or simpler.``"""
    tool, limit = meta.get("tool"), meta.get("timeout_s")
    who = f"{tool} timed out" if tool is not None else "The call timed out"
    after = f" after {limit:g} s" if isinstance(limit, (int, float)) and not isinstance(limit, bool) else ""
    if isinstance(meta.get("test"), str) and meta["test"]:  # an env that runs tests may name the test that hung
        return f"{who}{after} in {meta['test']}. Look for an endless loop."
    return f"{who}{after}. Make the call faster or simpler."


def default_hints(reason_hints: Mapping[str, str] | None = None) -> HintRegistry:
    """The default hints for ``tool_not_found``, ``invalid_args``, ``execution_error`` and ``timeout`` (read-only).

    Args:
        reason_hints: the env's ``{reason: template}`` for ``execution_error`` metadata that carries a ``reason``
            (`composer_diloco.rollout.env_package.EnvPackage.reason_hints`); None or empty = the generic hint only.
    """
    reasons = MappingProxyType(dict(reason_hints or {}))
    return HintRegistry(
        {
            "tool_not_found": _tool_not_found,
            "invalid_args": _invalid_args,
            "execution_error": functools.partial(_execution_error, reasons=reasons) if reasons else _execution_error,
            "timeout": _timeout,
        },
        read_only=True,
    )


DEFAULT_HINTS = default_hints()
"""Default hints for ``tool_not_found``, ``invalid_args``, ``execution_error`` and ``timeout`` (read-only), without
env reason hints."""


# ---------------------------------------------------------------------------------------------------------------
# A successful peer attempt in the teacher's hint (``[loss] sdpo_peer_demo_reward``).


def peer_demo_text(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """A successful attempt's calls as one sentence: ``A successful attempt called: lookup {"item": "fig"}; add
    {"a": 3, "b": 4}; submit {"answer": 7}.`` (arguments as compact JSON, sorted keys).

    SDPO reprompts its teacher with a successful rollout of the same task (Hübotter et al., arXiv 2601.20802): the
    teacher then knows what the student does not, the calls that worked.

    Args:
        calls: ``(tool name, arguments)`` of the attempt's successful calls, in order (at least one).
    Raises:
        ValueError: no call.
    """
    if not calls:
        raise ValueError("peer_demo_text: a successful attempt has at least one call")
    return "A successful attempt called: " + "; ".join(
        f"{name} {json.dumps(dict(args), sort_keys=True, separators=(', ', ': '))}" for name, args in calls) + "."


def teacher_hint(error_hint: str | None, demo: Sequence[tuple[str, Mapping[str, Any]]] | None) -> str | None:
    """The hint message SDPO's teacher sees at an error site: the peer demonstration (:func:`peer_demo_text`) when
    there is one, then the error's hint; None when there is neither. The warm start's hinted demonstrations
    (`composer_diloco.policy.warmstart.demonstration_messages`) use this same text."""
    parts = [peer_demo_text(demo)] if demo else []
    if error_hint:
        parts.append(error_hint)
    return " ".join(parts) or None
