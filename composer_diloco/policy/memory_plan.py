"""A node's memory plan: the bytes it will hold on its device and in host RAM, computed before it joins a run, and the
micro-batch it trains with.

The figures follow what this code and TRL allocate (read from them, then checked against measurements,
`composer_diloco.policy.memory_measure` and ``tests/test_memory_plan.py``). With P the policy's parameters and T those
that train (T = P with full fine-tuning, the adapter tensors with ``[lora]``):

Device (the policy's device: a GPU, or host RAM for ``--device cpu``)
    weights      4 P   fp32 master weights; ``--dtype bf16`` (autocast) stores the frozen linear weights in bf16
                       (`composer_diloco.policy.precision`): with ``[lora]`` the base's, 4 P - 2 L_frozen
    optimizer    8 T   torch AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32, like the parameters)
    reference    4 P   ``[grpo] beta > 0``: TRL's own reference, a copy of the policy; a loss channel's model copy
                       (`ChannelMemory.copy`): with ``[loss] beta_dpo > 0`` DPO's reference is a frozen deep copy
                       of the policy (`composer_diloco.channels.dpo`), 4 P - 2 L under bf16 (L: the linear-only
                       weights, stored in bf16). With ``[lora]`` both are the base with adapters disabled: 0 bytes.
                       The SDPO teacher is the policy itself (no copy) in either mode.
    + the largest of the phases of an inner step (`MemoryPlan.phase_peak`), each over the state above:
    rollout      the step's ``episodes_per_step`` episodes are generated as one batch (`play_episodes`): their KV
                 cache, ``2 * layers * kv_dim`` values per token of a row (bf16 under autocast, else fp32), and each
                 turn's sampling scores, ``K_SCORES`` fp32 ``(episodes, max_turn_tokens, vocab)`` tensors (the
                 scores ``generate`` returns, their stack, their log-softmax: `generate_turns`)
    a channel's  `ChannelMemory.phase`: DPO's reference log-probs of the step's pairs, all at once
    own phase    (`composer_diloco.channels.dpo_rows.dpo_rows`): the chosen rows' fp32 logits stay alive while the
                 rejected rows' are computed, ``K_REFERENCE_LOGITS * pairs * row * vocab * 4`` bytes (a quarter more
                 under bf16: the bf16 logits before their fp32 copy;
                 `composer_diloco.channels.dpo.reference_pass_bytes`)
    training     one micro-batch's forward/backward and the AdamW step (`MemoryPlan.training_peak`): gradients
                 4 T, activations (below), AdamW's temporaries.

Gradients and activations do not add up in full: backward frees a layer's activations as it creates its gradients,
and AdamW's step runs after backward with every gradient plus its temporaries. TRL's ``optim="adamw_torch"`` is
``torch.optim.AdamW`` with torch's default implementation: on a CPU the single-tensor one (two temporaries of one
tensor, ``8 * largest trainable tensor``), on a GPU the multi-tensor ``foreach`` one, whose ``_foreach_sqrt`` of
``exp_avg_sq`` is one fp32 copy of every trainable tensor at once (``4 T``; torch ``optim/adam.py``,
``_multi_tensor_adam``; on an H200, full fine-tuning of Qwen3-0.6B peaked at 13.49 GB against a plan of 12.28 GB that
had counted the single-tensor step, BENCHMARKS.md section 7). The training phase's peak is ``max(activations +
gradients / 4, gradients + that temporary)``. A GPU node also holds cuBLAS's and cuBLASLt's workspaces
(`CUDA_WORKSPACE_BYTES`).

Host RAM (`composer_diloco.outer`: always CPU, fp32)
    theta 4 T + pseudo-gradient buffer 4 T + outer optimizer state (4 T per state tensor: SGD momentum 1, Adam 2,
    none for parameter averaging; a codec with error feedback adds 4 T per tensor it keeps, as its registry entry
    says: 8 T for ``sparse-2bit`` and ``shared-blocks``, the buffer and its next value, `composer_diloco.outer.codecs`)
    + a state download's buffers (`composer_diloco.outer.state_transfer`:
    a joiner writes into its own theta and outer state, so nothing; a peer that holds theta and resyncs downloads what
    differs into new buffers, at most theta and the outer state again, 4 T per tensor; the serving peer holds a few
    chunks, no copy; the outer step itself copies nothing, `GlobalModel.outer_step`),
    plus the policy as loaded: ``from_pretrained`` builds it in fp32 on the CPU (4 P) before
    it moves to a GPU; on a CPU node that copy *is* the device's weights; plus `RUNTIME_HOST_BYTES` of the process's
    own beyond these tensors.

**Rows** (each channel's declared by its `LossChannel.memory`). A micro-batch holds ``--batch-size`` GRPO rows (its
episodes), as many SDPO student rows (``alpha_sdpo > 0``:
one site per episode on average, the planning assumption: an episode has at most ``max_tool_calls - 1`` sites, and a
policy that fails and recovers on most turns can need more, which `nodes.node.Node` warns about when a round has more
sites than episodes) and ``2 * ceil(max_sites * max_pairs_per_turn / grad_accum)`` DPO rows (``beta_dpo > 0``: a bound,
`collect_pairs` keeps no more). Every row is planned at the longest row the run can produce (`row_bound`): the prompt,
then ``max_tool_calls`` turns of ``max_turn_tokens`` and ``max_tool_calls - 1`` tool replies, each at most ``[env]
max_tool_reply_tokens`` tokens (the rollout cuts longer replies) plus the chat template's tokens around a reply; capped
by ``max_seq_len``, since an episode ends before a reply and the next turn would pass it. Without a reply cap, or with
a prompt the plan cannot bound before the first reset, rows are planned at ``max_seq_len``.

**Activations** of one micro-batch (`activation_bytes`):
    decoder     per token of every row that trains (GRPO, SDPO student, DPO chosen and rejected), ``layers *
                (K_HIDDEN * hidden + K_Q * q_dim + K_KV * kv_dim + K_FFN * intermediate) * 4`` (``BF16_DECODER_SHARE``
                of it under bf16 autocast, ``LORA_DECODER_SHARE`` with ``[lora]``); gradient checkpointing keeps only
                each layer's input (``hidden * 4`` per layer and token) plus one layer's full activations;
    vocabulary  GRPO's log-probs come from TRL's fused LM head (``add_fused_lm_head``): the ``(tokens, vocab)`` logits
                never exist, only a ``min(tokens, FUSED_TOKEN_TILE) x min(vocab, FUSED_VOCAB_CHUNK)`` tile and its
                temporaries (``K_TILE`` fp32 copies on CPU, where TRL folds the tile in torch ops). SDPO and DPO call
                the model's own forward: their full logits (``rows x row x vocab``, bf16 under autocast, else fp32) live
                while the channel's loss is computed (SDPO: the student's and the teacher's; DPO: the chosen rows'
                while the rejected rows' are computed), SDPO's divergence holds ``K_SDPO_PEAK`` fp32 vocab-sized
                tensors per response token (at most ``max_turn_tokens`` a row) and keeps ``K_SDPO_SAVED`` of them for
                backward, DPO keeps ``K_DPO_VOCAB``. Each channel declares these counts in its own module
                (`composer_diloco.channels.base.LossChannel.memory`, a `ChannelMemory`); this module names none.
    The loss's forward runs GRPO, then each channel (SDPO, then DPO), and backward the other way round, so the plan
    takes the largest of these moments: GRPO's rows with the fused head's tile; for each channel, every row up to its
    own with what the earlier channels keep and its own peak (SDPO: its logits and divergence; DPO: what SDPO keeps
    and DPO's logits); plus backward's temporaries for one forward's rows (``(3 * hidden + 2 * intermediate) * 4``
    bytes a token).
The training rows' padded width is the longest row of the step (TRL pads the prompt and completion parts to the step's
longest); with prompts of different lengths it can pass the planned row by their difference.

**The micro-batch.** A node without ``--batch-size`` takes the largest micro-batch that divides the run's episodes per
step and whose plan fits its free memory, first without gradient checkpointing, then with it (`choose_batch`); the
episodes per step stay the run's (gradient accumulation makes up the step). A user's ``--batch-size`` is planned as
given and refused with one line naming what would fit (`check_plan`).

**Plan against measurement.** Every round's metrics line holds the measured peak (`PeakMemory`) next to the plan's
figure (`MemoryPlan.planned_peak`) and the round's longest episode (`round_memory`); a node warns when a round passes
its plan or breaks one of its assumptions. On a CPU the resident set also holds freed memory glibc keeps and heap
fragments: at Qwen3-0.6B's size the plan at a round's real sizes came out 4-11 % under the node's peak (BENCHMARKS.md,
section 7), so the plan's slack (rows at the run's bound) is what covers them there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from composer_diloco.outer.codecs import codec_entry
from composer_diloco.policy.memory_sizes import ChannelMemory, ModelShape, StepShape

if TYPE_CHECKING:
    from composer_diloco.config import LoraSection, RunConfig

__all__ = ["CUDA_WORKSPACE_BYTES", "DEVICE_MEMORY_ENV", "BatchChoice", "ChannelMemory", "DeviceMemoryError",
           "MemoryPlan", "ModelShape", "PeakMemory", "RowBound", "StepShape", "activation_bytes", "channel_memory", "check_plan",
           "choose_batch", "device_free_bytes", "model_shape", "plan_for_run", "plan_inputs", "plan_memory",
           "proc_status_bytes", "refusal", "round_memory", "row_bound"]

GB = 1e9
DEVICE_MEMORY_ENV = "COMPOSER_DILOCO_DEVICE_MEMORY_BYTES"
"""Caps the device bytes a node believes it has (e.g. to rehearse a 24 GB GPU on a bigger one, or in tests)."""

K_HIDDEN = 6
"""Hidden-sized tensors a Qwen3/Llama decoder layer keeps per token for backward: the two RMSNorms' inputs and
outputs, the residual sums (counted from the code, then checked on CPU by `composer_diloco.policy.memory_measure`)."""
K_Q = 6
"""Query-sized (heads x head_dim) tensors per token: q, its norm, its rotation's inputs and output, the attention
output."""
K_KV = 6
"""Key/value-sized (kv_heads x head_dim) tensors per token: k with its norm and rotation, v."""
K_FFN = 4
"""Intermediate-sized tensors a SwiGLU MLP keeps per token: gate, up, SiLU(gate), their product."""
BF16_DECODER_SHARE = 0.8
"""Under bf16 autocast the decoder keeps about 80 % of fp32's activation bytes, not half: the residual stream and the
norms stay fp32 and autocast saves a bf16 copy of each linear layer's fp32 input for backward (measured on CPU
autocast, 0.75 to 0.87 over the embedded default and a 5.2M random model, full and LoRA; CUDA autocast casts the
same ops)."""
LORA_DECODER_SHARE = 0.65
"""With frozen base weights autograd keeps no input of a frozen linear layer for its weight gradient: the decoder's
activations shrink to about 65 % (measured 0.60 at 28 layers to 0.71 at 4 on CPU)."""
FUSED_TOKEN_TILE = 4096
"""Tokens per tile of TRL's fused LM head (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``, TRL 1.16)."""
FUSED_VOCAB_CHUNK = 32768
"""Vocabulary columns per tile of TRL's fused LM head (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``, TRL 1.16)."""
K_TILE = {"cpu": 8.5, "cuda": 2.0}
"""fp32 tile-sized tensors alive at once in the fused LM head: on CPU TRL folds a tile in torch ops (the tile, its
scaled copies, exp, their products; backward: the probabilities, the gradient and their temporaries; measured on CPU),
on CUDA a Triton kernel folds it in place (the bf16 tile and the weight chunk's cast: 2 is an upper bound, not
measured here)."""
K_SCORES = 3
"""fp32 ``(episodes, max_turn_tokens, vocab)`` tensors of a turn's sampling (`generate_turns`: ``generate``'s scores,
their stack, their log-softmax)."""
RUNTIME_HOST_BYTES = 128_000_000
"""Host bytes a node process allocates beyond the tensors planned here, after the policy is built: hivemind's peer and
its averager's buffers, env sessions, the episodes' Python objects, glibc's retained heap (measured 70 MB on the
embedded default: a round's peak resident set against the plan at the episodes' real length, `PeakMemory`)."""
PROMPT_SAMPLES = 64
"""Demonstrations of the env package rendered to bound a prompt (`prompt_tokens`)."""
PROMPT_MARGIN = 1.25
"""The prompt bound is the longest rendered demonstration's prompt times this, plus `PROMPT_SLACK` tokens: tasks the
sample did not draw may be a little longer."""
PROMPT_SLACK = 16
REPLY_SLACK = 8
"""Tokens a cut tool reply's rendering may add over its cap: the cut marker and token merges at its two edges."""


CUDA_WORKSPACE_BYTES = 4 * 32 * 2**20
"""Device bytes of cuBLAS's and cuBLASLt's workspaces on a GPU node, which torch takes from its caching allocator (so
``torch.cuda.max_memory_allocated`` counts them): 32 MiB each on Hopper, per handle, and a node's training and
rollout use up to two handles."""


def _size(n: int | float) -> str:
    """``2.24 GB`` from 1 GB up, else ``3.6 MB``."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


class DeviceMemoryError(RuntimeError):
    """The plan does not fit the device: the message is one line naming the need, the free memory and what fits."""


_SHAPES: dict[tuple[str, str | None], ModelShape] = {}  # model_shape's results by (config JSON, [lora] JSON)


def model_shape(model_config: Any, lora: LoraSection | None = None) -> ModelShape:
    """Count a model's parameters from its ``transformers`` config, built on the ``meta`` device (and wrapped with
    peft's LoRA when ``lora`` is given, so the adapter count is peft's own).

    Building an 8B model on ``meta`` takes seconds, and a refusal plans several alternatives of one model, so the
    result is kept per (config, ``lora``) for the process.

    Args:
        model_config: a ``transformers.PretrainedConfig`` of a causal LM.
        lora: the run's ``[lora]`` section, or None for full fine-tuning.
    Raises:
        composer_diloco.policy.lora.LoraError: ``lora.target_modules`` matches no module.
    """
    key = (model_config.to_json_string(use_diff=False), None if lora is None else lora.model_dump_json())
    if key not in _SHAPES:
        _SHAPES[key] = _count_shape(model_config, lora)
    return _SHAPES[key]


def _count_shape(model_config: Any, lora: LoraSection | None) -> ModelShape:
    """`model_shape` without the cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from composer_diloco.policy.precision import bf16_linear_params

    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # no memory, and the caller's RNG untouched
        model = AutoModelForCausalLM.from_config(model_config)
        total = sum(p.numel() for p in model.parameters())
        trainable = total
        largest = max(p.numel() for p in model.parameters())
        linear = sum(p.numel() for p in bf16_linear_params(model, frozen_only=False))
        frozen_linear = 0
        if lora is not None:
            from composer_diloco.policy.lora import apply_lora

            model = apply_lora(model, lora)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            largest = max(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            frozen_linear = sum(p.numel() for p in bf16_linear_params(model))
    text = getattr(model_config, "text_config", None) or model_config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0))
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    return ModelShape(total, trainable, int(text.num_hidden_layers), hidden,
                      int(getattr(text, "intermediate_size", 4 * hidden)), int(text.vocab_size),
                      q_dim=heads * head_dim or hidden, kv_dim=kv_heads * head_dim or hidden, largest_trainable=largest,
                      lora=lora is not None, linear=linear, frozen_linear=frozen_linear)


# -- rows ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowBound:
    """The longest row (prompt + episode, in tokens) a run can produce, as planned (`row_bound`).

    Attributes:
        tokens: the planned row length, tokens.
        prompt: the prompt bound used (tokens), or None when the plan could not bound the prompt.
        completion: the completion bound (turns, tool replies and their template tokens), or None when a tool reply is
            not capped (``[env] max_tool_reply_tokens`` unset) and ``max_tool_calls`` > 1.
        source: how ``tokens`` was reached, for the log.
    """

    tokens: int
    prompt: int | None
    completion: int | None
    source: str


def row_bound(config: RunConfig, *, prompt_tokens: int | None = None,
              reply_scaffold_tokens: int | None = None) -> RowBound:
    """The longest row of ``config``'s episodes: ``min(max_seq_len, prompt + max_tool_calls * max_turn_tokens +
    (max_tool_calls - 1) * (max_tool_reply_tokens + scaffold + REPLY_SLACK))``.

    A tool reply is appended only when it and the next turn fit ``max_seq_len`` (the episode ends otherwise:
    `play_episodes`), so a row passes ``max_seq_len`` only when the prompt and the first turn already do; the rollout
    cuts a reply to ``[env] max_tool_reply_tokens`` tokens when it is set. Without that cap (and more than one turn),
    or without a prompt bound, the row is ``max_seq_len``.

    Args:
        config: the run config (``max_seq_len``, ``[env] max_tool_calls``, ``max_turn_tokens``,
            ``max_tool_reply_tokens``).
        prompt_tokens: a bound of the episodes' prompts (chat template, tools, task text), or None (unknown).
        reply_scaffold_tokens: the chat template's tokens around one tool reply and the next assistant header
            (`reply_scaffold`), or None (unknown).
    Returns:
        The `RowBound`.
    """
    env, cap = config.env, config.max_seq_len
    turns, turn = env.max_tool_calls, env.max_turn_tokens
    reply = env.max_tool_reply_tokens
    if turns == 1:
        completion = turn
    elif reply is None or reply_scaffold_tokens is None:
        completion = None
    else:
        completion = turns * turn + (turns - 1) * (reply + reply_scaffold_tokens + REPLY_SLACK)
    if prompt_tokens is None:
        return RowBound(cap, None, completion, f"max_seq_len {cap} (the prompt is not bounded before the first reset)")
    if completion is None:
        return RowBound(cap, prompt_tokens, None, f"max_seq_len {cap} (tool replies not capped: [env] "
                                                  "max_tool_reply_tokens unset)")
    longest = prompt_tokens + completion
    if prompt_tokens + turn > cap:  # the first turn is generated whatever max_seq_len says
        return RowBound(prompt_tokens + turn, prompt_tokens, completion,
                        f"prompt {prompt_tokens} + one turn {turn}, over max_seq_len {cap}")
    parts = f"prompt {prompt_tokens} + {turns} x {turn} turn" + (
        f" + {turns - 1} x ({reply} + {reply_scaffold_tokens + REPLY_SLACK}) reply" if turns > 1 else "")
    if longest >= cap:
        return RowBound(cap, prompt_tokens, completion, f"max_seq_len {cap} (under {parts} = {longest})")
    return RowBound(longest, prompt_tokens, completion, parts)


def reply_scaffold(tokenizer: Any) -> int:
    """Tokens the chat template renders around one empty tool reply, the next assistant header included
    (`composer_diloco.rollout.episode_tokens.tool_suffix_ids`).

    Raises:
        ValueError: the template's rendering is not prefix-stable.
    """
    from composer_diloco.rollout.episode_tokens import tool_suffix_ids

    return len(tool_suffix_ids(tokenizer, [{"role": "tool", "name": "tool", "content": ""}]))


def prompt_tokens(config: RunConfig, tokenizer: Any) -> tuple[int | None, str]:
    """A bound of the run's prompts before any env is reset: the longest of `PROMPT_SAMPLES` demonstrations of the
    env package (``demos.demonstration``: question and tools, rendered with ``tokenizer``'s chat template as an
    episode's prompt is), times `PROMPT_MARGIN`, plus `PROMPT_SLACK` tokens.

    Args:
        config: the run config (``[env] server_module``, ``seed``; ``[tasks]``).
        tokenizer: the policy's tokenizer.
    Returns:
        ``(tokens, how)``; tokens None (unknown) with a ``[tasks]`` dataset (its prompts are the rows'), an env
        package that is not importable here or has no demonstrations, or a template that fails to render them.
    """
    if config.tasks.path is not None:
        return None, "a [tasks] dataset's prompts"
    from composer_diloco.rollout.env_package import EnvPackageError, load_env_package

    try:
        package = load_env_package(config.env.server_module)
    except (EnvPackageError, ImportError) as e:
        return None, f"env package not importable here ({e})"
    if package.demonstration is None:
        return None, f"{package.package} has no demonstrations"
    longest = 0
    try:
        for index in range(PROMPT_SAMPLES):
            demo = package.demonstration(config.seed, index, 0.0)
            ids = tokenizer.apply_chat_template([{"role": "user", "content": demo.question}], tools=demo.tools,
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
            longest = max(longest, len(ids))
    except Exception as e:  # a template or a demonstration that fails is the env's or the model's own later error
        return None, f"demonstrations did not render ({type(e).__name__}: {e})"
    return math.ceil(longest * PROMPT_MARGIN) + PROMPT_SLACK, f"{PROMPT_SAMPLES} demonstrations: longest {longest}"


def plan_tokenizer(config: RunConfig) -> Any | None:
    """The policy's tokenizer from local files, for the row bound: the embedded default's for the run's env, or
    ``config.model``'s (a folder, or the Hub cache); None when it is not there."""
    try:
        if config.model is None:
            from composer_diloco.policy.load import load_embedded_tokenizer

            return load_embedded_tokenizer(config.env.server_module)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    except Exception:  # no tokenizer files here: the plan falls back to max_seq_len rows
        return None


@dataclass(frozen=True)
class PlanInputs:
    """What a plan needs from the tokenizer and the env before any model or env session exists (`plan_inputs`).

    Attributes:
        prompt_tokens: the prompt bound, or None (unknown); prompt_source: how it was found.
        reply_scaffold_tokens: the template's tokens around a tool reply, or None (unknown).
    """

    prompt_tokens: int | None = None
    prompt_source: str = ""
    reply_scaffold_tokens: int | None = None


def plan_inputs(config: RunConfig, tokenizer: Any | None = None) -> PlanInputs:
    """The prompt bound and the tool reply's template tokens of ``config`` (`prompt_tokens`, `reply_scaffold`),
    from ``tokenizer`` or, when None, the one `plan_tokenizer` finds; empty when no tokenizer is there."""
    tokenizer = tokenizer if tokenizer is not None else plan_tokenizer(config)
    if tokenizer is None:
        return PlanInputs(prompt_source="no local tokenizer")
    prompt, how = prompt_tokens(config, tokenizer)
    try:
        scaffold = reply_scaffold(tokenizer)
    except Exception:  # a template without tool messages: replies are not bounded, rows at max_seq_len
        scaffold = None
    return PlanInputs(prompt, how, scaffold)


# -- activations --------------------------------------------------------------------------------------------------
def decoder_bytes_per_token(shape: ModelShape, *, bf16: bool = False, gradient_checkpointing: bool = False) -> float:
    """Bytes the decoder keeps for backward per token of a row that trains (module docstring)."""
    q_dim, kv_dim = shape.q_dim or shape.hidden, shape.kv_dim or shape.hidden
    layer = (K_HIDDEN * shape.hidden + K_Q * q_dim + K_KV * kv_dim + K_FFN * shape.intermediate) * 4
    decoder = (shape.layers * shape.hidden * 4 + layer) if gradient_checkpointing else shape.layers * layer
    if shape.lora:
        decoder *= LORA_DECODER_SHARE
    if bf16:
        decoder *= BF16_DECODER_SHARE
    return decoder


def activation_bytes(shape: ModelShape, rows: int, seq_len: int, *, bf16: bool = False,
                     gradient_checkpointing: bool = False, channels: Sequence[ChannelMemory] = (),
                     device: str = "cpu") -> int:
    """Estimated peak bytes of one micro-batch's forward/backward above the state (module docstring, "Activations").

    The loss's forward runs GRPO, then each loss channel in registration order; backward runs them in the opposite
    order (autograd runs the later graph first). So the peak is the largest of: GRPO's rows with its fused LM head's
    tile (GRPO's head runs first in forward and last in backward); for each channel, every row up to it with what
    the earlier channels keep and its own peak (`ChannelMemory`); each plus backward's temporaries for one forward's
    rows.

    Args:
        shape: the model's sizes.
        rows: GRPO rows (the micro-batch's episodes); seq_len: every row's padded length in tokens.
        bf16: bf16 autocast (the decoder's share is ``BF16_DECODER_SHARE`` of fp32's).
        gradient_checkpointing: keep only each layer's input, recompute the rest in backward.
        channels: the loss channels that are on, in registration order (`LossChannel.memory`).
        device: ``cpu...`` or ``cuda...`` (how the fused LM head folds its tile: `K_TILE`).
    Raises:
        ValueError: a negative row count or a ``seq_len`` below 1.
    """
    if min([rows] + [c.rows for c in channels]) < 0 or seq_len < 1:
        raise ValueError(f"rows {rows}, channel rows {[c.rows for c in channels]}, seq_len {seq_len}: expected rows "
                         ">= 0 and seq_len >= 1")
    per_token = decoder_bytes_per_token(shape, bf16=bf16, gradient_checkpointing=gradient_checkpointing)
    backward = max([rows] + [c.backward_rows for c in channels]) * seq_len * \
        (3 * shape.hidden + 2 * shape.intermediate) * 4
    grpo = rows * seq_len * per_token
    # GRPO's fused head: its tile temporaries, and with full fine-tuning after another channel's backward the fresh
    # fp32 gradient of the (trainable) head it accumulates into the existing one
    tile = K_TILE["cuda" if device.startswith("cuda") else "cpu"] * 4 * min(rows * seq_len, FUSED_TOKEN_TILE) * \
        min(shape.vocab, FUSED_VOCAB_CHUNK) if rows else 0
    head = 4 * shape.vocab * shape.hidden if not shape.lora and any(c.rows for c in channels) else 0
    peaks, alive = [grpo + tile + head], grpo
    for c in channels:  # each channel's peak over what the earlier ones keep for backward
        own = c.rows * seq_len * per_token
        peaks.append(alive + own + c.peak)
        alive = alive + own + c.kept
    return int(max(peaks) + backward)


def rollout_bytes(shape: ModelShape, episodes: int, seq_len: int, turn_tokens: int, *, bf16: bool = False) -> int:
    """Bytes of one inner step's rollout above the state: the KV cache of ``episodes`` rows of ``seq_len`` tokens and
    a turn's ``K_SCORES`` sampling-score tensors (module docstring, "rollout")."""
    kv = 2 * shape.layers * (shape.kv_dim or shape.hidden) * (2 if bf16 else 4)
    return int(episodes * seq_len * kv + K_SCORES * episodes * turn_tokens * shape.vocab * 4)


# -- the plan -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """One node's memory plan, all figures in bytes (module docstring for the formulas).

    Attributes:
        shape: the model's sizes.
        device: where the policy trains (``cpu`` or ``cuda:N (name)``).
        micro_batch, grad_accum: ``--batch-size``, ``--grad-accum``.
        seq_len: tokens of every planned row (`row_bound`); row_source: how that length was reached.
        rows_grpo: a micro-batch's GRPO rows (its episodes).
        channels: what each loss channel that is on adds (`ChannelMemory`: its rows, model copy and phase), in
            registration order.
        episodes_per_step, turn_tokens: the rollout's batch and ``max_turn_tokens``.
        bf16, gradient_checkpointing: the node's ``--dtype bf16`` and gradient checkpointing.
        weights, gradients, optimizer, reference, activations: device bytes by item (``reference``: the model copies
            of TRL's GRPO reference and of the channels, e.g. DPO's).
        step_transient: AdamW's temporaries at the optimizer step: two of the largest trainable tensor on a CPU, a
            copy of every trainable tensor on a GPU (module docstring).
        workspace: a GPU's cuBLAS workspaces (`CUDA_WORKSPACE_BYTES`); 0 on a CPU.
        rollout: the rollout phase's bytes over the state (KV cache and sampling scores).
        host: host bytes of the outer loop (theta, pseudo-gradient, outer state, a state download's transients) and
            the process's own (`RUNTIME_HOST_BYTES`).
        host_model: host bytes of the policy as loaded (fp32, before it moves to a GPU; the device's own weights on
            a CPU node, already counted there).
        free: device bytes free when planned (None: unknown); for ``--device cpu`` the host's available RAM.
        free_source: where ``free`` came from (``torch.cuda.mem_get_info``, ``/proc/meminfo``, the env cap ...).
    """

    shape: ModelShape
    device: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    rows_grpo: int
    bf16: bool
    gradient_checkpointing: bool
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    step_transient: int
    host: int
    host_model: int
    rollout: int = 0
    channels: tuple[ChannelMemory, ...] = ()
    workspace: int = 0
    episodes_per_step: int = 0
    turn_tokens: int = 0
    row_source: str = ""
    free: int | None = None
    free_source: str = ""

    @property
    def rows(self) -> int:
        """A micro-batch's rows that train: GRPO's and every channel's (SDPO student, DPO chosen and rejected)."""
        return self.rows_grpo + sum(c.rows for c in self.channels)

    @property
    def on_cpu(self) -> bool:
        """True when the device is the host (one pool of RAM for everything)."""
        return self.device.startswith("cpu")

    @property
    def training_peak(self) -> int:
        """Bytes of one training step's peak over the persistent state: ``max(activations + gradients / 4, gradients
        + step_transient)``. Backward frees a layer's activations as it creates its gradients, so the two never
        add up in full (measured: a quarter of the gradients or less on top of the activations); AdamW's step holds
        every gradient plus its temporaries (``step_transient``)."""
        return max(self.activations + self.gradients // 4, self.gradients + self.step_transient)

    @property
    def phase_peak(self) -> int:
        """The largest of an inner step's phases over the state: rollout, training, and a channel's own (DPO's
        reference pass)."""
        return max([self.training_peak, self.rollout] + [c.phase for c in self.channels])

    @property
    def device_bytes(self) -> int:
        """Bytes the training state and an inner step's largest phase need on the device."""
        return self.weights + self.optimizer + self.reference + self.phase_peak + self.workspace

    @property
    def need(self) -> int:
        """Bytes that must fit in ``free``: the device bytes, plus the host bytes on a CPU node (same RAM)."""
        return self.device_bytes + (self.host if self.on_cpu else 0)

    @property
    def host_bytes(self) -> int:
        """Host RAM at its peak: the outer loop's buffers, plus the model as loaded (GPU node) or the device bytes
        (CPU node)."""
        return self.host + (self.device_bytes if self.on_cpu else self.host_model)

    @property
    def planned_peak(self) -> int:
        """What a round's measured peak (`PeakMemory`) compares with: the device bytes on a GPU (what
        ``torch.cuda.max_memory_allocated`` counts), the whole need on a CPU node (the process's resident set holds
        the outer loop too)."""
        return self.need if self.on_cpu else self.device_bytes

    def fits(self) -> bool:
        """True when ``free`` is unknown or at least `need`."""
        return self.free is None or self.need <= self.free

    def rows_text(self) -> str:
        """``4 GRPO + 4 SDPO + 4 DPO rows x 530 tokens`` (channels that are off left out)."""
        parts = [f"{self.rows_grpo} GRPO"] + [f"{c.rows} {c.label}" for c in self.channels if c.rows]
        return f"{' + '.join(parts)} rows x {self.seq_len} tokens"

    def describe(self) -> str:
        """One log line with every figure, e.g. ``memory plan on cuda:0: 12.3 GB device = weights 2.4 + ...``."""
        mode = f"LoRA ({self.shape.params_trainable:,} of {self.shape.params_total:,} parameters train)" \
            if self.shape.lora else f"full fine-tuning ({self.shape.params_total:,} parameters)"
        free = "free unknown" if self.free is None else f"{_size(self.free)} free ({self.free_source})"
        phases = "".join(f"; {c.phase_label} {_size(c.phase)}" for c in self.channels if c.phase_label)
        return (f"memory plan on {self.device}, {mode}: device {_size(self.device_bytes)} = weights "
                f"{_size(self.weights)} + AdamW {_size(self.optimizer)} + reference {_size(self.reference)} + "
                f"{f'cuBLAS workspaces {_size(self.workspace)} + ' if self.workspace else ''}the "
                f"largest phase {_size(self.phase_peak)} (training {_size(self.training_peak)}: gradients "
                f"{_size(self.gradients)}, activations {_size(self.activations)} for {self.rows_text()}, "
                f"micro-batch {self.micro_batch} x {self.grad_accum}, "
                f"{'bf16' if self.bf16 else 'fp32'}{', gradient checkpointing' if self.gradient_checkpointing else ''}"
                f"; rollout {_size(self.rollout)}: {self.episodes_per_step} episodes"
                f"{phases}); rows: {self.row_source or f'{self.seq_len} tokens'}; host "
                f"{_size(self.host_bytes)} (outer loop and process {_size(self.host)}); {free}")


def plan_memory(shape: ModelShape, *, micro_batch: int, grad_accum: int = 1, seq_len: int, device: str = "cpu",
                bf16: bool = False, gradient_checkpointing: bool = False,
                channels: Sequence[ChannelMemory] | Callable[[StepShape], Sequence[ChannelMemory]] = (),
                grpo_reference: bool = False, outer_state_tensors: int = 1, local_state_tensors: int = 0,
                turn_tokens: int | None = None, row_source: str = "", free: int | None = None,
                free_source: str = "") -> MemoryPlan:
    """The plan for one node (module docstring for each formula).

    Args:
        shape: the model's sizes (`model_shape`).
        micro_batch: episodes per forward/backward (``--batch-size``); grad_accum: micro-batches per step.
        seq_len: tokens per row (`row_bound`).
        device: the device's name, for the log; ``cpu...`` makes host and device one pool.
        bf16, gradient_checkpointing: the node's precision and checkpointing.
        channels: the loss channels that are on (`ChannelMemory`, in registration order), or a function of the
            step's sizes that gives them (`channel_memory`); () = GRPO alone.
        grpo_reference: TRL keeps a GRPO KL reference (``[grpo] beta > 0``; full fine-tuning: another copy).
        outer_state_tensors: tensors of theta's size the outer optimizer keeps (SGD momentum 1, Adam 2, averaging 0):
            part of the run's state, so a resync downloads them again.
        local_state_tensors: theta-sized tensors a node keeps for itself and never downloads (the sparse codec's
            error feedback and its next value: 2).
        turn_tokens: tokens per assistant turn (``max_turn_tokens``: the SDPO/DPO response rows and each sampling
            turn); None: ``seq_len``.
        row_source: how ``seq_len`` was reached, for the log.
        free, free_source: the device's free bytes and where they came from (`device_free_bytes`).
    Raises:
        ValueError: a non-positive micro_batch, grad_accum or seq_len.
    """
    if micro_batch < 1 or grad_accum < 1 or seq_len < 1:
        raise ValueError(f"micro_batch {micro_batch}, grad_accum {grad_accum}, seq_len {seq_len}: expected >= 1")
    turn = seq_len if turn_tokens is None else turn_tokens
    if callable(channels):
        channels = channels(StepShape(shape=shape, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len,
                                      response_tokens=min(turn, seq_len), bf16=bf16))
    p, t = shape.params_total, shape.params_trainable
    on_cpu = device.startswith("cpu")
    # bf16 (`composer_diloco.policy.precision`): frozen linear weights take 2 bytes, the LoRA base's and a channel's
    # reference copy's; TRL's own GRPO reference is loaded by TRL (4 P)
    weights = 4 * p - (2 * shape.frozen_linear if bf16 else 0)
    grpo_copy = 0 if shape.lora or not grpo_reference else 4 * p
    episodes = micro_batch * grad_accum
    return MemoryPlan(
        shape=shape, device=device, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len,
        rows_grpo=micro_batch, channels=tuple(channels), bf16=bf16, gradient_checkpointing=gradient_checkpointing,
        weights=weights, gradients=4 * t, optimizer=8 * t, reference=sum(c.copy for c in channels) + grpo_copy,
        activations=activation_bytes(shape, micro_batch, seq_len, bf16=bf16,
                                     gradient_checkpointing=gradient_checkpointing, channels=channels, device=device),
        # torch's AdamW: single-tensor on a CPU, foreach (a copy of every trainable tensor) on a GPU
        step_transient=2 * 4 * shape.largest_trainable if on_cpu else 4 * t,
        workspace=0 if on_cpu else CUDA_WORKSPACE_BYTES,
        rollout=rollout_bytes(shape, episodes, seq_len, turn, bf16=bf16),
        episodes_per_step=episodes, turn_tokens=turn, row_source=row_source,
        # theta, the pseudo-gradient buffer, the outer state, the node's own state (error feedback), and a resync's
        # download buffers (theta + outer state)
        host=4 * t * (2 + outer_state_tensors + local_state_tensors + 1 + outer_state_tensors) + RUNTIME_HOST_BYTES,
        host_model=4 * p,
        free=free,
        free_source=free_source)


def channel_memory(config: RunConfig) -> Callable[[StepShape], list[ChannelMemory]]:
    """The run's loss channels that are on (weight > 0), as a function of the step's sizes giving what each adds to
    the plan (`composer_diloco.channels.base.LossChannel.memory`, in registration order). Imports the channels."""
    from composer_diloco.channels.base import registered_channels

    on = [(c, c.settings_type.of(config.loss)) for c in registered_channels()]
    on = [(c, settings) for c, settings in on if settings.weight > 0]
    return lambda step: [c.memory(settings, config, step) for c, settings in on]


def _outer_state_tensors(config: RunConfig) -> int:
    """Theta-sized tensors of the run's outer optimizer state, counted on the optimizer itself (any torch.optim class
    or dotted path: `composer_diloco.outer.global_model.state_tensors_per_parameter`)."""
    from composer_diloco.outer.global_model import optimizer_factory, state_tensors_per_parameter

    return state_tensors_per_parameter(optimizer_factory(config.outer))


def plan_for_run(config: RunConfig, model_config: Any, *, micro_batch: int, grad_accum: int, device: str,
                 bf16: bool, gradient_checkpointing: bool, free: int | None, free_source: str = "",
                 lora: LoraSection | None | bool = True, inputs: PlanInputs | None = None) -> MemoryPlan:
    """`plan_memory` for a run config and a model config (what a node knows before it builds the model).

    Args:
        lora: True = the run's own ``[lora]``; a `LoraSection` or None to plan another choice (the refusal's hints).
        inputs: the prompt bound and the reply's template tokens (`plan_inputs`); None: unknown, rows of
            ``max_seq_len``.
    """
    section = config.lora if lora is True else (lora or None)
    shape = model_shape(model_config, section)
    inputs = inputs or PlanInputs()
    row = row_bound(config, prompt_tokens=inputs.prompt_tokens, reply_scaffold_tokens=inputs.reply_scaffold_tokens)
    return plan_memory(
        shape, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=row.tokens, device=device, bf16=bf16,
        gradient_checkpointing=gradient_checkpointing, channels=channel_memory(config),
        grpo_reference=config.grpo.beta > 0, outer_state_tensors=_outer_state_tensors(config),
        local_state_tensors=codec_entry(config.compression).local_state_tensors, turn_tokens=config.env.max_turn_tokens,
        row_source=row.source, free=free, free_source=free_source)


def refusal(plan: MemoryPlan, alternatives: list[tuple[str, MemoryPlan]]) -> str:
    """The one-line refusal: the need by item, the free memory, and the alternatives that would fit.

    Args:
        plan: the plan that does not fit.
        alternatives: ``(option text, plan)`` pairs; those whose plan fits are named with their need.
    """
    fitting = [f"{text} ({_size(alt.need)})" for text, alt in alternatives if alt.fits()]
    hint = ("would fit: " + "; ".join(fitting)) if fitting else \
        "nothing tried fits (--batch-size 1 with --gradient-checkpointing and [lora] r = 16 included): use a " \
        "device with more memory or a smaller model"
    where = "host RAM" if plan.on_cpu else "device memory"
    return (f"not enough {where} on {plan.device}: the memory plan needs {_size(plan.need)} (weights "
            f"{_size(plan.weights)} + AdamW {_size(plan.optimizer)} + reference {_size(plan.reference)} + step peak "
            f"{_size(plan.phase_peak)} (gradients {_size(plan.gradients)}, activations {_size(plan.activations)} at "
            f"--batch-size {plan.micro_batch} x {plan.seq_len} tokens"
            f"{' with gradient checkpointing' if plan.gradient_checkpointing else ''}"
            f"{'' if plan.phase_peak == plan.training_peak else '; the rollout or the DPO reference pass is larger'})"
            f"{' + outer loop and process ' + _size(plan.host) if plan.on_cpu else ''}), "
            f"{_size(plan.free)} free ({plan.free_source}); {hint}")


def _check_host(plan: MemoryPlan, host_free: int | None) -> None:
    """Raise the one-line host refusal of a GPU node whose host RAM cannot hold the outer loop and the model as
    loaded."""
    if not plan.on_cpu and host_free is not None and plan.host_bytes > host_free:
        raise DeviceMemoryError(
            f"not enough host RAM beside {plan.device}: the memory plan needs {_size(plan.host_bytes)} on the host "
            f"(the model as loaded {_size(plan.host_model)} + the outer loop's fp32 theta, pseudo-gradient and "
            f"optimizer state and the process {_size(plan.host)}), {_size(host_free)} available; [lora] shrinks the "
            "outer loop to the adapters' size")


_LORA_16 = dict(r=16, lora_alpha=32, target_modules="all-linear")


def check_plan(config: RunConfig, model_config: Any, *, micro_batch: int, grad_accum: int, device: str, bf16: bool,
               gradient_checkpointing: bool, free: int | None, free_source: str = "",
               host_free: int | None = None, inputs: PlanInputs | None = None) -> MemoryPlan:
    """Plan the node's memory for a batch the user chose and refuse, before it joins, a plan that does not fit
    ``free``.

    Args:
        config: the run config; model_config: its policy's ``transformers`` config.
        micro_batch, grad_accum: the node's batch (`nodes.device.NodeBatch`).
        device, bf16, gradient_checkpointing, free, free_source, inputs: as `plan_for_run`.
        host_free: available host RAM of a GPU node (None: not checked); a CPU node's ``free`` is its host RAM.
    Returns:
        the plan (it fits, or ``free`` is unknown).
    Raises:
        DeviceMemoryError: one line (`refusal`) naming the need, the free bytes, and which of a smaller
            ``--batch-size`` (with ``--grad-accum`` keeping the episodes per step), ``--gradient-checkpointing`` and
            ``[lora] r = 16`` would fit; or, on a GPU node, one line naming the host bytes (the outer loop's fp32
            buffers and the model as loaded) and the available host RAM.
    """
    kw = dict(device=device, bf16=bf16, free=free, free_source=free_source, inputs=inputs)
    plan = plan_for_run(config, model_config, micro_batch=micro_batch, grad_accum=grad_accum,
                        gradient_checkpointing=gradient_checkpointing, **kw)
    _check_host(plan, host_free)
    if plan.fits():
        return plan
    episodes = micro_batch * grad_accum
    alternatives = []
    for b in range(micro_batch - 1, 0, -1):  # the largest smaller micro-batch that keeps whole steps
        if episodes % b == 0:
            alt = plan_for_run(config, model_config, micro_batch=b, grad_accum=episodes // b,
                               gradient_checkpointing=gradient_checkpointing, **kw)
            if alt.fits():
                alternatives.append((f"--batch-size {b} --grad-accum {episodes // b}", alt))
                break
    if not gradient_checkpointing:
        alternatives.append(("--gradient-checkpointing", plan_for_run(
            config, model_config, micro_batch=micro_batch, grad_accum=grad_accum, gradient_checkpointing=True, **kw)))
    from composer_diloco.config import LoraSection

    lora_16 = LoraSection(**_LORA_16)
    if config.lora is None:
        alternatives.append(("[lora] r = 16 (all-linear)", plan_for_run(
            config, model_config, micro_batch=micro_batch, grad_accum=grad_accum,
            gradient_checkpointing=gradient_checkpointing, lora=lora_16, **kw)))
    if not any(a.fits() for _, a in alternatives):  # the most frugal combination, as the last resort
        alt = plan_for_run(config, model_config, micro_batch=1, grad_accum=episodes, gradient_checkpointing=True,
                           lora=config.lora or lora_16, **kw)
        alternatives.append((f"--batch-size 1 --grad-accum {episodes} --gradient-checkpointing"
                             f"{' with [lora] r = 16' if config.lora is None else ''}", alt))
    raise DeviceMemoryError(refusal(plan, alternatives))


@dataclass(frozen=True)
class BatchChoice:
    """The micro-batch a node picked itself (`choose_batch`).

    Attributes:
        micro_batch, grad_accum: the choice; their product is the run's episodes per step.
        gradient_checkpointing: whether the choice needs it (or the user asked for it).
        plan: the chosen batch's plan.
        reason: one line for the log: the choice and why (which larger batch did not fit, by how much).
    """

    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    plan: MemoryPlan
    reason: str


def choose_batch(config: RunConfig, model_config: Any, *, device: str, bf16: bool, gradient_checkpointing: bool,
                 free: int | None, free_source: str = "", host_free: int | None = None,
                 inputs: PlanInputs | None = None) -> BatchChoice:
    """The largest micro-batch b that divides the run's episodes per step E (``tasks_per_step * num_generations``,
    unchanged: gradient accumulation K = E / b makes up the step) and whose plan fits ``free``: first without gradient
    checkpointing, then, if none fits, with it (turned on). With ``gradient_checkpointing`` (the user's
    ``--gradient-checkpointing``) only with it. With ``free`` unknown: b = E.

    Args:
        config, model_config, device, bf16, free, free_source, host_free, inputs: as `check_plan`.
        gradient_checkpointing: the user asked for it.
    Returns:
        The `BatchChoice`.
    Raises:
        DeviceMemoryError: micro-batch 1 with gradient checkpointing does not fit (one line, `refusal`, naming ``[lora]
            r = 16`` when it would fit); or the host refusal of a GPU node (`check_plan`).
    """
    episodes = config.batch_size
    kw = dict(device=device, bf16=bf16, free=free, free_source=free_source, inputs=inputs)
    sizes = [b for b in range(episodes, 0, -1) if episodes % b == 0]
    tried: list[MemoryPlan] = []
    for checkpointing in ((True,) if gradient_checkpointing else (False, True)):
        for b in sizes:
            plan = plan_for_run(config, model_config, micro_batch=b, grad_accum=episodes // b,
                                gradient_checkpointing=checkpointing, **kw)
            if not tried:
                _check_host(plan, host_free)
            tried.append(plan)
            if plan.fits():
                return BatchChoice(b, episodes // b, checkpointing, plan, _why(plan, tried, gradient_checkpointing))
    last = tried[-1]  # micro-batch 1 with gradient checkpointing
    alternatives = []
    if config.lora is None:
        from composer_diloco.config import LoraSection

        alternatives.append((f"--batch-size 1 --grad-accum {episodes} --gradient-checkpointing with [lora] r = 16",
                             plan_for_run(config, model_config, micro_batch=1, grad_accum=episodes,
                                          gradient_checkpointing=True, lora=LoraSection(**_LORA_16), **kw)))
    raise DeviceMemoryError(refusal(last, alternatives))


def _why(chosen: MemoryPlan, tried: list[MemoryPlan], asked_checkpointing: bool) -> str:
    """The choice's log line: the batch, then the run's micro-batch's need and shortfall when it did not fit."""
    head = (f"micro-batch {chosen.micro_batch} x --grad-accum {chosen.grad_accum} = {chosen.episodes_per_step} "
            f"episodes per step{' with gradient checkpointing' if chosen.gradient_checkpointing else ''}")
    if chosen.free is None:
        return f"{head}: free memory unknown, the run's micro-batch"
    if len(tried) == 1:
        return f"{head}: the run's micro-batch fits ({_size(chosen.need)} of {_size(chosen.free)} free)"
    first = tried[0]
    parts = [f"--batch-size {first.micro_batch}{' with gradient checkpointing' if asked_checkpointing else ''} "
             f"needs {_size(first.need)}, {_size(first.free)} free ({first.free_source}): "
             f"{_size(first.need - first.free)} short"]
    if chosen.gradient_checkpointing and not asked_checkpointing:
        smallest = [p for p in tried if not p.gradient_checkpointing][-1]
        parts.append(f"without gradient checkpointing even --batch-size {smallest.micro_batch} needs "
                     f"{_size(smallest.need)}: gradient checkpointing turned on")
    parts.append(f"this one needs {_size(chosen.need)}")
    return f"{head}, chosen: {'; '.join(parts)}"


# -- free memory and the measured peak ----------------------------------------------------------------------------
def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_free_bytes(device: str) -> tuple[int | None, str]:
    """Free bytes on the node's device, and where the figure came from.

    ``$COMPOSER_DILOCO_DEVICE_MEMORY_BYTES`` (an integer) caps it (simulates a smaller device); otherwise CUDA:
    ``torch.cuda.mem_get_info()[0]`` of the current device; CPU: the host's available RAM (psutil's
    ``virtual_memory().available``, else ``MemAvailable`` of ``/proc/meminfo``; None when neither is readable).

    Raises:
        ValueError: the environment variable is not a positive integer (one line naming its value).
    """
    cap_text = os.environ.get(DEVICE_MEMORY_ENV, "").strip()
    cap = None
    if cap_text:
        try:
            cap = int(float(cap_text))  # "24000000000" or "24e9"
        except ValueError:
            cap = 0
        if cap <= 0:
            raise ValueError(f"${DEVICE_MEMORY_ENV}={cap_text!r}: expected a positive number of bytes")
    free, source = None, ""
    if device.startswith("cuda"):
        import torch

        free, source = int(torch.cuda.mem_get_info()[0]), "torch.cuda.mem_get_info"
    else:
        try:
            import psutil

            free, source = int(psutil.virtual_memory().available), "available host RAM (psutil)"
        except ImportError:
            free, source = _meminfo_available(), "available host RAM (/proc/meminfo)"
    if cap is not None and (free is None or cap < free):
        return cap, f"capped by ${DEVICE_MEMORY_ENV}"
    return free, source


def proc_status_bytes(field: str) -> int | None:
    """``VmRSS:`` / ``VmHWM:`` of ``/proc/self/status`` in bytes, or None where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """The process's peak memory on the policy's device between two `take` calls: what a round's metrics line holds
    as ``memory_peak_bytes``, next to the plan's `MemoryPlan.planned_peak`.

    CUDA: ``torch.cuda.max_memory_allocated()`` of the current device, reset by ``torch.cuda.reset_peak_memory_stats()``
    (tensors only: the CUDA context and the caching allocator's unused reserve, which ``nvidia-smi`` shows, are not in
    it, nor in the plan). CPU: the growth of the process's peak resident set (``VmHWM``, reset by writing ``5`` to
    ``/proc/self/clear_refs``) over its resident set when this object was made: made before the policy is built
    (`nodes.node.Node.plan_memory`), so the interpreter and the libraries (torch, transformers, hivemind: ~0.5-1 GB)
    are left out and the weights, the training state, the outer loop's buffers and an inner step's activations are
    in, as in the plan's need. Freed memory that glibc keeps for reuse stays in the resident set, so a CPU figure
    can exceed what the tensors alone held.

    Args:
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
    """

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.baseline = 0 if self.cuda else (proc_status_bytes("VmRSS:") or 0)
        self.available = True
        self.reset()

    def reset(self) -> None:
        """Start a new interval (`take` resets too); on a CPU where ``/proc/self/clear_refs`` cannot be written, the
        peak is not available (`take` returns None)."""
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.available = False

    def take(self) -> int | None:
        """The peak bytes since the last `reset` or `take` (None where it cannot be measured), then reset."""
        if self.cuda:
            import torch

            peak: int | None = int(torch.cuda.max_memory_allocated())
        else:
            hwm = proc_status_bytes("VmHWM:")
            peak = None if hwm is None or not self.available else max(0, hwm - self.baseline)
        self.reset()
        return peak


def round_memory(plan: MemoryPlan | None, peak_bytes: int | None, stats: Any) -> tuple[dict[str, Any], list[str]]:
    """A round's memory fields of a node's metrics line, and the warnings the round gives about its plan.

    Args:
        plan: the node's plan (None: not planned).
        peak_bytes: the measured peak since the previous line (`PeakMemory.take`; None: not measured).
        stats: the round's `composer_diloco.inner.step.RoundStats` (``longest_episode_tokens``, ``samples``,
            ``channel_stats``).
    Returns:
        ``({"memory_peak_bytes", "memory_planned_bytes", "episode_tokens_max"}, warnings)``: the planned figure is
        `MemoryPlan.planned_peak` (None without a plan); a warning (one line each) when the peak passed the plan,
        an episode was longer than the planned rows, or a channel counted more rows than episodes where the plan
        assumes one per episode (`ChannelMemory.count_key`: SDPO's sites).
    """
    longest = int(stats.longest_episode_tokens)
    fields = {"memory_peak_bytes": peak_bytes, "memory_planned_bytes": None if plan is None else plan.planned_peak,
              "episode_tokens_max": longest}
    if plan is None:
        return fields, []
    warnings = []
    if peak_bytes is not None and peak_bytes > plan.planned_peak:
        warnings.append(f"measured memory peak {_size(peak_bytes)} passed the memory plan's {_size(plan.planned_peak)}")
    if longest > plan.seq_len:
        warnings.append(f"an episode of {longest} tokens is longer than the memory plan's rows of {plan.seq_len} "
                        f"({plan.row_source}): the plan may be short")
    for c in plan.channels:
        if c.count_key is None:
            continue
        count = getattr(stats.channel_stats.get(c.name), c.count_key, 0)
        if c.rows and count > stats.samples:
            warnings.append(f"{c.label} found {count} {c.count_key.removeprefix(c.name + '_')} in {stats.samples} "
                            "episodes: the memory plan assumes one per episode and may be short")
    return fields, warnings
