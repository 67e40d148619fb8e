"""The continuous rollout engine: multi-turn episodes decoded by transformers' continuous batching.

`composer_diloco.rollout.play.play_episodes` with ``engine="continuous"``. Every assistant turn of every episode
is one request to a transformers ``ContinuousBatchingManager`` (``model.continuous_batching_context_manager``: paged
KV cache, a scheduler that adds and drops requests between decode steps; the engine TRL drives with
``use_transformers_continuous_batching``). When a turn ends, its episode goes to its env in a worker thread while the
other episodes keep decoding; when the reply is back, the next turn is a new request whose context starts with
everything the episode's earlier turns held, so the manager's prefix cache (``allow_block_sharing``) serves those
tokens' KV from the blocks it kept instead of encoding them again (every complete block of `PAGE_SIZE` tokens). A free
env session starts the step's next episode at once, where the batched engine waits for the whole wave.

The distribution sampled is the batched engine's: the temperature-scaled softmax of the policy's logits, no top-k or
top-p; the log-probs are the manager's (``return_logprobs``: the log of the sampled token's probability under that
distribution), within float tolerance of a plain forward pass (`tests/test_continuous_rollout.py`). Greedy decoding
(temperature 0) gives the batched engine's tokens. Sampled runs are not reproducible token for token: which requests
share a decode step depends on when env replies come back.

fp32 models only: transformers sizes the paged cache by ``model.dtype`` and keeps keys and values in that one dtype,
while a bf16 node's autocast forward writes Qwen3's keys in fp32 (their RMSNorm) and its values in bf16; a bf16 node
refuses this engine (`nodes.options.resolve_rollout_engine`).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from composer_diloco.rollout.episodes import Episode, EnvSession, TurnRules, sampling_kwargs
from composer_diloco.timing import PhaseClock

log = logging.getLogger(__name__)

PAGE_SIZE = 64
"""Tokens per KV page: a turn's context reuses the cached KV of its complete pages (transformers' default, 256,
would re-encode up to 255 tokens of history each turn)."""

POLL_S = 0.005
"""How long the loop waits for a decoded turn while env calls are out (seconds), before looking at the env again."""


class ContinuousBatchingError(RuntimeError):
    """The continuous batching manager failed a request or stopped (names the request and the manager's error)."""


@dataclass
class _Playing:
    """One episode in flight: its key's index, its session, the call out to the env (if any), turns sampled."""

    index: int
    episode: Episode
    session: EnvSession
    turns: int = 0
    call: Any = None


def _manager_configs(model: nn.Module, tokenizer: Any, *, episodes: int, max_turn_tokens: int, max_seq_len: int,
                     temperature: float) -> tuple[Any, Any]:
    """The ``GenerationConfig`` and ``ContinuousBatchingConfig`` of a rollout: sampling as `generate_turns` samples,
    a KV cache sized for ``episodes`` sequences of ``max_seq_len`` tokens (transformers would otherwise take 90% of
    the free GPU memory), log-probs returned, a seed from torch's RNG (so the node's seed decides it)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(max_new_tokens=max_turn_tokens, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **sampling_kwargs(temperature))
    pages = math.ceil(max_seq_len / PAGE_SIZE) + 1
    batching = ContinuousBatchingConfig(
        page_size=PAGE_SIZE, num_blocks=episodes * pages + 1, max_batch_tokens=max(max_seq_len, 512),
        max_requests_per_batch=max(episodes, 1), return_logprobs=True, allow_block_sharing=True,
        seed=int(torch.randint(0, 2**31 - 1, ()).item()),
    )
    return generation, batching


def play_continuous(model: nn.Module, sessions: Sequence[EnvSession], keys: Sequence[tuple[int, str]],
                    turn: TurnRules, *, max_tool_calls: int, temperature: float,
                    clock: PhaseClock | None = None) -> list[Episode]:
    """Play one episode per key with continuous batching (module docstring); at most ``len(sessions)`` at once.

    Args:
        model: a transformers causal LM (a peft model too: its base model's manager runs the adapted layers).
        sessions: env sessions; each plays one episode at a time, env calls run in a thread per session.
        keys: ``(seed, episode_id)`` per episode.
        turn: the episode rules between turns (`TurnRules`).
        max_tool_calls: assistant turns per episode.
        temperature: > 0 samples at that temperature; 0 decodes greedily.
        clock: seconds while no turn is decoding and the loop waits on the env go to its ``"env"`` phase.
    Returns:
        The episodes in the order of ``keys``.
    Raises:
        ContinuousBatchingError: the manager failed a request or stopped before the rollout ended.
        What a session's ``reset`` raises.
    """
    generation, batching = _manager_configs(model, turn.tokenizer, episodes=min(len(keys), len(sessions)),
                                            max_turn_tokens=turn.max_turn_tokens, max_seq_len=turn.max_seq_len,
                                            temperature=temperature)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    done: list[Episode | None] = [None] * len(keys)
    free = list(sessions)
    waiting = list(range(len(keys)))[::-1]  # keys not started yet, next one last
    decoding: dict[str, _Playing] = {}  # request id -> episode
    at_env: dict[futures.Future, _Playing] = {}
    with futures.ThreadPoolExecutor(max_workers=len(sessions), thread_name_prefix="env") as pool, \
            base.continuous_batching_context_manager(generation_config=generation, continuous_batching_config=batching,
                                                     warmup=False, block=True, timeout=60.0) as manager:

        def submit(p: _Playing) -> None:
            context = p.episode.prompt_ids + p.episode.completion_ids
            request = f"{p.index}.{p.turns}"
            if manager.add_request(context, request_id=request, max_new_tokens=turn.max_turn_tokens) is None:
                raise ContinuousBatchingError(f"continuous batching refused request {request} (episode "
                                              f"{p.episode.episode_id}, {len(context)} tokens): the manager is not "
                                              f"accepting requests")
            decoding[request] = p

        def finish(p: _Playing, reason: str | None = None) -> None:
            if reason is not None:
                p.episode.end_reason = reason
            done[p.index] = p.episode
            free.append(p.session)

        def start_waiting() -> None:
            while free and waiting:  # resets run here, in key order (a failing reset is the env's contract broken)
                index, session = waiting.pop(), free.pop()
                seed, episode_id = keys[index]
                submit(_Playing(index, turn.start(session, seed, episode_id), session))

        def env_done(ready: set[futures.Future]) -> None:
            for future in ready:
                p = at_env.pop(future)
                if not turn.record_reply(p.episode, p.session, p.call, future.result()):
                    finish(p)
                elif p.turns >= max_tool_calls:  # as the batched engine: the call budget is spent
                    finish(p, "max_tool_calls")
                else:
                    submit(p)

        start_waiting()
        while decoding or at_env or waiting:
            if not decoding:  # every episode still playing waits for its env: nothing else to do
                with clock.phase("env") if clock is not None else contextlib.nullcontext():
                    ready, _ = futures.wait(list(at_env), return_when=futures.FIRST_COMPLETED)
                env_done(ready)
                start_waiting()
                continue
            result = manager.get_result(timeout=POLL_S if at_env else 1.0)
            if result is None:
                if manager.background_thread_status.fatal_error is not None or not manager.is_running():
                    raise ContinuousBatchingError(
                        f"continuous batching stopped with {len(decoding)} turns decoding: "
                        f"{manager.background_thread_status.fatal_error!r}")
            elif result.request_id in decoding:
                p = decoding.pop(result.request_id)
                if result.error is not None:
                    raise ContinuousBatchingError(f"continuous batching failed request {result.request_id} "
                                                  f"(episode {p.episode.episode_id}): {result.error}")
                ids = list(result.generated_tokens)
                if turn.tokenizer.eos_token_id in ids:
                    ids = ids[:ids.index(turn.tokenizer.eos_token_id) + 1]
                p.turns += 1
                p.call = turn.record_turn(p.episode, ids, [float(x) for x in result.logprobs[:len(ids)]])
                if p.call is None:
                    finish(p)
                else:
                    at_env[pool.submit(turn.call_env, p.session, p.call)] = p
            ready = {f for f in at_env if f.done()}
            if ready:
                env_done(ready)
            start_waiting()
    missing = [keys[i] for i, e in enumerate(done) if e is None]
    if missing:
        raise ContinuousBatchingError(f"the rollout ended without episodes {missing[:4]}")
    return done

