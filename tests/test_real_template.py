"""A ``--model`` folder of another family than the shipped Qwen3 one plays episodes correctly with its own template.

The folder is a tiny random ``LlamaForCausalLM`` with Llama 3.1's chat template (TRL's ``llama3_1.jinja``, the text
Meta ships) and a tokenizer built here from the shipped vocabulary plus Llama 3's special tokens. Llama 3.1 writes a
tool call as one bare JSON object (``{"name": ..., "parameters": {...}}<|eot_id|>``), renders tools into the first
user message and tool replies as ``ipython`` turns: nothing like Qwen3's ``<tool_call>`` tags and ``<tool_response>``
blocks. The random weights carry a planted table (`composer_diloco.policy.planted`) that writes ``add(a=1, b=2)`` or,
as often, ``add(a=1)`` (an ``invalid_args`` error), so episodes have errors, recoveries, SDPO sites and DPO pairs.
"""

import functools
import json
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>")
LLAMA_CALLS = ('{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>',
               '{"name": "add", "parameters": {"a": 1}}<|eot_id|>')
ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def build_llama_folder(out: Path) -> Path:
    """A ``save_pretrained`` folder: tiny Llama (hidden 64, 2 layers), Llama 3.1's template, planted tool calls."""
    import trl
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from composer_diloco.policy.planted import plant_calls
    from composer_diloco.policy.tokenizer import DEFAULT_TOKENIZER_DIR

    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIALS])
    template = (Path(trl.__file__).parent / "chat_templates" / "llama3_1.jinja").read_text(encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                        pad_token="<|finetune_right_pad_id|>", chat_template=template,
                                        model_max_length=4096, clean_up_tokenization_spaces=False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    plant_calls(model, tokenizer, LLAMA_CALLS, after=ASSISTANT_HEADER)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return build_llama_folder(tmp_path_factory.mktemp("llama31") / "model")


@pytest.mark.timeout(120)
def test_llama31_episodes_parse_calls_and_mask_tool_replies(llama_dir, tmp_path):
    """Episodes through `play_episodes` (an inner step's rollout): every assistant turn parses as a call, some fail
    with ``invalid_args``; the tokens with env_mask 1 are exactly the policy's calls and those with 0 exactly Llama
    3.1's ipython turn plus the next assistant header; the ids are the template's rendering of the conversation."""
    from composer_diloco.policy import load_policy
    from composer_diloco.rollout.env_process import start_env_server
    from composer_diloco.rollout.episode_tokens import tool_suffix_ids
    from composer_diloco.rollout.play import play_episodes
    from composer_diloco.rollout.sessions import open_env_sessions

    model, tokenizer = load_policy(str(llama_dir), seed=0, warmstart_steps=0)
    assert tokenizer.chat_template.startswith("{{- bos_token }}")  # the folder's own template, not the shipped one
    server = start_env_server("envs.tool_env.server", startup_timeout_s=60)
    sessions = []
    try:
        sessions = open_env_sessions([server.url], 4, max_tool_calls=4)
        torch.manual_seed(0)
        episodes = play_episodes(model, tokenizer, sessions, [(0, f"llama-{i}") for i in range(4)],
                                 tool_suffix_ids=functools.partial(tool_suffix_ids, tokenizer), max_tool_calls=4,
                                 max_turn_tokens=24, max_seq_len=4096, temperature=1.0)
    finally:
        for s in sessions:
            s.close()
        server.stop()
    kinds = []
    for ep in episodes:
        assistant = [t for t in ep.turns if t.role == "assistant"]
        assert assistant and all(t.tool_call is not None and t.tool_call["name"] == "add" for t in assistant), ep.turns
        kinds += [t.error_kind for t in ep.turns if t.role == "tool"]
        # runs of env_mask: 1 = the policy's tokens, 0 = the template's tool turn and the next assistant header
        runs, start = [], 0
        for i in range(1, len(ep.env_mask) + 1):
            if i == len(ep.env_mask) or ep.env_mask[i] != ep.env_mask[start]:
                runs.append((ep.env_mask[start], tokenizer.decode(ep.completion_ids[start:i])))
                start = i
        for mask, text in runs:
            if mask == 1:
                assert text.startswith('{"name": "add", "parameters": {"a": 1') and text.endswith("<|eot_id|>"), text
            else:
                assert text.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n"), text
                assert text.endswith("<|eot_id|>" + ASSISTANT_HEADER), text
        tool_replies = [t.content for t in ep.turns if t.role == "tool"]
        masked = [text for mask, text in runs if mask == 0]
        # every reply the policy saw next (the last one of an episode cut at max_tool_calls is not appended)
        assert len(tool_replies) - 1 <= len(masked) <= len(tool_replies), (masked, tool_replies)
        assert all(json.dumps(r) in m for r, m in zip(tool_replies, masked))  # Llama 3.1 renders it with tojson
        # the ids are what Llama 3.1's template renders for the same conversation (calls as tool_calls)
        messages = [{"role": "user", "content": ep.turns[0].content}]
        for t in ep.turns[1:]:
            if t.role == "assistant":
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": t.tool_call["arguments"]}}]})
            else:
                messages.append({"role": "tool", "content": t.content})
        if len(masked) < len(tool_replies):  # the last reply ended the episode and was not appended
            messages = messages[:-1]
        rendered = tokenizer.apply_chat_template(messages, tools=ep.tools, tokenize=False,
                                                 add_generation_prompt=messages[-1]["role"] == "tool")
        assert tokenizer.decode(ep.prompt_ids + ep.completion_ids) == rendered
    assert "invalid_args" in kinds and None in kinds, kinds  # errors and successful calls both


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_llama31_model_trains_end_to_end_through_a_node(llama_dir, tmp_path):
    """Coordinator ``--model`` the Llama 3.1 folder and one node with ``--gradient-checkpointing``, one round of one
    inner step: both exit 0 and agree, the node logged its memory plan, every episode had a parsed call, and SDPO
    sites and DPO pairs were found and trained."""
    from local_run import LocalRun, write_config

    config = write_config(tmp_path / "llama.toml",  # smoke.toml with room for Llama 3.1's prompt (indented JSON tools)
                          "rounds = 1\ninner_steps = 1\nmax_seq_len = 4096\n\n[network]\nround_slack_s = 60.0\n"
                          "\n[loss]\nalpha_sdpo = 0.2\nbeta_dpo = 0.2\n")
    run = LocalRun(tmp_path / "run", config)
    try:
        run.start_coordinator("--model", str(llama_dir), wait=False)  # the node starts beside it (the suite's time)
        run.start_node("node-0", "--gradient-checkpointing")
        run.wait_peer_line()
        assert run.wait_exit("node-0", 240) == 0, run.all_tails()
        assert run.wait_exit("coordinator", 60) == 0, run.all_tails()
    finally:
        run.stop()
    records = run.records()
    node, coordinator = records["node-0"], records["coordinator"]
    assert [r["round"] for r in node] == [0]  # one round of one inner step: ~30 s of CPU at 4096 tokens
    assert [r["global_sha256"] for r in node] == [r["global_sha256"] for r in coordinator]
    assert all(r["episodes_without_tool_call"] == 0 and r["samples"] > 0 for r in node), node
    assert sum(r["sdpo_sites"] for r in node) > 0 and sum(r["dpo_pairs"] for r in node) > 0, node
    assert all(r["loss_dpo"] > 0 for r in node if r["dpo_pairs"]), node
    log = " ".join(run.log("node-0").split())  # the log's lines are wrapped
    assert "memory plan on cpu, full fine-tuning" in log and "fp32, gradient checkpointing;" in log, log[-3000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"] == str(llama_dir)


@pytest.mark.parametrize("text,expected", [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>', ("add", {"a": 1, "b": 2}, None)),
    ('<|python_tag|>{"name": "submit", "parameters": {"answer": 3}}<|eom_id|>', ("submit", {"answer": 3}, None)),
    ('{"name": "add", "arguments": {"a": 1}}', ("add", {"a": 1}, None)),
    ('{"name": "add", "parameters": {"a": 1,}}<|eot_id|>', (None, None, "malformed json")),
    ('{"answer": 3}', (None, None, "no tool call")),
    ("The answer is 3.<|eot_id|>", (None, None, "no tool call")),
    ('<tool_call>\n{"name": "add", "arguments": {"b": 2}}\n</tool_call><|im_end|>', ("add", {"b": 2}, None)),
])
def test_parse_tool_call_reads_llama3_json_and_hermes_tags(text, expected):
    from composer_diloco.rollout.chat import parse_tool_call

    call = parse_tool_call(text)
    assert (call.name, call.arguments) == expected[:2]
    assert (call.error or "").startswith(expected[2] or "") and (call.error is None) == (expected[2] is None)
