"""Tasks from a dataset: the ``[tasks]`` section, TRL's ``environment_factory`` convention over OpenEnv sessions.

Without ``[tasks]`` the env's reset gives each episode its task text (this project's envs, OpenEnv envs that own
their tasks). With it, as in TRL's OpenEnv integration, the task is the dataset row's: the episode's prompt is the
row's ``prompt_column``, and the env's ``reset`` gets the row's columns as keywords (``reset(**row)``, the columns of
``reset_columns``), so the env can score the episode, and supplies the tools and the reward. Any task text the
reset observation still carries is appended to the row's prompt, as TRL appends what ``reset`` returns.

An episode stays replayable from its row and seed: its ``episode_id`` names its row (`task_episode_id`,
``"<base>@row<N>"``), and `TaskEnvSession` resets the env with that row's columns every time the episode is played or
replayed (trace-replay DPO replays episodes by ``(seed, episode_id)``).

Nodes split the rows deterministically (`TaskSet.order`): with ``--task-shard K/N`` node K takes the positions
K, K+N, K+2N ... of one permutation of the rows seeded by the run's seed (a partition: no two shards share a row,
and ``composer-coordinator simulate`` gives its nodes 0/N ... N-1/N); without it a node walks its own permutation
seeded by the run's seed and its name (independent samplers: rows can repeat across nodes). Each pass over the
rows (an epoch) is a fresh permutation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_diloco.config import TasksConfig
from composer_diloco.rollout.chat import task_text
from composer_diloco.rollout.episodes import EnvSession
from composer_diloco.rollout.task_shard import TaskShard

__all__ = ["NODE_RESET_KEYS", "TaskEnvSession", "TaskSet", "TaskSetError", "TaskShard", "row_of", "task_episode_id"]

log = logging.getLogger(__name__)

NODE_RESET_KEYS = ("seed", "episode_id", "max_tool_calls")
"""Reset keywords the node sets per episode: a task column may not carry one of them."""

_ROW = re.compile(r"@row(\d+)$")
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class TaskSetError(ValueError):
    """The ``[tasks]`` dataset cannot be used (missing, unreadable, a missing column, an empty prompt); one line
    naming the path and the problem."""


def task_episode_id(base: str, row: int) -> str:
    """The episode id of an episode of dataset row ``row``: ``"<base>@row<row>"`` (`row_of` reads it back)."""
    return f"{base}@row{row}"


def row_of(episode_id: str) -> int | None:
    """The dataset row named by ``episode_id`` (`task_episode_id`), or None when it names none."""
    found = _ROW.search(episode_id)
    return int(found.group(1)) if found else None


def _load_rows(path: str, split: str) -> list[dict[str, Any]]:
    """The rows of ``path`` (a local data file, a ``save_to_disk`` folder or a ``datasets`` path / hub id).

    Raises:
        TaskSetError: the path cannot be loaded (one line with ``datasets``' reason).
    """
    import datasets

    datasets.disable_progress_bars()  # a node's log is one line per event, not a progress bar per file
    local = Path(path).expanduser()
    try:
        if local.is_file():
            builder = _FILE_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise TaskSetError(f"[tasks] path {path!r}: unknown file type {local.suffix!r}: expected one of "
                                   f"{sorted(_FILE_BUILDERS)}, a save_to_disk folder or a datasets hub id")
            data = datasets.load_dataset(builder, data_files=str(local), split="train")
        elif (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file():
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                data = data[split]
        else:
            data = datasets.load_dataset(path, split=split)
    except TaskSetError:
        raise
    except Exception as e:  # datasets raises many types: FileNotFoundError, DatasetNotFoundError, KeyError ...
        reason = " ".join(str(e).split())[:300]
        raise TaskSetError(f"[tasks] path {path!r} (split {split!r}) cannot be loaded: {type(e).__name__}: "
                           f"{reason}") from None
    return list(data)


@dataclass(frozen=True)
class TaskSet:
    """The rows of a ``[tasks]`` dataset, as the rollout reads them.

    Attributes:
        source: the ``path`` it was loaded from.
        prompts: each row's task text (`composer_diloco.rollout.chat.task_text` of its prompt column), never empty.
        reset_kwargs: each row's keywords for the env's ``reset`` (its ``reset_columns``).
        sha256: hex digest of the prompts and keywords (logged, so that the nodes of a run can compare task files).
    """

    source: str
    prompts: tuple[str, ...]
    reset_kwargs: tuple[Mapping[str, Any], ...]
    sha256: str

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], *, prompt_column: str = "prompt",
                  reset_columns: Sequence[str] | None = None, source: str = "<rows>") -> TaskSet:
        """A task set of in-memory rows (what `load` does after reading the dataset).

        Raises:
            TaskSetError: no rows, a missing column, an empty prompt, or a reset column named like a key the node
                sets itself (`NODE_RESET_KEYS`); the message names the source, the row and the column.
        """
        if not rows:
            raise TaskSetError(f"[tasks] {source!r} has no rows: expected at least one task")
        columns = list(rows[0])
        if prompt_column not in columns:
            raise TaskSetError(f"[tasks] {source!r} has no prompt column {prompt_column!r}: its columns are {columns} "
                               f"(set [tasks] prompt_column)")
        kwargs_columns = list(columns if reset_columns is None else reset_columns)
        missing = [c for c in kwargs_columns if c not in columns]
        if missing:
            raise TaskSetError(f"[tasks] {source!r}: reset_columns {missing} are not columns of the dataset "
                               f"(columns: {columns})")
        clash = [c for c in kwargs_columns if c in NODE_RESET_KEYS]
        if clash:
            raise TaskSetError(f"[tasks] {source!r}: column(s) {clash} would be passed to reset, but the node sets "
                               f"{list(NODE_RESET_KEYS)} itself: rename them or leave them out of reset_columns")
        prompts, kwargs = [], []
        for i, row in enumerate(rows):
            text = task_text(row.get(prompt_column))
            if not text.strip():
                raise TaskSetError(f"[tasks] {source!r} row {i}: the prompt column {prompt_column!r} is empty or not "
                                   f"text (got {row.get(prompt_column)!r:.80}): expected the task text")
            prompts.append(text)
            kwargs.append({c: row.get(c) for c in kwargs_columns})
        digest = hashlib.sha256(json.dumps([prompts, kwargs], sort_keys=True, default=str).encode()).hexdigest()
        return cls(source, tuple(prompts), tuple(kwargs), digest)

    @classmethod
    def load(cls, config: TasksConfig) -> TaskSet | None:
        """The task set of ``[tasks]``, or None when it names no ``path`` (the env's reset gives the tasks).

        Raises:
            TaskSetError: as `from_rows`, or the path cannot be loaded.
        """
        if config.path is None:
            return None
        rows = _load_rows(config.path, config.split)
        tasks = cls.from_rows(rows, prompt_column=config.prompt_column, reset_columns=config.reset_columns,
                              source=config.path)
        log.info("tasks: %d rows from %s (sha256 %s), reset(**row) gets %s", len(tasks), config.path,
                 tasks.sha256[:12], sorted(tasks.reset_kwargs[0]) or "no columns")
        return tasks

    def __len__(self) -> int:
        return len(self.prompts)

    def order(self, count: int, *, seed: int, shard: TaskShard | None = None, peer_name: str = "") -> list[int]:
        """The rows of a node's first ``count`` tasks (see the module docstring for the split).

        Args:
            count: how many tasks (rows, possibly repeating over epochs) to return.
            seed: the run's seed.
            shard: this node's shard, or None for a permutation of its own (seeded by ``peer_name``).
            peer_name: the node's name (used only without ``shard``).

        Raises:
            ValueError: the shard holds no row (more shards than rows).
        """
        n = len(self)
        if shard is not None and shard.index >= n:
            raise ValueError(f"task shard {shard} holds no row: the dataset has {n} rows")
        out: list[int] = []
        epoch = 0
        while len(out) < count:
            key = f"{seed}:{epoch}" if shard is not None else f"{seed}:{peer_name}:{epoch}"
            rows = list(range(n))
            random.Random(key).shuffle(rows)
            out += rows[shard.index::shard.count] if shard is not None else rows
            epoch += 1
        return out[:count]

    def task(self, row: int) -> tuple[str, dict[str, Any]]:
        """(prompt, reset keywords) of ``row``.

        Raises:
            TaskSetError: ``row`` is not a row of the set.
        """
        if not 0 <= row < len(self):
            raise TaskSetError(f"task row {row} is not in [tasks] {self.source!r} ({len(self)} rows): a node with "
                               "another task file replayed this episode?")
        return self.prompts[row], dict(self.reset_kwargs[row])


class TaskEnvSession(EnvSession):
    """An env session whose episodes take their task from a `TaskSet` row (TRL's ``reset(**row)``).

    ``reset(seed, episode_id)`` reads the row from ``episode_id`` (`row_of`), resets the wrapped session with the
    row's keywords, and returns the row's prompt (with the reset's own task text, if any, appended after a blank line)
    and the session's tools. ``call`` and ``close`` are the wrapped session's.

    Args:
        session: a session whose class has ``start(seed, episode_id, task_kwargs)`` returning ``(text, tools)`` with
            ``text`` possibly empty (`composer_diloco.rollout.episodes.OpenEnvSession`,
            `composer_diloco.rollout.mcp.McpEnvSession`, `composer_diloco.rollout.episodes.LocalEnvSession`).
        tasks: the task set.
    """

    def __init__(self, session: Any, tasks: TaskSet):
        self.inner, self.tasks = session, tasks
        self.url = getattr(session, "url", "")

    def reset(self, seed: int, episode_id: str) -> tuple[str, list[dict]]:
        """Start episode ``(seed, episode_id)`` on its row; return (the task text, the tool schemas).

        Raises:
            TaskSetError: ``episode_id`` names no row of the set.
            EnvProtocolError / McpProtocolError: the env lists no tools.
            RuntimeError: ``"Server error: ..."`` when the server's reset raised (e.g. on the row's keywords).
        """
        row = row_of(episode_id)
        if row is None:
            raise TaskSetError(f"episode {episode_id!r} names no task row (expected '<id>@row<N>'): episodes of a run "
                               "with [tasks] are named by their row")
        prompt, kwargs = self.tasks.task(row)
        text, tools = self.inner.start(seed, episode_id, kwargs)
        return (f"{prompt}\n\n{text}" if text.strip() else prompt), tools

    def call(self, tool: str, arguments: dict) -> tuple[str, str | None, dict, float, bool]:
        """The wrapped session's ``call``."""
        return self.inner.call(tool, arguments)

    def close(self) -> None:
        """Close the wrapped session (idempotent; never raises)."""
        self.inner.close()
