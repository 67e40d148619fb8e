"""Multi-turn rollouts that keep their KV cache across turns (`composer_diloco.rollout.episodes.TurnCache`) sample the
tokens that re-encoding the whole history every turn samples, with the same log-probs up to float rounding."""

from __future__ import annotations

import functools

import pytest
import torch

from composer_diloco.rollout import episodes as rollout
from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.sessions import open_env_sessions


def _play(model, tok, sessions, keys, *, cached: bool, seed: int):
    real = rollout.generate_turns

    def uncached(model, tokenizer, contexts, max_new_tokens, temperature, cache=None):
        return real(model, tokenizer, contexts, max_new_tokens, temperature, cache=None)

    torch.manual_seed(seed)
    with pytest.MonkeyPatch.context() as m:
        if not cached:
            m.setattr(rollout, "generate_turns", uncached)
        return rollout.play_episodes(model, tok, sessions, keys, tool_suffix_ids=functools.partial(tool_suffix_ids, tok),
                                     max_tool_calls=6, max_turn_tokens=40, max_seq_len=1024, temperature=1.0)


@pytest.mark.timeout(300)
def test_cached_turns_sample_what_full_re_encoding_samples(warm_cache):
    from composer_diloco.policy import load_policy

    model, tok = load_policy(None, run_dir=warm_cache.parent, seed=0, warmstart_steps=200)
    model.eval()
    server = start_env_server("envs.tool_env.server", startup_timeout_s=60)
    try:
        keys = [(0, f"kv{i // 4}") for i in range(8)]  # two GRPO groups of 4
        sessions = open_env_sessions([server.url], len(keys), max_tool_calls=6)
        try:
            full = _play(model, tok, sessions, keys, cached=False, seed=123)
            cached = _play(model, tok, sessions, keys, cached=True, seed=123)
        finally:
            for s in sessions:
                s.close()
    finally:
        server.stop()
    turns = [len(e.turns) for e in full]
    assert max(turns) >= 5, turns  # several episodes reuse their cache over more than one tool reply
    assert [e.completion_ids for e in cached] == [e.completion_ids for e in full]
    assert [e.end_reason for e in cached] == [e.end_reason for e in full]
    worst = max(abs(a - b) for x, y in zip(full, cached) for a, b in zip(x.logprobs, y.logprobs))
    assert worst < 1e-4, worst


def test_a_cache_row_is_reused_only_by_a_context_that_continues_it():
    cache = rollout.TurnCache(past=object(), real=[[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    assert cache.rows_for([[1, 2, 3, 9], [1, 2, 3, 8]]) == [0, 2]  # identical rows: taken in order
    assert cache.rows_for([[1, 2, 4, 5]]) == [1]
    assert cache.rows_for([[1, 2, 5]]) is None  # a new history: encode from scratch
    assert rollout.TurnCache().rows_for([[1]]) is None
