"""Multi-turn rollouts that keep their KV cache across turns (`composer_diloco.rollout.episodes.TurnCache`) sample the
tokens that re-encoding the whole history every turn samples, with the same log-probs up to float rounding."""

from __future__ import annotations

import functools

import pytest
import torch

from composer_diloco.rollout import episodes as rollout

from composer_diloco.rollout.play import play_episodes
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
        return play_episodes(model, tok, sessions, keys, tool_suffix_ids=functools.partial(tool_suffix_ids, tok),
                                     max_tool_calls=6, max_turn_tokens=40, max_seq_len=1024, temperature=1.0)


@pytest.mark.timeout(300)
def test_cached_turns_sample_what_full_re_encoding_samples(warm_cache):
    from composer_diloco.policy import load_policy

    model, tok = load_policy(None, seed=0, warmstart_steps=200)
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


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3-sliding-window"])
def test_other_architectures_sample_the_same_and_sliding_windows_re_encode(family):
    """Families this project did not build (random tiny weights): RoPE and absolute positions keep their cache with the
    same tokens; a sliding-window cache (its window counts padded columns) is not kept, so every turn re-encodes."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, GPT2Config, LlamaConfig

    from composer_diloco.policy import load_default_tokenizer

    tok = load_default_tokenizer()
    vocab = len(tok)
    config = {
        "llama": LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2),
        "gpt2": GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2),
        "gemma3-sliding-window": Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=16, sliding_window=32),
    }[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # every row samples all its tokens: long histories
    played = {}
    for cached in (False, True):
        g = torch.Generator().manual_seed(1)
        contexts = [torch.randint(5, vocab - 8, (20 + 9 * i,), generator=g).tolist() for i in range(3)]
        cache = rollout.TurnCache() if cached else None
        turns = []
        for turn in range(3):
            torch.manual_seed(turn)
            ids, _ = rollout.generate_turns(model, tok, contexts, 12, 1.0, cache=cache)
            turns.append(ids)
            contexts = [c + i + torch.randint(5, vocab - 8, (5 + 4 * k,), generator=g).tolist()
                        for k, (c, i) in enumerate(zip(contexts, ids))]
        played[cached] = (turns, cache)
    assert played[True][0] == played[False][0]
    kept = played[True][1].past is not None
    assert kept == (family != "gemma3-sliding-window")


def test_cached_turns_decode_greedily_what_full_re_encoding_decodes(monkeypatch):
    """Greedy decoding (``do_sample=False``: no random numbers that a shared seed could line up): the turns that keep
    their `TurnCache` pick, token for token, what re-encoding every history picks. Rows of different lengths (left
    padding inside the cache, `TurnCache.compact`), some ending at EOS mid-turn (masked tails), over 4 turns; the
    embedded default architecture with random weights (seed 0)."""
    from types import SimpleNamespace

    from composer_diloco.policy import build_tiny_model, load_default_tokenizer

    tok = load_default_tokenizer()
    vocab = len(tok) - 8
    model = build_tiny_model(tok, 0).eval()
    sample = model.generate

    def greedy(**kwargs):  # generate_turns samples; the same call, decoded greedily
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        return sample(**kwargs)

    monkeypatch.setattr(model, "generate", greedy)

    def contexts() -> tuple[torch.Generator, list[list[int]]]:
        g = torch.Generator().manual_seed(3)
        return g, [torch.randint(5, vocab, (15 + 11 * i,), generator=g).tolist() for i in range(4)]

    # an EOS that greedy decoding reaches mid-turn: the token row 0 picks 6th on its first turn
    first, _ = rollout.generate_turns(model, SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=None),
                                      contexts()[1], 12, 1.0)
    eos_tok = SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=first[0][5])
    played = {}
    for cached in (False, True):
        g, ctx = contexts()
        cache = rollout.TurnCache() if cached else None
        turns, logps = [], []
        for turn in range(4):
            ids, lps = rollout.generate_turns(model, eos_tok, ctx, 12, 1.0, cache=cache)
            turns.append(ids)
            logps.append(lps)
            ctx = [c + i + torch.randint(5, vocab, (3 + 5 * k,), generator=g).tolist()
                   for k, (c, i) in enumerate(zip(ctx, ids))]
        played[cached] = (turns, logps, cache)
    turns = played[False][0]
    assert len({len(ids) for turn in turns for ids in turn}) > 1, turns  # some rows ended at EOS, some did not
    assert played[True][0] == turns
    assert played[True][2].past is not None  # the cache was kept, not re-encoded
    worst = max(abs(a - b) for t_f, t_c in zip(played[False][1], played[True][1])
                for r_f, r_c in zip(t_f, t_c) for a, b in zip(r_f, r_c))
    assert worst < 1e-4, worst
