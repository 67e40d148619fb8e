"""A scripted demonstration: one episode played by an environment's scripted solver, as supervised data.

Every env package that the embedded default policy can be warm-started on has a ``demos`` module with
``demonstration(seed, index, error_rate) -> Demonstration`` (see ``composer_diloco.policy.warm_start``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Demonstration"]


@dataclass(frozen=True)
class Demonstration:
    """One solver episode: the question, the calls, the env's replies, and which calls to imitate.

    Attributes:
        question: the episode's user prompt.
        tools: the tool schemas the episode is rendered with (OpenAI function format).
        calls: ``(tool name, arguments)`` per assistant turn, in order.
        replies: the env's reply text per call (what the policy sees in the tool message).
        imitate: per call, whether its tokens are trained on; a failed call stays in the context, so the policy
            learns to recover from it, but is not imitated.

    Raises:
        ValueError: if ``calls``, ``replies`` and ``imitate`` differ in length, or there is no call.
    """

    question: str
    tools: list[dict[str, Any]]
    calls: list[tuple[str, dict[str, Any]]]
    replies: list[str]
    imitate: list[bool]

    def __post_init__(self) -> None:
        if not self.calls or not len(self.calls) == len(self.replies) == len(self.imitate):
            raise ValueError(f"Demonstration: need one reply and one imitate flag per call (at least one call), got "
                             f"{len(self.calls)} calls, {len(self.replies)} replies, {len(self.imitate)} flags")
