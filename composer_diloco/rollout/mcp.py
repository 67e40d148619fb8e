"""Env sessions for any OpenEnv MCP tool server, and the factory that picks the session type for a URL.

OpenEnv's MCP tool protocol (RFC 003; ``openenv.core.env_server.mcp_types``) maps MCP's ``tools/list`` and
``tools/call`` onto its Gym-style actions: ``ListToolsAction`` answers a ``ListToolsObservation`` (name,
description, JSON-schema ``input_schema`` per tool) and ``CallToolAction(tool_name, arguments)`` answers a
``CallToolObservation`` whose ``result`` is the tool's output and whose ``error`` is a typed ``ToolError``
(``ToolErrorType``: ``tool_not_found``, ``invalid_args``, ``execution_error``, ``timeout``, ``transport_error``).
Servers are usually an ``MCPEnvironment`` (a FastMCP server inside an OpenEnv ``Environment``) under
``create_app(Env, CallToolAction, CallToolObservation)``.

`McpEnvSession` plays such a server through OpenEnv's own client, ``openenv.core.mcp_client.MCPToolClient`` (its
sync wrapper): one server-side session per `McpEnvSession`, reset and every action over the WebSocket ``/ws``, so
that the observations carry the reward and the done flag.

What the node expects from an MCP server (OpenEnv's conventions; ``tests/mcp_env_server.py`` is a complete example):

- ``reset(seed, episode_id, **kwargs)`` starts the episode ``(seed, episode_id)`` (deterministically, if trace-replay
  DPO is on) and puts the task text in the reset observation: ``metadata["question"]`` (or ``"prompt"``, ``"task"``,
  ``"instruction"``; a string, or a list of chat messages whose user contents are joined), or an observation field of
  one of those names. The kwargs also hold ``max_tool_calls`` (OpenEnv drops it unless ``reset`` accepts it).
- ``ListToolsAction`` lists at least one tool (listed once, when the session opens).
- A ``CallToolAction``'s observation carries ``reward`` (None counts as 0.0) and ``done``: the episode ends at the
  first ``done``, with that observation's reward as the episode's reward (e.g. 1.0 at a correct final ``submit``).
  The node also ends an episode after ``max_tool_calls`` calls, with reward 0.
- Tool failures come back as ``CallToolObservation.error`` (a typed ``ToolError``), mapped to this project's hint
  kinds by `TOOL_ERROR_KINDS`. Note that OpenEnv 0.10.0's ``MCPEnvironment`` answers on the WebSocket with
  ``step_async``: a server that computes its reward in an override of ``step`` alone never sends it.

`open_env_sessions` is what ``composer-node join`` uses: it detects each URL's protocol once, by sending
``ListToolsAction`` (an MCP server answers with its tools; an env speaking the typed tool-call protocol of
`composer_diloco.rollout.env_package`, such as this project's own, refuses the action as an invalid message) and opens
`McpEnvSession` or `composer_diloco.rollout.episodes.OpenEnvSession` accordingly.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from composer_diloco.rollout.env_process import EnvServerError
from composer_diloco.rollout.episodes import EnvSession, OpenEnvSession

__all__ = [
    "QUESTION_KEYS",
    "TOOL_ERROR_KINDS",
    "McpEnvSession",
    "McpProtocolError",
    "NotAnMcpServer",
    "open_env_session",
    "open_env_sessions",
    "tool_error_kind",
    "tool_result_text",
    "tool_schema",
]

log = logging.getLogger(__name__)

TOOL_ERROR_KINDS: Mapping[str, str] = MappingProxyType({
    "tool_not_found": "tool_not_found",
    "invalid_args": "invalid_args",
    "execution_error": "execution_error",
    "timeout": "timeout",
    "transport_error": "execution_error",
})
"""OpenEnv ``ToolErrorType`` value -> this project's error kind (the `composer_diloco.channels.sdpo_hints` key). The four kinds
of the hints are OpenEnv's own names; a ``transport_error`` (the server could not reach its tool) is shown to the
policy as an ``execution_error``. Unknown types also become ``execution_error``."""

QUESTION_KEYS: tuple[str, ...] = ("question", "prompt", "task", "instruction")
"""Where the task text of a reset observation is looked for, in order (observation fields, then its metadata)."""

_TIMEOUT_S = re.compile(r"after ([0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?) s(?:econds)?\b")


class NotAnMcpServer(RuntimeError):
    """The server refused ``ListToolsAction``: it does not speak OpenEnv's MCP tool protocol."""


class McpProtocolError(RuntimeError):
    """An MCP server answered, but not as the node expects (no tools, no question on reset); the message says what."""


def tool_error_kind(error_type: Any) -> str:
    """This project's error kind for an OpenEnv ``ToolErrorType`` (or its string value), by `TOOL_ERROR_KINDS`.

    Example:
        >>> from openenv.core.env_server.mcp_types import ToolErrorType
        >>> tool_error_kind(ToolErrorType.TIMEOUT), tool_error_kind("transport_error")
        ('timeout', 'execution_error')
    """
    value = getattr(error_type, "value", error_type)
    return TOOL_ERROR_KINDS.get(str(value), "execution_error")


_KEY_ORDER = ("type", "description", "properties", "required")


def _canonical(schema: Any) -> Any:
    """A JSON schema with its keys in the order OpenAI function schemas are written (type, description, properties,
    required, then the rest as given), recursively; ``title`` and ``additionalProperties: false`` are dropped."""
    if isinstance(schema, list):
        return [_canonical(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    kept = {k: v for k, v in schema.items() if k != "title" and not (k == "additionalProperties" and v is False)}
    ordered = [k for k in _KEY_ORDER if k in kept] + [k for k in kept if k not in _KEY_ORDER]
    out = {k: _canonical(kept[k]) for k in ordered if k != "properties"}
    if isinstance(kept.get("properties"), Mapping):  # names -> schemas: keep every name, in the server's order
        out["properties"] = {name: _canonical(p) for name, p in kept["properties"].items()}
    return {k: out.get(k, kept.get(k)) for k in ordered}


def tool_schema(tool: Any) -> dict[str, Any]:
    """An MCP tool (OpenEnv's ``Tool``: ``name``, ``description``, ``input_schema``) in OpenAI function format, the
    format ``tokenizer.apply_chat_template(tools=...)`` renders and `composer_diloco.channels.sdpo_hints` reads.

    The input schema is put in canonical key order (`_canonical`: type, description, properties, required, then the
    rest), without pydantic's ``title``s and FastMCP's ``additionalProperties: false`` (the server enforces it), so
    that a tool renders the same prompt tokens whether a typed env or an MCP server lists it: a chat template
    serialises the schema with ``tojson``, key order included, and pydantic writes ``description`` before ``type``.
    A missing or empty ``input_schema`` becomes ``{"type": "object", "properties": {}}`` (a tool without arguments).
    """
    params = _canonical(dict(getattr(tool, "input_schema", None) or {})) or {"type": "object", "properties": {}}
    description = getattr(tool, "description", "") or ""
    return {"type": "function", "function": {"name": tool.name, "description": description, "parameters": params}}


def _text(value: Any) -> str:
    """A JSON value as tool-reply text: strings as they are, anything else as compact JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def tool_result_text(result: Any) -> str:
    """The text the policy sees for a tool's ``result`` (the ``CallToolObservation.result`` JSON value).

    A FastMCP ``CallToolResult`` (``{"content": [{"type": "text", "text": ...}, ...], "data": ..., ...}``) gives its
    text contents joined by newlines (a non-text content item as its JSON); other dicts with ``data`` give that;
    strings are kept; any other value is its compact JSON (``7``, ``[1, 2]``, ``{"a": 1}``); None is ``""``.
    """
    if isinstance(result, Mapping):
        content = result.get("content")
        if isinstance(content, list) and content:
            parts = []
            for item in content:
                if isinstance(item, Mapping) and item.get("type") == "text":
                    parts.append(str(item.get("text", "")))
                else:
                    parts.append(_text(item))
            return "\n".join(parts)
        if "data" in result:
            return _text(result["data"])
    return _text(result)


def _compact(message: str) -> str:
    """One line: the lines of ``message`` joined by spaces, without pydantic's ``For further information`` links."""
    lines = [ln.strip() for ln in str(message).splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("For further information visit"))


def _question(observation: Any, url: str) -> str:
    """The task text of a reset observation (see `QUESTION_KEYS`); raises `McpProtocolError` when there is none."""
    extra = dict(getattr(observation, "model_extra", None) or {})
    metadata = dict(getattr(observation, "metadata", None) or {})
    for source in (extra, metadata):
        for key in QUESTION_KEYS:
            value = source.get(key)
            if isinstance(value, str) and value.strip():
                return value
            if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
                users = [m for m in value if m.get("role") == "user"] or list(value)
                text = "\n\n".join(str(m.get("content", "")) for m in users if m.get("content"))
                if text:
                    return text
    raise McpProtocolError(
        f"the reset observation of {url} holds no task text: expected a non-empty string (or a list of chat "
        f"messages) under one of {list(QUESTION_KEYS)} in its metadata or fields; got fields {sorted(extra)} and "
        f"metadata keys {sorted(metadata)}"
    )


class McpEnvSession(EnvSession):
    """One episode at a time against an OpenEnv MCP tool server (see the module docstring for the protocol).

    Opening the session connects OpenEnv's ``MCPToolClient`` (sync) and lists the tools with ``ListToolsAction``.

    Args:
        url: the server's base URL, ``http(s)://host:port`` or ``ws(s)://...`` (the client adds ``/ws``).
        max_tool_calls: the node's call budget per episode, passed to the server's ``reset`` as a keyword (the node
            itself stops an episode after that many assistant turns).
        reset_kwargs: more keywords for every ``reset`` (``[env] reset_kwargs``).
        connect_timeout_s: seconds for the WebSocket connection.
        message_timeout_s: seconds to wait for any one answer (a tool call included).

    Raises:
        NotAnMcpServer: the server refused ``ListToolsAction`` (e.g. one of this project's typed environments).
        McpProtocolError: the server lists no tools.
        EnvServerError: the server cannot be reached.

    Attributes:
        url: the server URL.
        tools: the tool schemas in OpenAI function format (`tool_schema`), as the prompt renders them.
        tool_names: the tool names, in the server's order.
    """

    def __init__(self, url: str, *, max_tool_calls: int, reset_kwargs: Mapping[str, Any] | None = None,
                 connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0):
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction, ListToolsObservation
        from openenv.core.mcp_client import MCPToolClient

        self._call_action = CallToolAction
        self.url, self.max_tool_calls = url, max_tool_calls
        self.reset_kwargs = dict(reset_kwargs or {})
        self._client = MCPToolClient(base_url=url, connect_timeout_s=connect_timeout_s,
                                     message_timeout_s=message_timeout_s).sync()
        try:
            self._client.connect()
        except Exception as e:
            self.close()
            raise EnvServerError(f"env server at {url} not reachable: {e}") from e
        try:
            listed = self._client.step(ListToolsAction())
        except RuntimeError as e:  # the server's error frame: it cannot parse the action
            self.close()
            raise NotAnMcpServer(f"{url} refused ListToolsAction: {e}") from e
        except Exception:
            self.close()
            raise
        obs = listed.observation
        if not isinstance(obs, ListToolsObservation):
            self.close()
            raise NotAnMcpServer(f"{url} answered ListToolsAction with a {type(obs).__name__}")
        if not obs.tools:
            self.close()
            why = (obs.metadata or {}).get("error")
            raise McpProtocolError(f"the MCP server at {url} lists no tools" + (f" ({why})" if why else ""))
        self._schemas = {t.name: dict(t.input_schema or {}) for t in obs.tools}
        self.tools = [tool_schema(t) for t in obs.tools]
        self.tool_names = [t.name for t in obs.tools]

    def reset(self, seed: int, episode_id: str) -> tuple[str, list[dict]]:
        """Start episode ``(seed, episode_id)``; return (the task text, the tool schemas).

        Raises:
            McpProtocolError: the reset observation holds no task text (`QUESTION_KEYS`).
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client when the server's reset raised.
        """
        result = self._client.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls,
                                    **self.reset_kwargs)
        return _question(result.observation, self.url), [dict(t) for t in self.tools]

    def call(self, tool: str, arguments: dict) -> tuple[str, str | None, dict, float, bool]:
        """Run one tool call with ``CallToolAction``; return (content, error_kind, error_meta, reward, done).

        ``content`` is `tool_result_text` of the result, or ``"error: <message>"`` when the call failed (the message on
        one line, see `_compact`). ``error_kind`` is `tool_error_kind` of the ``ToolError``'s type, or
        ``"execution_error"`` for a result flagged ``is_error``; None on success. ``error_meta`` holds ``tool``,
        ``message`` and ``error_type`` (OpenEnv's), plus ``available_tools`` (tool_not_found), ``expected_schema``
        (invalid_args, the tool's ``input_schema``) or ``timeout_s`` (timeout, when the message names it): the fields
        `composer_diloco.channels.sdpo_hints` fills its hints from. ``reward`` is the observation's reward (None -> 0.0).

        Raises:
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client when the server's step raised.
        """
        result = self._client.step(self._call_action(tool_name=tool, arguments=dict(arguments)))
        obs = result.observation
        reward, done = float(result.reward or 0.0), bool(result.done)
        error = getattr(obs, "error", None)
        if error is not None:
            raw = str(getattr(error.error_type, "value", error.error_type))
            return self._failure(tool, tool_error_kind(raw), raw, error.message, reward, done)
        if hasattr(obs, "result"):
            payload = obs.result
        else:  # a server that answers a call with a plain Observation: its metadata carries the outcome
            metadata = dict(getattr(obs, "metadata", None) or {})
            if isinstance(metadata.get("error"), str) and metadata["error"]:
                return self._failure(tool, "execution_error", "execution_error", metadata["error"], reward, done)
            payload = metadata.get("tool_result", metadata.get("result"))
        text = tool_result_text(payload)
        if isinstance(payload, Mapping) and (payload.get("is_error") or payload.get("isError")):
            return self._failure(tool, "execution_error", "execution_error", text, reward, done)
        return text, None, {}, reward, done

    def _failure(self, tool: str, kind: str, raw: str, message: str, reward: float,
                 done: bool) -> tuple[str, str, dict, float, bool]:
        """The ``call`` tuple of a failed call, with the hint metadata of its kind."""
        message = _compact(message)
        meta: dict[str, Any] = {"tool": tool, "message": message, "error_type": raw}
        if kind == "tool_not_found":
            meta["available_tools"] = list(self.tool_names)
        elif kind == "invalid_args" and tool in self._schemas:
            meta["expected_schema"] = dict(self._schemas[tool])
        elif kind == "timeout":
            seconds = _TIMEOUT_S.search(message)
            if seconds:
                meta["timeout_s"] = float(seconds.group(1))
        return f"error: {message}", kind, meta, reward, done

    def close(self) -> None:
        """Close the WebSocket and the server-side session (idempotent; never raises)."""
        try:
            self._client.close()
        except Exception as e:  # closing a dead connection
            log.debug("closing MCP env session %s: %r", self.url, e)


def open_env_session(url: str, *, max_tool_calls: int, protocol: str | None = None,
                     reset_kwargs: Mapping[str, Any] | None = None) -> EnvSession:
    """One env session for ``url``: `McpEnvSession` for an OpenEnv MCP server, else `OpenEnvSession`.

    Args:
        url: the env server's base URL.
        max_tool_calls: the call budget per episode.
        protocol: ``"mcp"`` or ``"openenv"`` when already known (no probe); None detects it by sending
            ``ListToolsAction`` (see the module docstring).
        reset_kwargs: more keywords for every episode's ``reset`` (``[env] reset_kwargs``).

    Raises:
        ValueError: an unknown ``protocol``.
        McpProtocolError, EnvServerError: from `McpEnvSession`; errors of `OpenEnvSession` propagate.
    """
    if protocol not in (None, "mcp", "openenv"):
        raise ValueError(f"protocol must be 'mcp', 'openenv' or None, got {protocol!r}")
    if protocol != "openenv":
        try:
            return McpEnvSession(url, max_tool_calls=max_tool_calls, reset_kwargs=reset_kwargs)
        except NotAnMcpServer:
            if protocol == "mcp":
                raise
    return OpenEnvSession(url, max_tool_calls=max_tool_calls, reset_kwargs=reset_kwargs)


def open_env_sessions(urls: Sequence[str], count: int, *, max_tool_calls: int,
                      reset_kwargs: Mapping[str, Any] | None = None) -> list[EnvSession]:
    """``count`` env sessions over ``urls`` round-robin (session i on ``urls[i % len(urls)]``).

    Each URL's protocol is detected once, with its first session (`open_env_session`), and logged. On an error the
    sessions opened so far are closed before it propagates.

    Raises:
        ValueError: no URLs, or ``count < 1``.
        McpProtocolError, EnvServerError, ...: as `open_env_session`.
    """
    if not urls or count < 1:
        raise ValueError(f"need at least one URL and one session, got {len(urls)} URL(s) and count {count}")
    protocols: dict[str, str] = {}
    sessions: list[EnvSession] = []
    try:
        for i in range(count):
            url = urls[i % len(urls)]
            session = open_env_session(url, max_tool_calls=max_tool_calls, protocol=protocols.get(url),
                                       reset_kwargs=reset_kwargs)
            if url not in protocols:
                protocols[url] = "mcp" if isinstance(session, McpEnvSession) else "openenv"
                if isinstance(session, McpEnvSession):
                    log.info("env server %s speaks OpenEnv's MCP tool protocol: tools %s", url, session.tool_names)
                else:
                    log.info("env server %s is a typed OpenEnv environment (tool/arguments actions)", url)
            sessions.append(session)
    except BaseException:
        for s in sessions:
            s.close()
        raise
    return sessions
