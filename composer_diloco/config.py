"""The run configuration: one pydantic model, read from TOML, published in the DHT by the coordinator.

Override order, highest first: a command-line flag, then the TOML file given with ``--config``, then the
defaults below (which run the embedded default: tiny model, shipped tokenizer, ``envs/tool_env``).
Every model forbids unknown keys, so a typo in a TOML file is an error that names the key (a ``[loss]`` key is
checked by the loss channel that declares it: `LossConfig`).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from composer_diloco.channels.settings import check_loss_keys, loss_settings
from composer_diloco.outer import outer_choice


class ConfigError(ValueError):
    """A run config that cannot be used: missing file, bad TOML, or a field with a bad value."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvConfig(_Section):
    """The OpenEnv environment each node plays episodes against."""

    server_module: str = Field(
        "envs.tool_env.server",
        description="Python module run as `python -m MODULE --host H --port P` to start a local env server.",
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="More command-line arguments of a node's own env server (`python -m MODULE --host H --port P "
                    "ARGS`), e.g. [\"--allow-weak-sandbox\"] for the coding env on a host where it cannot isolate "
                    "the model's code (it refuses to serve otherwise).",
    )
    max_tool_calls: int = Field(6, ge=1, le=64, description="Assistant turns per episode before it is cut off.")
    max_turn_tokens: int = Field(40, ge=4, le=4096, description="Tokens the policy may generate per assistant turn.")
    max_tool_reply_tokens: int | None = Field(
        None, ge=1, le=65536,
        description="Tokens of a tool reply the policy sees: a longer reply is cut to its first this many tokens and "
                    "' ...' (composer_diloco.rollout.play.play_episodes). None: not cut; an episode ends where a "
                    "reply and the next turn would pass max_seq_len. Set, it also bounds the rows the memory plan "
                    "plans (composer_diloco.policy.memory_plan.row_bound).",
    )
    connect_timeout_s: float = Field(30.0, gt=0, description="Seconds to wait for an env server to answer.")
    reset_kwargs: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Keywords every episode's reset passes to the env server, e.g. {source = \"generated\"} for the "
        "coding env (OpenEnv's reset(**kwargs)); seed, episode_id and max_tool_calls are the node's own.",
    )

    sessions_per_url: int | None = Field(
        None, ge=1,
        description="Most env sessions (episodes at once) a node opens on each env server; the other episodes of an "
                    "inner step wait for a free session. None: as many as an inner step has episodes, fewer if the "
                    "server answers 'Server at capacity: n/n' (OpenEnv's MAX_CONCURRENT_ENVS). `--env-sessions` "
                    "overrides it per node.",
    )

    @model_validator(mode="after")
    def _own_reset_keys(self) -> "EnvConfig":
        taken = sorted({"seed", "episode_id", "max_tool_calls"} & set(self.reset_kwargs))
        if taken:
            raise ValueError(f"reset_kwargs must not set {', '.join(taken)}: the node sets them per episode")
        return self


class TasksConfig(_Section):
    """Tasks from a dataset instead of the env's reset: TRL's ``environment_factory`` convention (each episode's prompt
    is its row's prompt column; the env's ``reset(**row)`` gets the row's columns and supplies tools and reward).
    `composer_diloco.rollout.tasks` loads and splits it."""

    path: str | None = Field(
        None, description="A JSONL/JSON/Parquet/CSV file, a `save_to_disk` folder, or a `datasets` hub id; None: the "
                          "env's reset gives each episode's task text.",
    )
    split: str = Field("train", min_length=1, description="The split to read (`datasets.load_dataset(split=...)`).")
    prompt_column: str = Field(
        "prompt", min_length=1, description="Column of the task text: a string, or chat messages whose user "
                                            "contents are joined.",
    )
    reset_columns: list[str] | None = Field(
        None, description="Columns passed to the env's reset(**row); None: every column (TRL's reset(**row)), [] none.",
    )


class GRPOSettings(_Section):
    """GRPO settings handed to TRL's `GRPOConfig` (names follow TRL)."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = Field(
        "dapo", description="TRL GRPO loss variant."
    )
    num_generations: int = Field(4, ge=2, description="Episodes per task: the GRPO group size G.")
    tasks_per_step: int = Field(2, ge=1, description="Distinct tasks per inner step; batch = tasks_per_step * G.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the reference policy (0 = no reference model).")
    epsilon: float = Field(0.2, gt=0, description="Lower clip range of the importance ratio.")
    epsilon_high: float = Field(0.28, gt=0, description="Upper clip range (DAPO clip-higher).")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="Advantage scaling, as TRL.")


class LossConfig(BaseModel):
    """The composite inner loss's ``[loss]`` table: total = GRPO + sum over channels of weight_c * L_c.

    Every key belongs to the loss channel that declares it (`composer_diloco.channels.settings.ChannelSettings`, in the
    channel's own module): SDPO's ``alpha_sdpo`` and ``sdpo_*`` in `composer_diloco.channels.sdpo`, DPO's
    ``beta_dpo``, ``dpo_beta`` and ``dpo_score`` in `composer_diloco.channels.dpo`; a channel reads its own with
    ``Settings.of(config.loss)``. Both channels default off (BENCHMARKS.md 1c). A table that sets no key is checked
    without importing a channel (so reading the default config imports no torch); one that sets keys imports the
    channels (and torch) to check them, with the same one-line errors as any field, and keeps the keys that differ
    from their defaults (so two tables that mean the same compare equal). Published, it lists every channel's keys,
    set or default (`composer_diloco.channels.settings.loss_settings`).
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_validator(mode="wrap")
    @classmethod
    def _each_key_checked_by_its_channel(cls, data: Any, handler: Any) -> "LossConfig":
        if isinstance(data, dict) and data:
            data = check_loss_keys(data)  # by the channels that declare them (importing them, and torch)
        return handler(data)

    @model_serializer(mode="plain")
    def _every_channels_keys(self) -> dict[str, Any]:
        return loss_settings(self)


class PreferenceConfig(_Section):
    """Trace-replay DPO pairs: candidates compared at error sites by replaying the env (`composer_diloco.channels.dpo`)."""

    mode: Literal["exhaustive", "best_vs_worst"] = Field("best_vs_worst", description="How pairs form within a turn.")
    min_score_diff: float = Field(0.5, ge=0, description="Minimum score gap between chosen and rejected.")
    max_pairs_per_turn: int = Field(2, ge=1)
    max_sites: int = Field(4, ge=1, description="Error sites replayed per inner step.")
    teachers: list[str] = Field(
        default_factory=lambda: ["scripted"], description="Extra teacher policies proposing candidates."
    )


class InnerOptimizer(_Section):
    """AdamW, the inner optimizer; its state stays on the node across rounds (DiLoCo, arXiv 2311.08105)."""

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate (1e-3 collapses the tiny default policy within 2 steps).")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    journal_max_bytes: int = Field(
        1 << 30, ge=0, description="Bytes a step of the inner phase's journal may take (16 a trainable parameter: "
                                   "composer_diloco.inner.journal): a node's next life resumes the phase its last life "
                                   "was cut in, and re-sends the one whose round was averaged without it. Larger models "
                                   "are not journaled; 0 turns it off.")
    journal_max_stale_rounds: int = Field(
        2, ge=0, description="Outer steps a journaled phase may be behind the round the node's next life joins and "
                             "still be resumed (its progress is applied to that round's theta: a delayed update).")


# the outer optimizer's defaults and checks: composer_diloco.outer.outer_choice (torch-free), re-exported here
DELAYED_NESTEROV, DELAYED_NESTEROV_DEFAULT = outer_choice.DELAYED_NESTEROV, outer_choice.DELAYED_NESTEROV_DEFAULT
check_delayed_nesterov = outer_choice.check_delayed_nesterov


class OuterOptimizer(_Section):
    """DiLoCo's OuterOpt: any ``torch.optim`` optimizer over theta, stepped once per round with the mean
    pseudo-gradient as its gradient (`composer_diloco.outer.global_model`).

    Defaults, by the run's policy (`RunConfig`; BENCHMARKS.md 1d has the evidence):

    - the embedded default (``model`` unset): SGD with lr 1.0 and momentum 0.0, parameter averaging (BENCHMARKS.md
      sections 1a and 1d: nothing beat it beyond noise).
    - a ``model`` run whose ``[outer]`` section chooses nothing: Delayed Nesterov with DiLoCo's lr 0.7 and
      momentum 0.9, the momentum moved every 4 rounds (`composer_diloco.outer.delayed_nesterov`,
      ``DELAYED_NESTEROV_DEFAULT``; BENCHMARKS.md, "Which outer optimizer for RL?" and section 1d: plain Nesterov
      0.7 / 0.9 did not learn where it took 16-32 outer steps). Only the tiny policy was measured.
    - a section that sets SGD values: the unset ones are DiLoCo's (lr 0.7, momentum 0.9, Nesterov) for a model, 1.0
      / 0.0 for the embedded default; ``optimizer = "sgd"`` alone gives DiLoCo's SGD for a model.

    Another optimizer needs no code, e.g. ``optimizer = "adam"``, ``lr = 0.001``, ``kwargs = {betas = [0.9,
    0.95]}``.
    """

    optimizer: str = Field(
        "sgd", min_length=1,
        description="The outer optimizer: a torch.optim class name, any case (sgd, adam, adamw, nadam, radam, "
                    "rmsprop, adagrad ...), or a dotted path to a torch.optim.Optimizer subclass "
                    "(my_pkg.optim.Lion). Its state is checkpointed and shared with joining peers as its state_dict. "
                    "A --model run whose [outer] chooses nothing gets DELAYED_NESTEROV_DEFAULT.",
    )
    lr: float | None = Field(
        None, gt=0, description="Outer learning rate. SGD: 0.7 (DiLoCo) for a --model run, 1.0 for the embedded "
                                "default; any other optimizer: required (no default fits them all).",
    )
    momentum: float | None = Field(
        None, ge=0, lt=1, description="SGD only: outer (Nesterov) momentum; 0.9 (DiLoCo) unless set, 0.0 for the "
                                      "embedded default. Another optimizer's own arguments go in `kwargs`.",
    )
    nesterov: bool | None = Field(
        None, description="SGD only: Nesterov (true, DiLoCo, the default) or heavy-ball momentum; ignored at "
                          "momentum 0.",
    )
    kwargs: dict[str, float | int | bool | str | list[float] | None] = Field(
        default_factory=dict,
        description="Further keyword arguments of the optimizer's constructor, e.g. {betas = [0.9, 0.95], "
                    "weight_decay = 0.01} (arrays become tuples). foreach defaults to false (the same bytes on every "
                    "peer). Checked at load time by building the optimizer once.",
    )
    max_norm_ratio: float | None = Field(
        10.0, gt=1, description="Drop a pseudo-gradient whose norm exceeds this multiple of the round's median "
                                "(NaN/Inf ones are always dropped); null = no norm screening.",
    )
    overlap: bool = Field(
        False, description="Overlapped sync: a node's barrier, all-reduce and outer step of round t run in the "
                           "background while it trains round t+1; the new theta is folded in one round late "
                           "(x <- theta_{t+1} + (x' - x_t), `composer_diloco.outer.overlap`). Off by default until the "
                           "learning bench says otherwise.",
    )

    @property
    def is_sgd(self) -> bool:
        """True when the optimizer is torch's SGD (the one ``momentum`` and ``nesterov`` belong to)."""
        return outer_choice.is_sgd(self.optimizer)

    @model_validator(mode="before")
    @classmethod
    def _sgd_defaults(cls, data: object) -> object:
        """SGD's unset ``lr`` / ``momentum`` / ``nesterov`` become DiLoCo's 0.7 / 0.9 / true
        (`outer_choice.sgd_defaults`)."""
        if not isinstance(data, dict) or not outer_choice.is_sgd(data.get("optimizer", "sgd")):
            return data
        return outer_choice.sgd_defaults(data)

    @model_validator(mode="after")
    def _optimizer_builds(self) -> OuterOptimizer:
        if not self.is_sgd:
            if self.momentum is not None or self.nesterov is not None:
                raise ValueError(f"momentum and nesterov are SGD's: for optimizer {self.optimizer!r} put its own "
                                 "arguments in kwargs")
            if self.lr is None:
                raise ValueError(f"lr must be set for optimizer {self.optimizer!r} (0.7 / 1.0 are SGD's defaults)")
        reserved = {"lr", "params"} | ({"momentum", "nesterov"} if self.is_sgd else set())
        taken = sorted(reserved & set(self.kwargs))
        if taken:
            raise ValueError(f"kwargs must not set {', '.join(taken)}: they are fields of [outer] (or fixed)")
        outer_choice.check_outer(self)  # the optimizer's own arguments: one line, at load time
        return self


class NetworkConfig(_Section):
    """Timeouts and periods of the round protocol, all in seconds."""

    join_timeout_s: float = Field(30.0, gt=0, le=600, description="Seconds a node waits for the DHT and run config.")
    matchmaking_time_s: float = Field(2.0, gt=0, description="Seconds hivemind spends assembling an all-reduce group.")
    averaging_timeout_s: float = Field(
        45.0, gt=0, description="Seconds an all-reduce may take before it is abandoned, plus the time to move the "
                                "pseudo-gradient twice at state_min_rate_mb_s (`allreduce_timeout_s`).")
    round_slack_s: float = Field(
        120.0, gt=0, description="Seconds the first peer ready for a round waits for the others before it goes on."
    )
    round_budget_s: float | None = Field(
        None, gt=0, description="Wall seconds a node may spend in a round's inner phase: at the deadline it stops "
                                "after the current inner step and syncs with what it has (null = always H steps).",
    )
    round_ends_at_first_ready: bool = Field(
        False, description="Every node ends its inner phase at the first inner step after another node announced the "
                           "round ready: the fastest node's H steps set the round's length and the others sync with "
                           "the steps they have, weighted by their samples, so nobody waits at the barrier for a "
                           "straggler's last steps (false: every node trains H steps; a late joiner's first phase "
                           "ends so either way).",
    )
    join_grace_s: float = Field(
        30.0, ge=0, description="A node joining a round that started more than this many seconds ago waits for the "
                                "next round boundary instead of holding the others up.",
    )
    heartbeat_s: float = Field(2.0, gt=0, description="Seconds between heartbeats in the DHT.")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="A peer silent this many seconds is taken for dead.")
    state_chunk_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a state download (a join, a resync) waits for its next chunk, or a keepalive "
                                "of a peer still hashing its state, before it retries from the last byte received, "
                                "from that peer or another holding the same state (composer_diloco.outer.state_transfer).",
    )
    state_min_rate_mb_s: float = Field(
        10.0, gt=0, description="The slowest link a state download and an all-reduce are given time for: a "
                                "download's deadline is the start timeout plus the bytes to move at this many MB/s (a "
                                "node's --join-deadline overrides it), an all-reduce's is averaging_timeout_s plus its "
                                "pseudo-gradient's bytes twice. 10 MB/s gives Qwen3-0.6B's 7.2 GB of "
                                "full-fine-tuning state 12 minutes, and its 2.4 GB fp32 pseudo-gradient 480 s more.",
    )
    state_hold_s: float = Field(
        60.0, ge=0, description="Seconds an outer step waits for a state download in flight from this peer to end "
                                "before it moves theta under it (the downloader then starts over at the new round; "
                                "0 = never wait). torchft's checkpoint server makes its step wait for readers alike.",
    )

    def allreduce_timeout_s(self, delta_bytes: int) -> float:
        """Seconds one all-reduce of a ``delta_bytes``-byte pseudo-gradient may take: ``averaging_timeout_s`` plus
        the bytes each peer moves in the worst case (its reduce-scatter and its all-gather, each at most the whole
        uncompressed pseudo-gradient) at ``state_min_rate_mb_s``.

        A fixed 45 s was the length of Qwen3-0.6B's full-fine-tuning all-reduce on one H200 (44-45 s, shared/gpu-probe),
        so a real-size run abandoned rounds that were merely long; the embedded 0.9M model's 3.6 MB add 0.7 s."""
        return self.averaging_timeout_s + 2 * delta_bytes / (self.state_min_rate_mb_s * 1e6)

    @model_validator(mode="after")
    def _ttl_covers_heartbeats(self) -> NetworkConfig:
        if self.heartbeat_ttl_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"heartbeat_ttl_s={self.heartbeat_ttl_s} must be at least twice heartbeat_s={self.heartbeat_s}"
            )
        return self


_STATE_TRANSFER_KEYS = ("state_chunk_timeout_s", "state_min_rate_mb_s", "state_hold_s")


class WarmStartConfig(_Section):
    """The supervised pass that makes the embedded default earn reward from round 0."""

    steps: int = Field(200, ge=0, description="SFTTrainer steps on scripted-solver episodes (0 = no warm start).")
    seed: int = Field(0, description="Seed of the tiny model's init and of the warm-start data.")
    hint_rate: float = Field(
        0.0, ge=0, le=1,
        description="Share of the demonstrations with a failed call that also show the SDPO hint for it, as a user "
                    "message right before the recovery: what SDPO's teacher sees in training, so the policy learns to "
                    "read a hint (issue 40). The others stay hint-free, so the student is not taught to expect one. "
                    "0 = no hints: the warm start of runs written before it.",
    )


class LoraSection(_Section):
    """LoRA DiLoCo (Hu et al., "LoRA", arXiv 2106.09685, through Hugging Face ``peft``): present in a run config, every
    peer wraps the policy with ``peft.get_peft_model(model, peft.LoraConfig(...))`` and theta is the adapter tensors
    only (`composer_diloco.policy.lora`); absent, the run fine-tunes every weight. The fields are ``LoraConfig``'s,
    with its names, meanings and defaults."""

    r: int = Field(8, ge=1, description="LoRA rank (peft's `r`).")
    lora_alpha: int = Field(8, ge=1, description="LoRA scaling numerator: the update is scaled by lora_alpha / r.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch's input during training.")
    target_modules: list[str] | str | None = Field(
        None, description="Module names (or name suffixes) to adapt, a regex string, or 'all-linear'; None: peft's "
                          "default for the architecture (q_proj and v_proj for Qwen3).",
    )


class SparseCodecConfig(_Section):
    """Parameters of ``compression = "sparse-2bit"``: chunked top-k with 2-bit values and error feedback
    (SparseLoCo, arXiv 2508.15706; `composer_diloco.outer.sparse`). Every peer of a run uses the same."""

    topk_fraction: float = Field(
        1 / 64, gt=0, le=1,
        description="Share of each chunk's entries a node sends per round (k = ceil(share x chunk length), at least "
                    "1). 1/64 is SparseLoCo's ~1.5% density: k = 64 of a 4096-element chunk.",
    )
    chunk_elems: int = Field(4096, ge=64, le=2**24, description="Elements per top-k chunk (within one tensor).")
    error_decay: float = Field(
        1.0, ge=0, le=1,
        description="beta of the error feedback e <- beta e + Delta (1: nothing is lost; SparseLoCo tunes beta < 1 "
                    "to play the outer momentum it drops).",
    )


class ReportConfig(_Section):
    """Where every peer also sends its per-round metrics (`composer_diloco.report`): each peer is one run of the
    tracker, named after it, in one group (the run's name) of one project; the names are ``metrics.jsonl``'s, nested
    ones joined with ``/`` (``inner_phase_seconds/generation``), the step is the round. Off unless ``to`` names one."""

    to: list[Literal["trackio", "wandb"]] = Field(
        default_factory=list,
        description="Trackers: trackio (HF's local-first tracker: `pip install -e \".[trackio]\"`, its store is "
                    "$TRACKIO_DIR or ~/.cache/huggingface/trackio, its dashboard `trackio show`) and/or wandb "
                    "(`pip install wandb`; WANDB_MODE=offline needs no account). Empty: report nowhere.",
    )
    project: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,96}$",
        description="The tracker's project; None: the run's name (run_name).",
    )


class RunConfig(_Section):
    """Everything that must be the same on every peer of a run."""

    run_name: str = Field("composer", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="DHT key prefix of this run.")
    seed: int = Field(0, description="Seed of the env episodes and the samplers.")
    model: str | None = Field(
        None, description="Hub id or local directory of the policy; None = the embedded tiny default."
    )
    rounds: int = Field(3, ge=1, description="Outer steps (rounds) of the run.")
    inner_steps: int = Field(4, ge=1, description="H: inner optimizer steps per round.")
    max_seq_len: int = Field(1024, ge=64, description="Tokens of prompt plus episode kept per sample; at most the model's "
                             "positions (max_position_embeddings, checked before any network).")
    checkpoint_every: int = Field(1, ge=1, description="Rounds between coordinator checkpoints.")
    # "none": why, BENCHMARKS.md sections 2 and 3b (no codec has learned as well as none at N = 4, H = 16)
    compression: str = Field(
        "none", description="Codec of the pseudo-gradient all-reduce, by name (composer_diloco.outer.codecs): none, "
                            "fp16, int8 (hivemind's, in the butterfly), sparse-2bit (top-k + 2-bit values + error "
                            "feedback, all-gathered; its parameters in [sparse_codec]) or shared-blocks (block top-k "
                            "on a selection all peers share + error feedback, in the butterfly; [codec_options]).",
    )
    sparse_codec: SparseCodecConfig | None = Field(
        None, description="Parameters of compression = \"sparse-2bit\" (`SparseCodecConfig`); only with that codec.",
    )
    codec_options: dict[str, float | int | str] = Field(
        default_factory=dict, description="Settings of the chosen codec, checked by its own settings model "
                                          "(composer_diloco.outer.codecs; e.g. shared-blocks: block_elems, density, "
                                          "values, error_decay). Empty: its defaults.",
    )
    env: EnvConfig = EnvConfig()
    tasks: TasksConfig = TasksConfig()
    grpo: GRPOSettings = GRPOSettings()
    inner: InnerOptimizer = InnerOptimizer()
    outer: OuterOptimizer = OuterOptimizer()
    network: NetworkConfig = NetworkConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    loss: LossConfig = LossConfig()
    preference: PreferenceConfig = PreferenceConfig()
    lora: LoraSection | None = Field(
        None, description="LoRA DiLoCo when present (`LoraSection`); None: full fine-tuning.",
    )
    hints: dict[str, str] = Field(
        default_factory=dict, description="Hint templates by error kind, overriding/extending the defaults."
    )
    report: ReportConfig = ReportConfig()

    @model_validator(mode="before")
    @classmethod
    def _outer_defaults_of_the_policy(cls, data: object) -> object:
        """The outer optimizer's defaults depend on the policy (see `OuterOptimizer`): an ``[outer]`` section of a
        ``model`` run that chooses nothing (none of `outer_choice.OUTER_CHOICES` set) becomes `DELAYED_NESTEROV_DEFAULT`; unset
        SGD ``lr`` / ``momentum`` of an embedded-default run become 1.0 / 0.0. Anything set is kept."""
        if not isinstance(data, dict):
            return data
        outer = data.get("outer")
        if outer is None:
            outer = {}
        if not isinstance(outer, dict):  # an OuterOptimizer instance: its values are explicit
            return data
        return {**data, "outer": outer_choice.policy_defaults(outer, has_model=data.get("model") is not None)}

    @model_validator(mode="after")
    def _codec_and_its_options(self) -> "RunConfig":
        from composer_diloco.outer.codecs import codec_entry  # torch-free

        entry = codec_entry(self.compression)  # an unknown name: one line listing the known ones
        if self.sparse_codec is not None and self.compression != "sparse-2bit":
            raise ValueError(f"[sparse_codec] sets the parameters of compression = \"sparse-2bit\", but compression "
                             f"is {self.compression!r}")
        if self.codec_options:
            if entry.options is None:
                raise ValueError(f"[codec_options] given, but compression {self.compression!r} takes none")
            try:
                entry.options.model_validate(self.codec_options)
            except ValidationError as e:
                first = e.errors()[0]
                raise ValueError(f"[codec_options] of {self.compression!r}: {'.'.join(map(str, first['loc']))}: "
                                 f"{first['msg']}") from None
        return self

    @property
    def batch_size(self) -> int:
        """Episodes per inner step: tasks_per_step * num_generations."""
        return self.grpo.tasks_per_step * self.grpo.num_generations

    def digest(self) -> str:
        """SHA-256 (hex, first 16 chars) of the canonical JSON form; equal on every peer of one run."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """Canonical JSON (sorted keys) used to publish the config in the DHT. A run without ``[lora]`` (or
        ``[sparse_codec]``), with ``outer.overlap`` off, without ``env.max_tool_reply_tokens``, or with the
        ``network.state_*`` settings at their defaults, without ``[report]``, with ``warmstart.hint_rate`` 0, or without ``network.round_ends_at_first_ready`` has no such key, so its JSON and `digest` are those of a config written
        before it existed (a loss channel's later keys likewise: `ChannelSettings.omit_at_default`)."""
        data = self.model_dump(mode="json")
        for optional in ("lora", "sparse_codec", "codec_options"):  # absent sections keep the JSON of configs written before them
            if data.get(optional) in (None, {}):
                data.pop(optional, None)
        if not data["outer"].get("overlap"):  # overlap off: the JSON (and digest) of configs written before it
            data["outer"].pop("overlap", None)
        if data["env"].get("max_tool_reply_tokens") is None:  # replies not cut: likewise
            data["env"].pop("max_tool_reply_tokens", None)
        for key in _STATE_TRANSFER_KEYS:  # the state transfer's settings at their defaults: likewise
            if data["network"].get(key) == NetworkConfig.model_fields[key].default:
                data["network"].pop(key, None)
        if data["report"] == ReportConfig().model_dump(mode="json"):  # reporting nowhere: likewise
            data.pop("report")
        if not data["warmstart"].get("hint_rate"):  # a warm start without hints: likewise
            data["warmstart"].pop("hint_rate", None)
        if not data["network"].get("round_ends_at_first_ready"):  # every node trains H steps: likewise
            data["network"].pop("round_ends_at_first_ready", None)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """Parse a config published in the DHT. Raises ConfigError naming the field on bad input."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise ConfigError(f"run config from the DHT is invalid: {_first_error(e)}") from None


def config_diff(ours: RunConfig, theirs: RunConfig) -> list[str]:
    """Dotted names of the fields whose values differ (``["inner_steps", "outer.lr"]``), sorted."""
    a, b = _flatten(ours.model_dump(mode="json")), _flatten(theirs.model_dump(mode="json"))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "hints":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    extra = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"field '{where}': {first['msg']} (got {first.get('input')!r}){extra}"


def load_config(path: str | Path | None, **overrides: object) -> RunConfig:
    """Read a run config from TOML (or the defaults when ``path`` is None) and apply top-level overrides.

    Args:
        path: a TOML file whose tables mirror `RunConfig` (``[grpo]``, ``[outer]``, ...), or None.
        overrides: top-level fields (``rounds=5``, ``model="..."``) that beat the file; None values are ignored.

    Raises:
        ConfigError: the file is missing, is not TOML, or a field is unknown or out of range; the message
            names the file and the field in one line.
    """
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist (expected a TOML file)")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        source = repr(str(path)) if path is not None else "command line"
        raise ConfigError(f"config {source}: {_first_error(e)}") from None
