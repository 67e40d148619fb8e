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
        errors: per call, ``(error_kind, error_meta)`` of a failed call as the env's server reports it (what an
            SDPO hint is made from), None for a call that succeeded; None for the whole list when the env does not
            say (then no warm-start demonstration shows a hint).

    Raises:
        ValueError: if ``calls``, ``replies``, ``imitate`` (and ``errors``) differ in length, or there is no call.
    """

    question: str
    tools: list[dict[str, Any]]
    calls: list[tuple[str, dict[str, Any]]]
    replies: list[str]
    imitate: list[bool]
    errors: list[tuple[str, dict[str, Any]] | None] | None = None

    def __post_init__(self) -> None:
        if not self.calls or not len(self.calls) == len(self.replies) == len(self.imitate):
            raise ValueError(f"Demonstration: need one reply and one imitate flag per call (at least one call), got "
                             f"{len(self.calls)} calls, {len(self.replies)} replies, {len(self.imitate)} flags")
        if self.errors is not None and len(self.errors) != len(self.calls):
            raise ValueError(f"Demonstration: need one errors entry per call, got {len(self.errors)} for "
                             f"{len(self.calls)} calls")
