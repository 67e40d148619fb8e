"""The sizes a memory plan is made of, shared by the plan (`composer_diloco.policy.memory_plan`) and the loss
channels that declare their own rows (`composer_diloco.channels.base.LossChannel.memory`): a model's sizes
(`ModelShape`), one inner step's (`StepShape`), and what a channel adds (`ChannelMemory`). Plain dataclasses: no
torch, no other module of the project.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChannelMemory", "ModelShape", "StepShape"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the plan needs, read from a model config (built on the ``meta`` device: no memory, no download).

    Attributes:
        params_total: parameters of the policy, tied tensors once (P).
        params_trainable: parameters that train (T): all of them, or the LoRA adapters.
        layers, hidden, intermediate, vocab: the decoder's sizes.
        q_dim, kv_dim: heads x head_dim and kv_heads x head_dim (hidden and hidden when the config has no such field).
        largest_trainable: elements of the largest trainable tensor (the embedding with full fine-tuning).
        lora: whether ``params_trainable`` counts adapters.
        linear: elements of the weights only linear layers use (not a tied embedding): what a bf16 node stores in
            bf16 when they are frozen (`composer_diloco.policy.precision.bf16_linear_params`).
        frozen_linear: those of them frozen in this mode (the LoRA base's; 0 with full fine-tuning).
    """

    params_total: int
    params_trainable: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    q_dim: int = 0
    kv_dim: int = 0
    largest_trainable: int = 0
    lora: bool = False
    linear: int = 0
    frozen_linear: int = 0


@dataclass(frozen=True)
class StepShape:
    """The sizes a loss channel's memory rows depend on (`composer_diloco.channels.base.LossChannel.memory`).

    Attributes:
        shape: the model's sizes.
        micro_batch: GRPO rows (episodes) per micro-batch; grad_accum: micro-batches per optimizer step.
        seq_len: every row's planned length in tokens (`row_bound`).
        response_tokens: tokens per SDPO/DPO response row whose vocab-sized tensors are kept (``max_turn_tokens``,
            at most ``seq_len``).
        bf16: bf16 autocast (logits in bf16).
    """

    shape: ModelShape
    micro_batch: int
    grad_accum: int
    seq_len: int
    response_tokens: int
    bf16: bool = False

    @property
    def logit_bytes(self) -> int:
        """Bytes of one logit as the forward returns it: 2 under bf16, else 4."""
        return 2 if self.bf16 else 4

    @property
    def vocab_row(self) -> int:
        """Bytes of one row's fp32 response logits, ``4 * vocab * response_tokens``."""
        return 4 * self.shape.vocab * self.response_tokens


@dataclass(frozen=True)
class ChannelMemory:
    """What one loss channel adds to a node's memory plan, in bytes (`composer_diloco.policy.memory_plan`).

    The loss's forward runs GRPO, then each channel in registration order; backward runs them in the opposite
    order. So at a channel's peak every earlier channel's ``kept`` bytes are still alive, and the micro-batch's
    activations peak at the largest of those sums (`composer_diloco.policy.memory_plan.activation_bytes`).

    Attributes:
        name: the channel's registry name (``"sdpo"``); label: its name in the plan's log line (``"SDPO"``).
        rows: rows the channel adds to a micro-batch; each keeps the decoder's activations of ``seq_len`` tokens.
        backward_rows: rows of its largest single forward (backward's per-row temporaries).
        peak: bytes alive at its loss's peak beyond its rows' decoder activations (its logits, its loss's
            temporaries).
        kept: bytes of those it keeps for backward while later channels run.
        copy: device bytes of a model copy it keeps for the whole run (DPO's reference under full fine-tuning).
        phase: bytes of an inner-step phase of its own outside training, over the state (DPO's reference pass);
            phase_label: that phase's name in the log line.
        count_key: a key of its round stats planned at one per episode (``"sdpo_sites"``): a round that counts more
            gets a warning (`composer_diloco.policy.memory_plan.round_memory`); None when its rows are a bound it
            keeps itself.
    """

    name: str
    label: str
    rows: int
    backward_rows: int
    peak: float
    kept: float
    copy: int = 0
    phase: int = 0
    phase_label: str = ""
    count_key: str | None = None
