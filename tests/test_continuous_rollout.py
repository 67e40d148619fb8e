"""The continuous rollout engine (`composer_diloco.rollout.continuous`: transformers' continuous batching) plays the
episodes the batched engine plays: greedy, the same tokens and end reasons; sampled, log-probs that a plain forward
pass of the policy gives. Against a real tool_env server process."""

from __future__ import annotations

import functools

import pytest
import torch

from composer_diloco.rollout import episodes as rollout

from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.rollout.episode_tokens import tool_suffix_ids
from composer_diloco.rollout.sessions import open_env_sessions
from composer_diloco.timing import PhaseClock


@pytest.fixture(scope="module")
def server():
    server = start_env_server("envs.tool_env.server", startup_timeout_s=60)
    yield server
    server.stop()


def _play(model, tok, url, keys, *, engine, temperature, sessions=None, max_turn_tokens=40, clock=None):
    opened = open_env_sessions([url], sessions or len(keys), max_tool_calls=6)
    try:
        torch.manual_seed(7)
        return play_episodes(model, tok, opened, keys, tool_suffix_ids=functools.partial(tool_suffix_ids, tok),
                                     max_tool_calls=6, max_turn_tokens=max_turn_tokens, max_seq_len=1024,
                                     temperature=temperature, engine=engine, clock=clock)
    finally:
        for s in opened:
            s.close()


@pytest.fixture(scope="module")
def policy(warm_cache):
    from composer_diloco.policy import load_policy

    model, tok = load_policy(None, seed=0, warmstart_steps=200)
    return model.eval(), tok


@pytest.mark.timeout(300)
def test_greedy_continuous_batching_decodes_the_batched_engines_episodes(policy, server):
    """The warm-started default, 12 episodes of up to 6 turns: every token, end reason and reward matches; log-probs
    within float rounding; the clock counts the rollout as generation (and env only while nothing decodes)."""
    model, tok = policy
    keys = [(0, f"cb{i // 4}") for i in range(12)]
    batched = _play(model, tok, server.url, keys, engine="batched", temperature=0.0)
    clock = PhaseClock()
    continuous = _play(model, tok, server.url, keys, engine="continuous", temperature=0.0, clock=clock)
    assert max(len(e.turns) for e in batched) >= 5, [len(e.turns) for e in batched]  # multi-turn, KV reused
    assert [e.episode_id for e in continuous] == [k[1] for k in keys]
    assert [e.completion_ids for e in continuous] == [e.completion_ids for e in batched]
    assert [(e.end_reason, e.reward) for e in continuous] == [(e.end_reason, e.reward) for e in batched]
    worst = max(abs(a - b) for x, y in zip(batched, continuous) for a, b in zip(x.logprobs, y.logprobs))
    assert worst < 1e-4, worst
    phases = clock.take()
    assert phases["generation"] > 0 and set(phases) <= {"trainer", "generation", "env"}, phases


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "gemma3-sliding-window"])
def test_greedy_continuous_batching_on_other_architectures(family, server):
    """Families this project did not build (random tiny weights, the shipped tokenizer): a RoPE Llama and a Gemma 3
    whose sliding window (32) is shorter than the prompt. Random weights write no call, so each episode is one
    turn of 24 tokens: the same tokens as the batched engine."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    from composer_diloco.policy import load_default_tokenizer

    tok = load_default_tokenizer()
    vocab = len(tok)
    config = {
        "llama": LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id),
        "gemma3-sliding-window": Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=16, sliding_window=32, eos_token_id=tok.eos_token_id),
    }[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    keys = [(0, f"arch{i}") for i in range(4)]
    batched = _play(model, tok, server.url, keys, engine="batched", temperature=0.0, max_turn_tokens=24)
    continuous = _play(model, tok, server.url, keys, engine="continuous", temperature=0.0, max_turn_tokens=24)
    assert all(len(e.completion_ids) > 0 for e in batched)
    assert [e.completion_ids for e in continuous] == [e.completion_ids for e in batched]
    worst = max(abs(a - b) for x, y in zip(batched, continuous) for a, b in zip(x.logprobs, y.logprobs))
    assert worst < 1e-4, worst
    assert model.config._attn_implementation == "sdpa"  # continuous batching's paged attention is switched back


@pytest.mark.timeout(300)
def test_sampled_log_probs_are_those_of_a_forward_pass(policy, server):
    """At temperature 0.7, every sampled token's log-prob (what GRPO's importance ratio divides by) equals the
    log-softmax of the policy's logits / 0.7 at that position, from one forward pass over the whole episode."""
    model, tok = policy
    keys = [(3, f"lp{i // 2}") for i in range(6)]
    episodes = _play(model, tok, server.url, keys, engine="continuous", temperature=0.7)
    checked = 0
    for ep in episodes:
        ids = torch.tensor([ep.full_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float() / 0.7
        logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        start = len(ep.prompt_ids)
        for j, (mask, lp) in enumerate(zip(ep.env_mask, ep.logprobs)):
            if mask:
                assert abs(float(logps[start + j - 1]) - lp) < 1e-4, (ep.episode_id, j, float(logps[start + j - 1]), lp)
                checked += 1
            else:
                assert lp == 0.0
    assert checked > 100, checked


@pytest.mark.timeout(300)
def test_fewer_sessions_than_episodes_start_each_episode_on_a_free_session(policy, server):
    """2 env sessions for 7 episodes: every episode is played, in the order of its key, each to an end."""
    model, tok = policy
    keys = [(1, f"few{i}") for i in range(7)]
    episodes = _play(model, tok, server.url, keys, engine="continuous", temperature=1.0, sessions=2)
    assert [e.episode_id for e in episodes] == [k[1] for k in keys]
    assert all(e.end_reason in {"done", "no_tool_call", "truncated", "max_tool_calls", "max_seq_len"}
               for e in episodes), [e.end_reason for e in episodes]
    assert sum(e.tool_calls for e in episodes) >= 7


def test_the_rollout_engine_a_node_picks():
    """``--rollout auto`` is the batched engine on every device and precision (as fast as continuous batching on an
    H200 in fp32, faster on the CPU, reproducible); ``continuous`` is taken as asked, but refused in one line on a
    bf16 node; anything else is refused naming the choices."""
    from nodes.options import OptionError, resolve_rollout_engine

    assert resolve_rollout_engine("auto", bf16=False) == "batched"
    assert resolve_rollout_engine("auto", bf16=True) == "batched"
    assert resolve_rollout_engine("continuous", bf16=False) == "continuous"
    assert resolve_rollout_engine("batched", bf16=True) == "batched"
    with pytest.raises(OptionError, match="--rollout continuous on a bf16 node: .* use --dtype fp32 or --rollout batched"):
        resolve_rollout_engine("continuous", bf16=True)
    with pytest.raises(OptionError, match="--rollout 'vllm': expected one of auto, batched, continuous"):
        resolve_rollout_engine("vllm", bf16=False)
