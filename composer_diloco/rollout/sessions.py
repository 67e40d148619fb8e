"""A node's env sessions: how many it opens on each server, of which protocol, checked by one reset.

An OpenEnv server holds at most ``MAX_CONCURRENT_ENVS`` WebSocket sessions (OpenEnv's ``max_concurrent_envs``:
1 in ``openenv init``'s template, 4 to 8 in many official envs); one more is refused with ``Server at capacity: n/n
sessions active`` (``CAPACITY_REACHED``). OpenEnv has no endpoint that tells the capacity, so a node learns it the
way a client meets it: `open_env_sessions` opens sessions on each URL, round-robin, until it has one per episode of an
inner step, the per-URL cap (``--env-sessions`` / ``[env] sessions_per_url``) is reached, or the server refuses one.
A server that refuses the first session is an error (`EnvCapacityError`, with the fix); a server that holds fewer
sessions than a step has episodes is logged, and `composer_diloco.rollout.play.play_episodes` plays the step's
episodes in waves of the sessions it has (the rest wait).

Each URL's protocol is decided once (`composer_diloco.rollout.mcp.detect_env_protocol`), and the first session of each
URL resets once before any episode (``check_reset``), so an env that gives no task text or no tools fails at join.
With a `composer_diloco.rollout.tasks.TaskSet` every session is a `composer_diloco.rollout.tasks.TaskEnvSession`:
the check reset uses the node's first task row, and the reset's own task text is no longer required.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from composer_diloco.rollout.env_process import EnvServerError
from composer_diloco.rollout.episodes import EnvProtocolError, EnvSession, OpenEnvSession
from composer_diloco.rollout.mcp import McpEnvSession, McpProtocolError, _compact, detect_env_protocol
from composer_diloco.rollout.tasks import TaskEnvSession, TaskSet, task_episode_id

__all__ = ["CHECK_EPISODE_ID", "EnvCapacityError", "capacity_of", "open_env_session", "open_env_sessions"]

log = logging.getLogger(__name__)

CHECK_EPISODE_ID = "composer-env-check"
"""The ``episode_id`` base of the one reset `open_env_sessions` makes per URL before any episode (``check_reset``)."""

_CAPACITY = re.compile(r"Server at capacity: (\d+)/(\d+)")


class EnvCapacityError(EnvServerError):
    """An env server refused a session because it is at capacity (OpenEnv's ``Server at capacity: n/n``); the message
    names the URL, the capacity, the sessions the node wanted and the fix."""


def capacity_of(error: BaseException) -> tuple[int, int] | None:
    """``(active, max)`` sessions of an OpenEnv ``Server at capacity: active/max`` error anywhere in ``error``'s text
    or its causes, else None."""
    seen: BaseException | None = error
    while seen is not None:
        found = _CAPACITY.search(str(seen))
        if found:
            return int(found.group(1)), int(found.group(2))
        seen = seen.__cause__ or seen.__context__
    return None


def open_env_session(url: str, *, max_tool_calls: int, protocol: str | None = None,
                     reset_kwargs: Mapping[str, Any] | None = None) -> EnvSession:
    """One env session for ``url``: `McpEnvSession` for an OpenEnv MCP server, `OpenEnvSession` for a typed env. A
    typed session is probed once (`OpenEnvSession.probe`), so that a refused session fails here, as an MCP one does.

    Args:
        url: the env server's base URL.
        max_tool_calls: the call budget per episode.
        protocol: ``"mcp"`` or ``"openenv"`` when already known; None detects it (`detect_env_protocol`).
        reset_kwargs: more keywords for every episode's ``reset`` (``[env] reset_kwargs``).

    Raises:
        ValueError: an unknown ``protocol``.
        EnvCapacityError: the server is at capacity (no ``wanted`` count known here: the message gives the capacity).
        UnsupportedEnvServer, McpProtocolError, EnvServerError: from `detect_env_protocol` and `McpEnvSession`;
        errors of `OpenEnvSession` propagate.
    """
    if protocol not in (None, "mcp", "openenv"):
        raise ValueError(f"protocol must be 'mcp', 'openenv' or None, got {protocol!r}")
    if protocol is None:
        protocol = detect_env_protocol(url).protocol
    session: EnvSession | None = None
    try:
        if protocol == "mcp":
            return McpEnvSession(url, max_tool_calls=max_tool_calls, reset_kwargs=reset_kwargs)
        session = OpenEnvSession(url, max_tool_calls=max_tool_calls, reset_kwargs=reset_kwargs)
        session.probe()
        return session
    except Exception as e:
        if session is not None:
            session.close()
        full = capacity_of(e)
        if full is None:
            raise
        raise EnvCapacityError(f"env server at {url} is at capacity ({full[0]}/{full[1]} sessions active)") from e


def _capacity_message(url: str, opened: int, wanted: int, error: EnvCapacityError) -> str:
    full = capacity_of(error)
    held = f"{full[0]}/{full[1]} sessions active" if full else "at capacity"
    return (f"env server at {url} refused this node's first session (Server at capacity: {held}); the node plays up "
            f"to {wanted} episodes at once and holds {opened} session(s): start the server with MAX_CONCURRENT_ENVS >= "
            f"{wanted} (OpenEnv's max_concurrent_envs) or pass more --env-url (--env-sessions N plays at most N "
            f"episodes at once per URL)")


def open_env_sessions(urls: Sequence[str], count: int, *, max_tool_calls: int,
                      reset_kwargs: Mapping[str, Any] | None = None,
                      protocols: Mapping[str, str] | None = None, check_reset: bool = True,
                      per_url: int | None = None, tasks: TaskSet | None = None,
                      check_row: int = 0) -> list[EnvSession]:
    """Up to ``count`` env sessions over ``urls`` round-robin, within each server's capacity (module docstring).

    Args:
        urls: env server base URLs.
        count: sessions wanted (a node: the episodes of one inner step).
        max_tool_calls: the call budget per episode.
        reset_kwargs: keywords of every episode's ``reset`` (``[env] reset_kwargs``).
        protocols: each URL's protocol when already detected (``"mcp"`` / ``"openenv"``); the others are detected.
        check_reset: reset the first session of each URL once (seed 0, `CHECK_EPISODE_ID`) before any episode.
        per_url: most sessions per URL (``--env-sessions``); None = no cap but the server's.
        tasks: a `composer_diloco.rollout.tasks.TaskSet`: wrap every session in a `TaskEnvSession`.
        check_row: the task row of the check reset (the node's first task).

    Returns:
        Between 1 and ``count`` sessions, in the round-robin order of ``urls`` (session ``i`` of a full set on
        ``urls[i % len(urls)]``).

    Raises:
        ValueError: no URLs, ``count < 1`` or ``per_url < 1``.
        EnvCapacityError: some URL refused its first session (every session opened so far is closed): one line with
            the fix.
        UnsupportedEnvServer, McpProtocolError, EnvServerError: as `open_env_session`.
        EnvProtocolError (typed env), McpProtocolError (MCP): the check reset gave no task text (without ``tasks``) or
            no tools.
        EnvServerError: the check reset raised on the server (e.g. a ``reset_kwargs`` key or task column it does not
            take).
    """
    if not urls or count < 1 or (per_url is not None and per_url < 1):
        raise ValueError(f"need at least one URL, one session and per_url >= 1, got {len(urls)} URL(s), count {count}, "
                         f"per_url {per_url}")
    known: dict[str, str] = dict(protocols or {})
    by_url: dict[str, list[EnvSession]] = {url: [] for url in urls}
    full: dict[str, bool] = {url: False for url in urls}
    total = 0
    try:
        while total < count and not all(full.values()):
            for url in urls:
                if total >= count:
                    break
                if full[url]:
                    continue
                if url not in known:
                    known[url] = detect_env_protocol(url).protocol
                try:
                    session = open_env_session(url, max_tool_calls=max_tool_calls, protocol=known[url],
                                               reset_kwargs=reset_kwargs)
                except EnvCapacityError as e:
                    if not by_url[url]:
                        raise EnvCapacityError(_capacity_message(url, total, count, e)) from e
                    full[url] = True
                    held = capacity_of(e)
                    log.warning("env server %s is at capacity (Server at capacity: %s sessions active) with %d of this "
                                "node's sessions: the node plays at most %d episodes at once there; start it with "
                                "MAX_CONCURRENT_ENVS >= %d to play all %d at once", url,
                                f"{held[0]}/{held[1]}" if held else "?", len(by_url[url]), len(by_url[url]), count,
                                count)
                    continue
                if tasks is not None:
                    session = TaskEnvSession(session, tasks)
                by_url[url].append(session)
                total += 1
                if per_url is not None and len(by_url[url]) >= per_url:
                    full[url] = True
                if check_reset and len(by_url[url]) == 1:
                    check_id = CHECK_EPISODE_ID if tasks is None else task_episode_id(CHECK_EPISODE_ID, check_row)
                    _check_reset(session, url, reset_kwargs, tasks, check_id, check_row)
    except BaseException:
        for opened in by_url.values():
            for s in opened:
                s.close()
        raise
    sessions = [v[k] for k in range(max(len(v) for v in by_url.values())) for v in by_url.values() if k < len(v)]
    if len(sessions) < count:
        log.warning("this node holds %d env session(s) for the %d episodes of an inner step (%s): it plays them in "
                    "waves of %d", len(sessions), count,
                    ", ".join(f"{url}: {len(v)}" for url, v in by_url.items()), len(sessions))
    return sessions


def _check_reset(session: EnvSession, url: str, reset_kwargs: Mapping[str, Any] | None, tasks: TaskSet | None,
                 episode_id: str, row: int) -> None:
    """The one reset of a URL before any episode; raises as `open_env_sessions` says."""
    try:
        session.reset(0, episode_id)  # raises on a reset without task text (no tasks) or without tools
    except (EnvProtocolError, McpProtocolError):
        raise
    except RuntimeError as e:  # OpenEnv's "Server error: ...": the env's reset raised
        what = f"reset_kwargs {dict(reset_kwargs or {})}"
        if tasks is not None:
            what += f" and the columns {sorted(tasks.task(row)[1])} of task row {row}"
        raise EnvServerError(f"env server at {url} failed a reset with {what}: {_compact(str(e))}") from e
