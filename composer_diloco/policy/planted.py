"""A planted tool-call table: random weights that write a well-formed tool call, for runs at size and template tests.

A randomly initialised model never writes a tool call, and a node that ends a run without one exits 1 ("trained on
nothing"). `plant_calls` keeps a random model random except for one lookup table in layer 0's MLP that makes it write
one of a few given calls after the generation prompt: a bigram table over the calls' tokens. ``bench/real_arch.py``
uses it for Qwen3-0.6B's architecture, ``tests/test_real_template.py`` for a tiny Llama with Llama 3.1's chat template.
The shapes, parameter count, FLOPs and memory of the model are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HERMES_CALLS", "plant_calls"]

HERMES_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
                '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>')
"""``add(a=1, b=2)`` or, with even odds, ``add(a=1)`` (an ``invalid_args`` tool error in ``envs/tool_env``), in the
shipped tokenizer's Qwen3 / Hermes format."""


def plant_calls(model: Any, tokenizer: Any, calls: tuple[str, ...] = HERMES_CALLS, *,
                after: str = "<|im_start|>assistant\n", scale: float = 0.01) -> dict[int, list[int]]:
    """Make a random Qwen3- or Llama-like model write one of ``calls`` after the generation prompt ``after``: every
    decoder layer's residual writes (``o_proj``, ``down_proj``) are scaled by ``scale``, and one neuron of layer 0's
    MLP per table row maps a token to its successors (gate and up rows = the token's embedding direction, the down
    column = the successors' directions); the calls' embedding rows are rescaled so that a successor's logit is about
    25 at any width.

    The calls' token chains form a bigram table: a token followed by different tokens in different calls gets them
    all with equal probability (`HERMES_CALLS`: after ``"a": 1`` either ``, "b": 2}}`` or ``}}``, so half the calls lack
    ``b``). A token may appear once per call.

    Args:
        model: a freshly initialised causal LM with tied embeddings (fp32), Llama/Qwen layout (``model.model.layers``,
            ``self_attn.o_proj``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``).
        tokenizer: its tokenizer.
        calls: the texts to write, each ending with the end-of-turn token.
        after: the generation prompt; its last token starts every call.
        scale: factor on every layer's ``o_proj`` and ``down_proj``.
    Returns:
        the bigram table ``{token id: [next token ids]}``.
    Raises:
        ValueError: a call repeats a token, or the table needs more neurons than layer 0's MLP has.
    """
    start = tokenizer(after, add_special_tokens=False)["input_ids"][-1]
    table: dict[int, list[int]] = {}
    for call in calls:
        chain = [start] + tokenizer(call, add_special_tokens=False)["input_ids"]
        if len(set(chain)) != len(chain):
            raise ValueError(f"call {call!r} repeats a token ({chain}): a bigram table cannot write it")
        for cur, nxt in zip(chain[:-1], chain[1:]):
            if nxt not in table.setdefault(cur, []):
                table[cur].append(nxt)
    layers = model.model.layers
    mlp = layers[0].mlp
    if len(table) > mlp.gate_proj.weight.shape[0]:
        raise ValueError(f"{len(table)} table rows, layer 0's MLP has {mlp.gate_proj.weight.shape[0]} neurons")
    emb = model.get_input_embeddings().weight
    hidden = model.config.hidden_size
    with torch.no_grad():
        for tok in {t for cur, nxt in table.items() for t in [cur, *nxt]}:
            emb[tok] *= 25 / hidden ** 0.5 / emb[tok].norm()  # the next token's logit: about 25 at any width
        for layer in layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
        for k, (cur, nxt) in enumerate(table.items()):
            u = emb[cur] / emb[cur].norm()
            v = sum(emb[n] / emb[n].norm() for n in nxt)
            mlp.gate_proj.weight[k] = u
            mlp.up_proj.weight[k] = u
            mlp.down_proj.weight[:, k] = v / v.norm() * 10 / hidden  # SiLU(gate) * up = hidden for its own token
    return table
