"""`TaskShard`: which part of a run's task rows a node takes (``composer-node join --task-shard K/N``).

Its own module so that the node's command line can check ``--task-shard`` before it imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskShard:
    """Which part of the rows a node takes: shard ``index`` of ``count`` (``--task-shard K/N``)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> TaskShard:
        """``"K/N"`` with ``0 <= K < N``.

        Raises:
            ValueError: one line naming ``text`` and the expected form.
        """
        found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not found or int(found.group(2)) < 1 or int(found.group(1)) >= int(found.group(2)):
            raise ValueError(f"--task-shard {text!r}: expected K/N with 0 <= K < N, e.g. 0/2")
        return cls(int(found.group(1)), int(found.group(2)))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
