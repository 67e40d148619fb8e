"""Play a step's episodes: `play_episodes`, with one of two rollout engines over the same turn rules
(`composer_diloco.rollout.episodes.TurnRules`): ``"batched"`` (`composer_diloco.rollout.episodes.play_wave`, every
episode of a wave in lock-step turns) or ``"continuous"`` (`composer_diloco.rollout.continuous.play_continuous`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from composer_diloco.rollout.continuous import play_continuous
from composer_diloco.rollout.episodes import Episode, EnvSession, ToolSuffix, TurnRules, play_wave
from composer_diloco.timing import PhaseClock

__all__ = ["play_episodes"]


@torch.no_grad()
def play_episodes(
    model: nn.Module,
    tokenizer: Any,
    sessions: Sequence[EnvSession],
    keys: Sequence[tuple[int, str]],
    *,
    tool_suffix_ids: ToolSuffix,
    max_tool_calls: int,
    max_turn_tokens: int,
    max_seq_len: int,
    temperature: float,
    max_tool_reply_tokens: int | None = None,
    engine: str = "batched",
    clock: PhaseClock | None = None,
) -> list[Episode]:
    """Play ``len(keys)`` episodes on ``sessions``.

    Two engines sample the same distribution (and, greedy, the same tokens: `tests/test_continuous_rollout.py`):

    - ``"batched"``: ``len(sessions)`` episodes at a time in lock-step, one batched ``generate`` per assistant turn
      of each wave (`generate_turns`, KV kept across turns by `TurnCache`); env calls one after the other. With
      fewer sessions than keys (an env server that holds fewer sessions than a step has episodes:
      `composer_diloco.rollout.sessions.open_env_sessions`), the keys are played in waves of ``len(sessions)``, in
      order; the other episodes of the step wait for a free session.
    - ``"continuous"``: transformers' continuous batching (`composer_diloco.rollout.continuous`): an episode whose
      turn ended goes to its env (in a thread) while the others keep decoding, and comes back with its tool reply;
      a free session starts the next key at once.

    An env failure on one episode (a ``call`` that raises: OpenEnv's ``"Server error: ..."``, a dropped connection,
    a malformed observation) ends that episode, with reward 0 and end reason ``"env_error"`` (logged, and counted by
    `composer_diloco.inner.step.RoundStats`), never the step.

    Args:
        model: causal LM; generation runs on its device.
        tokenizer: its tokenizer, with a chat template that renders ``tools`` and tool calls.
        sessions: the env sessions (at least one); episode ``k`` of a wave plays on ``sessions[k]``.
        keys: ``(seed, episode_id)`` of each episode.
        tool_suffix_ids: token ids of the template's rendering of tool replies that follow an assistant turn
            ending in EOS (TRL ``GRPOTrainer._get_tool_suffix_ids``).
        max_tool_calls: assistant turns per episode.
        max_turn_tokens: new tokens per assistant turn.
        max_seq_len: prompt + completion tokens; an episode reaching it ends ("max_seq_len").
        temperature: sampling temperature (1.0 = the policy's distribution; 0.0 = greedy decoding).
        max_tool_reply_tokens: a tool reply longer than this many tokens is cut (`cut_reply`) before the policy sees
            it (``[env] max_tool_reply_tokens``); None: not cut.
        engine: ``"batched"`` or ``"continuous"`` (above).
        clock: counts the rollout's seconds as ``"generation"`` and ``"env"`` phases (`PhaseClock`); None: not
            counted.
    Returns:
        The episodes, in the order of ``keys``.
    Raises:
        ValueError: no sessions, or an unknown ``engine``.
        What a session's ``reset`` raises (a reset that fails is the env's contract broken, checked at join).
    """
    if not sessions:
        raise ValueError(f"{len(keys)} episodes need at least one env session, got none")
    turn = TurnRules(tokenizer, tool_suffix_ids, max_turn_tokens=max_turn_tokens, max_seq_len=max_seq_len,
                     max_tool_reply_tokens=max_tool_reply_tokens)
    with clock.phase("generation") if clock is not None else contextlib.nullcontext():
        if engine == "continuous":
            episodes = play_continuous(model, sessions, keys, turn, max_tool_calls=max_tool_calls,
                                       temperature=temperature, clock=clock)
        elif engine == "batched":
            wave = len(sessions)
            episodes = []
            for first in range(0, len(keys), wave):
                episodes += play_wave(model, sessions, keys[first:first + wave], turn, max_tool_calls=max_tool_calls,
                                       temperature=temperature, clock=clock)
        else:
            raise ValueError(f"rollout engine {engine!r}: expected 'batched' or 'continuous'")
    for ep in episodes:
        ep.check()
        ep.prompt_text = tokenizer.decode(ep.prompt_ids, skip_special_tokens=False)
        ep.completion_text = tokenizer.decode(ep.completion_ids, skip_special_tokens=False)
    return episodes
