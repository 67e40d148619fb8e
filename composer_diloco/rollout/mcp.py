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
  DPO is on). Either the run takes its tasks from a dataset (``[tasks]``: the kwargs hold the row's columns, TRL's
  ``reset(**row)``; `composer_diloco.rollout.tasks`), or the env owns its tasks and puts the task text in the reset
  observation: ``metadata["question"]`` (or ``"prompt"``, ``"task"``,
  ``"instruction"``; a string, or a list of chat messages whose user contents are joined), or an observation field of
  one of those names. The kwargs also hold ``max_tool_calls`` (OpenEnv drops it unless ``reset`` accepts it).
- ``/mcp`` ``tools/list`` lists at least one tool (listed once, when the session opens, with OpenEnv's
  ``MCPToolClient.list_tools()``).
- A ``CallToolAction``'s observation carries ``reward`` (None counts as 0.0) and ``done``: the episode ends at the
  first ``done``, with that observation's reward as the episode's reward (e.g. 1.0 at a correct final ``submit``).
  The node also ends an episode after ``max_tool_calls`` calls, with reward 0.
- Tool failures come back as ``CallToolObservation.error`` (a typed ``ToolError``), mapped to this project's hint
  kinds by `TOOL_ERROR_KINDS`. Note that OpenEnv 0.10.0's ``MCPEnvironment`` answers on the WebSocket with
  ``step_async``: a server that computes its reward in an override of ``step`` alone never sends it.

`detect_env_protocol` decides each URL's protocol once, from what the server says it is, never from how a probe fails
(a ``ListToolsAction`` sent to an app created with a *subclass* of ``CallToolAction`` fails with ``VALIDATION_ERROR``
although the app is an MCP tool server):

1. ``GET /schema`` (every OpenEnv app serves its action and observation JSON schemas): an action with ``tool`` and
   ``arguments`` fields and observations with `TYPED_OBSERVATION_FIELDS` is an env of the typed tool-call protocol of
   `composer_diloco.rollout.env_package` (this project's own envs), played by
   `composer_diloco.rollout.episodes.OpenEnvSession`;
2. else ``POST /mcp`` JSON-RPC ``tools/list`` (OpenEnv's MCP endpoint, whatever the action class): a tool list makes it
   an MCP tool server, played by `McpEnvSession`.

Failure behaviour (each error is one line naming the URL, what the server answered and what the node expected):

- nothing answers: `EnvServerError` (``env server at URL not reachable: ...``);
- neither protocol (e.g. a typed env with its own action, ``{"code": ...}``): `UnsupportedEnvServer`, naming the
  action's and the observation's fields and the ``/mcp`` answer;
- an MCP server listing zero tools: `McpProtocolError`;
- a reset without task text (when no ``[tasks]`` dataset gives the tasks): `McpProtocolError`.

`composer_diloco.rollout.sessions.open_env_sessions` opens a node's sessions with these (session capacity, the
check reset, tasks from a dataset). A node thus never plays an episode that cannot carry a learning signal (no
question, or no tool to call).
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from composer_diloco.rollout.chat import task_text
from composer_diloco.rollout.env_process import EnvServerError
from composer_diloco.rollout.episodes import EnvSession

__all__ = [
    "QUESTION_KEYS",
    "TOOL_ERROR_KINDS",
    "TYPED_ACTION_FIELDS",
    "TYPED_OBSERVATION_FIELDS",
    "EnvServerInfo",
    "McpEnvSession",
    "McpProtocolError",
    "NotAnMcpServer",
    "UnsupportedEnvServer",
    "detect_env_protocol",
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
"""OpenEnv ``ToolErrorType`` value -> this project's error kind (the `composer_diloco.channels.hints` key). The four kinds
of the hints are OpenEnv's own names; a ``transport_error`` (the server could not reach its tool) is shown to the
policy as an ``execution_error``. Unknown types also become ``execution_error``."""

QUESTION_KEYS: tuple[str, ...] = ("question", "prompt", "task", "instruction")
"""Where the task text of a reset observation is looked for, in order (observation fields, then its metadata)."""

_TIMEOUT_S = re.compile(r"after ([0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?) s(?:econds)?\b")


TYPED_ACTION_FIELDS: tuple[str, ...] = ("tool", "arguments")
"""The action fields (``GET /schema``'s ``action``) of an env of the typed tool-call protocol."""

TYPED_OBSERVATION_FIELDS: tuple[str, ...] = ("question", "tools", "content", "error_kind", "error_meta")
"""The observation fields (``GET /schema``'s ``observation`` and ``reset_observation`` together) of such an env."""

_HTTP_TIMEOUT_S = 10.0


class NotAnMcpServer(RuntimeError):
    """A session was asked to play a server as MCP, and its ``/mcp`` endpoint does not list tools."""


class UnsupportedEnvServer(RuntimeError):
    """The server is neither an OpenEnv MCP tool server nor an env of the typed tool-call protocol (one line: the URL,
    what it answered, what the node expected)."""


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
    format ``tokenizer.apply_chat_template(tools=...)`` renders and `composer_diloco.channels.hints` reads.

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
            text = task_text(value)
            if text.strip():
                return text
    raise McpProtocolError(
        f"the reset observation of {url} holds no task text: expected a non-empty string (or a list of chat "
        f"messages) under one of {list(QUESTION_KEYS)} in its metadata or fields; got fields {sorted(extra)} and "
        f"metadata keys {sorted(metadata)}"
    )


class McpEnvSession(EnvSession):
    """One episode at a time against an OpenEnv MCP tool server (see the module docstring for the protocol).

    Opening the session connects OpenEnv's ``MCPToolClient`` (sync) and lists the tools with its ``list_tools()``
    (JSON-RPC ``tools/list`` on ``/mcp``, in this session): unlike a ``ListToolsAction`` step, that works for an app
    created with a subclass of ``CallToolAction``.

    Args:
        url: the server's base URL, ``http(s)://host:port`` or ``ws(s)://...`` (the client adds ``/ws``).
        max_tool_calls: the node's call budget per episode, passed to the server's ``reset`` as a keyword (the node
            itself stops an episode after that many assistant turns).
        reset_kwargs: more keywords for every ``reset`` (``[env] reset_kwargs``).
        connect_timeout_s: seconds for the WebSocket connection.
        message_timeout_s: seconds to wait for any one answer (a tool call included).

    Raises:
        NotAnMcpServer: the server's ``/mcp`` lists no tools and answers an error instead (e.g. one of this
            project's typed environments: ``Environment does not support MCP``).
        McpProtocolError: the server lists zero tools.
        EnvServerError: the server cannot be reached.

    Attributes:
        url: the server URL.
        tools: the tool schemas in OpenAI function format (`tool_schema`), as the prompt renders them.
        tool_names: the tool names, in the server's order.
    """

    def __init__(self, url: str, *, max_tool_calls: int, reset_kwargs: Mapping[str, Any] | None = None,
                 connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0):
        from composer_diloco.rollout.openenv_import import import_openenv_core

        import_openenv_core()
        from openenv.core.env_server.mcp_types import CallToolAction
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
        try:  # over /mcp with this session's id: works whatever the app's action class (see the module docstring)
            tools = self._client.list_tools(use_cache=False)
        except Exception:
            self.close()
            raise
        if not tools:  # OpenEnv's list_tools() answers [] for errors too: ask /mcp once more, for the reason
            self.close()
            listed, problem = _mcp_tools_list(_http_base(url), connect_timeout_s)
            if listed is None:
                raise NotAnMcpServer(f"env server at {url} is not an OpenEnv MCP tool server: /mcp tools/list "
                                     f"answered {problem}")
            raise McpProtocolError(f"the MCP server at {url} lists no tools (/mcp tools/list answered an empty "
                                   f"list): expected at least one tool")
        self._schemas = {t.name: dict(t.input_schema or {}) for t in tools}
        self.tools = [tool_schema(t) for t in tools]
        self.tool_names = [t.name for t in tools]

    def reset(self, seed: int, episode_id: str) -> tuple[str, list[dict]]:
        """Start episode ``(seed, episode_id)``; return (the task text, the tool schemas).

        Raises:
            McpProtocolError: the reset observation holds no task text (`QUESTION_KEYS`).
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client when the server's reset raised.
        """
        result = self._client.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls,
                                    **self.reset_kwargs)
        return _question(result.observation, self.url), [dict(t) for t in self.tools]

    def start(self, seed: int, episode_id: str, task_kwargs: Mapping[str, Any]) -> tuple[str, list[dict]]:
        """Start episode ``(seed, episode_id)`` of a dataset task (`composer_diloco.rollout.tasks.TaskEnvSession`):
        reset with ``task_kwargs`` (a row's columns) over the run's ``reset_kwargs``; return (the observation's task
        text, ``""`` when it has none, and the tool schemas).

        Raises:
            RuntimeError: ``"Server error: ..."`` from OpenEnv's client when the server's reset raised.
        """
        result = self._client.reset(seed=seed, episode_id=episode_id, max_tool_calls=self.max_tool_calls,
                                    **{**self.reset_kwargs, **task_kwargs})
        try:
            text = _question(result.observation, self.url)
        except McpProtocolError:  # the task is the row's: a reset without task text is what such an env does
            text = ""
        return text, [dict(t) for t in self.tools]

    def call(self, tool: str, arguments: dict) -> tuple[str, str | None, dict, float, bool]:
        """Run one tool call with ``CallToolAction``; return (content, error_kind, error_meta, reward, done).

        ``content`` is `tool_result_text` of the result, or ``"error: <message>"`` when the call failed (the message on
        one line, see `_compact`). ``error_kind`` is `tool_error_kind` of the ``ToolError``'s type, or
        ``"execution_error"`` for a result flagged ``is_error``; None on success. ``error_meta`` holds ``tool``,
        ``message`` and ``error_type`` (OpenEnv's), plus ``available_tools`` (tool_not_found), ``expected_schema``
        (invalid_args, the tool's ``input_schema``) or ``timeout_s`` (timeout, when the message names it): the fields
        `composer_diloco.channels.hints` fills its hints from. ``reward`` is the observation's reward (None -> 0.0).

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


@dataclass(frozen=True)
class EnvServerInfo:
    """What `detect_env_protocol` found at a URL.

    Attributes:
        url: the server's base URL.
        protocol: ``"mcp"`` (OpenEnv's MCP tool protocol) or ``"openenv"`` (the typed tool-call protocol).
        tool_names: the tools an MCP server lists (a typed env lists its tools at reset: empty).
        action_fields: the field names of the server's action schema (``GET /schema``).
    """

    url: str
    protocol: str
    tool_names: tuple[str, ...]
    action_fields: tuple[str, ...]


def _http_base(url: str) -> str:
    """``url`` without a trailing slash, ``ws(s)://`` read as ``http(s)://``."""
    base = url.rstrip("/")
    return "http" + base[2:] if base.startswith(("ws://", "wss://")) else base


def _fields(schema: Any) -> list[str]:
    """The property names of a JSON schema (``[]`` when it has none)."""
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    return list(props) if isinstance(props, Mapping) else []


def _http_json(url: str, body: Mapping[str, Any] | None, timeout_s: float) -> tuple[Any, str | None]:
    """GET (``body`` None) or POST JSON to ``url``; (the parsed JSON answer, None) or (None, why not, one line).

    Raises:
        EnvServerError: nothing answers at ``url`` (connection refused, timeout, DNS).
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        return None, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = str(getattr(e, "reason", e)).replace("\n", " ")
        raise EnvServerError(f"env server at {url.rsplit('/', 1)[0]} not reachable: {reason}") from e
    try:
        return json.loads(raw), None
    except ValueError:
        return None, f"not JSON ({raw[:60]!r})"


def _mcp_tools_list(url: str, timeout_s: float) -> tuple[list[dict] | None, str | None]:
    """OpenEnv's ``POST /mcp`` JSON-RPC ``tools/list``: (the tool payloads, None), or (None, why not, one line)."""
    answer, problem = _http_json(f"{url}/mcp", {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1},
                                 timeout_s)
    if problem is not None:
        return None, problem
    if isinstance(answer, Mapping) and isinstance(answer.get("result"), Mapping) \
            and isinstance(answer["result"].get("tools"), list):
        return [dict(t) for t in answer["result"]["tools"] if isinstance(t, Mapping)], None
    error = answer.get("error") if isinstance(answer, Mapping) else None
    if isinstance(error, Mapping):
        return None, f"error {_compact(str(error.get('message', error)))!r}"
    return None, f"{_compact(json.dumps(answer, default=str))[:120]}"


def detect_env_protocol(url: str, *, timeout_s: float = _HTTP_TIMEOUT_S) -> EnvServerInfo:
    """Which protocol the env server at ``url`` speaks, from what it says it is (see the module docstring).

    ``GET /schema`` first: an action with `TYPED_ACTION_FIELDS` and observations with `TYPED_OBSERVATION_FIELDS` make a
    typed env (no ``/mcp`` request, which builds a throwaway environment on the server). Otherwise ``POST /mcp``
    ``tools/list``: a non-empty tool list makes an MCP tool server, whatever its action class.

    Args:
        url: the server's base URL (``http(s)://host:port``; ``ws(s)://`` is read as ``http(s)://``).
        timeout_s: seconds for each of the (at most two) HTTP requests.

    Raises:
        EnvServerError: nothing answers at ``url``.
        McpProtocolError: an MCP tool server that lists zero tools.
        UnsupportedEnvServer: neither protocol; the one-line message names the URL, the action's and observation's
            fields, the ``/mcp`` answer, and what was expected.
    """
    base = _http_base(url)
    schema, schema_problem = _http_json(f"{base}/schema", None, timeout_s)
    action = _fields(schema.get("action")) if isinstance(schema, Mapping) else []
    observation = []
    if isinstance(schema, Mapping):
        for key in ("observation", "reset_observation"):
            observation += [f for f in _fields(schema.get(key)) if f not in observation]
    if all(f in action for f in TYPED_ACTION_FIELDS) and all(f in observation for f in TYPED_OBSERVATION_FIELDS):
        log.info("env server %s is a typed OpenEnv environment (tool/arguments actions)", url)
        return EnvServerInfo(url, "openenv", (), tuple(action))
    tools, mcp_problem = _mcp_tools_list(base, timeout_s)
    if tools is not None:
        if not tools:
            raise McpProtocolError(f"the MCP server at {url} lists no tools (/mcp tools/list answered an empty list): "
                                   f"expected at least one tool")
        names = tuple(str(t.get("name", "")) for t in tools)
        log.info("env server %s speaks OpenEnv's MCP tool protocol: tools %s", url, list(names))
        return EnvServerInfo(url, "mcp", names, tuple(action))
    if schema_problem is not None:
        said = f"GET /schema answered {schema_problem}"
    else:
        said = f"its action has fields {action}, its observations {observation}"
    raise UnsupportedEnvServer(
        f"env server at {url} speaks neither OpenEnv's MCP tool protocol (/mcp tools/list answered {mcp_problem}) "
        f"nor the typed tool-call protocol ({said}): expected an MCP tool server, or an action with fields "
        f"{list(TYPED_ACTION_FIELDS)} and observations with {list(TYPED_OBSERVATION_FIELDS)}")
