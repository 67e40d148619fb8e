"""The inner-loop trainer: TRL's `GRPOTrainer`, fed by multi-turn OpenEnv episodes through ``rollout_func``.

This is the one adapter over TRL internals. It touches three of them:
- ``_generate_and_score_completions`` is wrapped to keep the dataset rows of the batch in the step's `StepBatch`,
  because TRL hands ``rollout_func`` the prompts only and an episode is identified by the row's ``(seed,
  episode_id)``; after TRL has scored the batch, every loss channel builds its rows from the same episodes;
- ``_compute_loss`` is wrapped: TRL's GRPO loss, plus ``weight_c * L_c`` of every loss channel ``c``
  (`composer_diloco.channels.base`: SDPO, arXiv 2601.20802; trace-replay DPO, arXiv 2305.18290; any registered one);
- ``_get_tool_suffix_ids`` renders tool replies into token ids exactly as TRL's own tool loop does.
Everything else (advantages, the GRPO/DAPO loss, the AdamW step, logging) is TRL's, unchanged.

One optimizer step = one generation batch of ``micro_batch * K`` episodes (``gradient_accumulation_steps = K =
steps_per_generation``, the node's ``--grad-accum``): TRL shuffles it, splits it into K micro-batches of
``micro_batch`` episodes and calls ``_compute_loss`` once per micro-batch, each GRPO term already scaled so that
the K terms add up to the loss of the whole batch (DAPO/CISPO divide by the generation batch's token count
``num_items_in_batch``; grpo/dr_grpo/sapo divide by K a mean over equal-sized micro-batches; bnpo's per-micro-batch
token mean is TRL's own approximation). A channel's rows do not share TRL's episode dimension, so each channel
cuts them into K parts of its own (`LossChannel.split`), one per ``_compute_loss`` call, each weighted by its share
of the channel's denominator (valid SDPO tokens, DPO pairs): the K weighted part losses add up to the channel's loss
on the whole batch, and the composite loss of one optimizer step is the same whatever K is (up to float rounding;
`tests/test_heterogeneous.py`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

from composer_diloco.channels.base import ChannelContext, LossChannel, registered_channels
from composer_diloco.channels.hints import HintRegistry
from composer_diloco.config import RunConfig
from composer_diloco.inner.step import RoundStats, StepBatch, StepLosses
from composer_diloco.rollout.env_package import EnvPackage, load_env_package
from composer_diloco.rollout.episodes import EnvSession
from composer_diloco.rollout.play import play_episodes
from composer_diloco.rollout.tasks import TaskSet, TaskShard, task_episode_id
from composer_diloco.timing import PhaseClock

log = logging.getLogger(__name__)

def env_reward(prompts: list, completions: list, env_reward: list[float], **_: Any) -> list[float]:
    """Reward function for TRL: the environment's final reward of each episode (1.0 solved, else 0.0)."""
    return [float(r) for r in env_reward]


def episode_dataset(config: RunConfig, peer_name: str, n_rows: int, tasks: TaskSet | None = None,
                    shard: TaskShard | None = None) -> Dataset:
    """Rows ``{"prompt", "seed", "episode_id"}``: one per task; each is played G times (one GRPO group).

    Episode ids carry the peer name, so nodes of one run play different episodes that any peer can replay. With a
    ``[tasks]`` dataset, row ``i`` is the node's ``i``-th task row (`TaskSet.order`: its shard, or its own permutation)
    and its episode id names that row (`composer_diloco.rollout.tasks.task_episode_id`).
    """
    tag = hashlib.sha256(peer_name.encode()).hexdigest()[:8]
    ids = [f"{tag}-{i}" for i in range(n_rows)]
    if tasks is not None:
        order = tasks.order(n_rows, seed=config.seed, shard=shard, peer_name=peer_name)
        ids = [task_episode_id(base, row) for base, row in zip(ids, order)]
    rows = [{"prompt": [{"role": "user", "content": f"episode {e}"}], "seed": config.seed, "episode_id": e}
            for e in ids]
    return Dataset.from_list(rows)


def grpo_args(config: RunConfig, *, output_dir: Path, max_steps: int, use_cpu: bool, bf16: bool,
              micro_batch: int | None = None, grad_accum: int = 1) -> GRPOConfig:
    """TRL `GRPOConfig` for H inner steps per round: one generation batch (``micro_batch * grad_accum`` episodes)
    per optimizer step, constant AdamW learning rate, no checkpoints or reporting (DiLoCo owns both).

    Args:
        config: the run config.
        output_dir: TRL's scratch folder (nothing is saved there).
        max_steps: optimizer (inner) steps of the whole ``train()`` call.
        use_cpu, bf16: the node's placement (`nodes.device.Placement`); bf16 = bf16 autocast, fp32 master weights.
        micro_batch: episodes per forward/backward pass (TRL ``per_device_train_batch_size``); None =
            ``config.batch_size`` (tasks_per_step * G).
        grad_accum: micro-batches per optimizer step, K (TRL ``gradient_accumulation_steps`` and
            ``steps_per_generation``: one generation batch per optimizer step).
    Raises:
        ValueError: ``micro_batch`` or ``grad_accum`` below 1, or ``micro_batch * grad_accum`` not a multiple of
            ``config.grpo.num_generations`` (GRPO groups must be whole).
    """
    g = config.grpo
    micro_batch = config.batch_size if micro_batch is None else micro_batch
    if micro_batch < 1 or grad_accum < 1 or (micro_batch * grad_accum) % g.num_generations:
        raise ValueError(f"micro_batch {micro_batch} x grad_accum {grad_accum}: expected positive values whose "
                         f"product is a multiple of num_generations {g.num_generations}")
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=grad_accum,
        steps_per_generation=grad_accum,
        num_generations=g.num_generations,
        max_completion_length=config.max_seq_len,
        learning_rate=config.inner.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=config.inner.weight_decay,
        max_grad_norm=config.inner.max_grad_norm,
        optim="adamw_torch",
        loss_type=g.loss_type,
        beta=g.beta,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high,
        scale_rewards=g.scale_rewards,
        temperature=g.temperature,
        seed=config.seed,
        use_cpu=use_cpu,
        bf16=bf16,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        gradient_checkpointing=False,  # a tiny model gains nothing; large models can turn it on later
        remove_unused_columns=False,
        shuffle_dataset=False,
    )


class ComposerGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose completions are multi-turn tool episodes played against OpenEnv servers, and whose loss
    adds the registered loss channels' terms to TRL's GRPO loss.

    Args:
        model: the policy (a `PreTrainedModel`).
        tokenizer: its tokenizer (chat template with tool calling).
        config: the run config.
        sessions: env sessions, at least one; with fewer than ``episodes_per_step`` a step plays its episodes in
            waves (`play_episodes`).
        peer_name: names this peer's episodes (`episode_dataset`).
        args: the TRL config (`grpo_args`): ``per_device_train_batch_size`` episodes per micro-batch,
            ``gradient_accumulation_steps`` = ``steps_per_generation`` micro-batches per optimizer step.
        callbacks: Trainer callbacks (the DiLoCo round callback).
        env: the env contract of ``config.env.server_module`` (its ``reason_hints`` feed the SDPO hints, its
            ``script`` the DPO ``"scripted"`` teacher); None loads it with `load_env_package`.
        channels: the loss channel classes to use; None = `registered_channels` (each decides from the config
            whether it is on).
        tasks: the ``[tasks]`` dataset (`TaskSet`), whose rows the episodes play; None: the env's reset gives the task.
        task_shard: this node's part of ``tasks`` (``--task-shard``), or None (see `TaskSet.order`).
        clock: the node's `PhaseClock` (`composer_diloco.timing.INNER_PHASES` names what each phase counts); None: a
            clock of its own.
        rollout_engine: how episodes decode (`composer_diloco.rollout.play.play_episodes`'s ``engine``).

    Raises:
        ValueError: no sessions, or ``steps_per_generation != gradient_accumulation_steps`` or
            ``num_iterations != 1`` (one generation batch must be exactly one optimizer step); an unknown DPO
            teacher.
        EnvPackageError: ``env`` is None and ``config.env.server_module`` names no env package.

    Attributes:
        episodes_per_step: episodes generated per optimizer (inner) step: micro-batch x K.
        channels: the channels that are on, in the order their terms are added.
        round_stats: the current round's `RoundStats` (episodes, per-step losses, channel counts) until
            `take_round_stats`.
        hints: the SDPO hint registry (``[hints]`` over the defaults and the env's reason hints).
        clock: the `PhaseClock` the inner phase's parts are counted on.
    """

    def __init__(self, *, model: Any, tokenizer: Any, config: RunConfig, sessions: Sequence[EnvSession],
                 peer_name: str, args: GRPOConfig, callbacks: list[TrainerCallback] | None = None,
                 env: EnvPackage | None = None, channels: Sequence[type[LossChannel]] | None = None,
                 tasks: TaskSet | None = None, task_shard: TaskShard | None = None,
                 clock: PhaseClock | None = None, rollout_engine: str = "batched"):
        if args.steps_per_generation != args.gradient_accumulation_steps or args.num_iterations != 1:
            raise ValueError(f"steps_per_generation {args.steps_per_generation}, gradient_accumulation_steps "
                             f"{args.gradient_accumulation_steps}, num_iterations {args.num_iterations}: expected "
                             "equal steps and 1 iteration (one generation batch per optimizer step)")
        self.episodes_per_step = args.per_device_train_batch_size * args.steps_per_generation
        if not sessions:
            raise ValueError("need at least one env session, got none")
        self.run_config = config
        self.sessions = list(sessions)
        self.clock = clock if clock is not None else PhaseClock()
        self.rollout_engine = rollout_engine
        env = env if env is not None else load_env_package(config.env.server_module)
        self.hints = HintRegistry.from_config(config.hints, reason_hints=env.reason_hints)
        self._channel_types = registered_channels() if channels is None else tuple(channels)
        context = ChannelContext(config=config, model=model, tokenizer=tokenizer, sessions=self.sessions, env=env,
                                 hints=self.hints)
        built = (cls.from_context(context) for cls in self._channel_types)
        self.channels: list[LossChannel] = [c for c in built if c is not None]
        self.round_stats = RoundStats(self._channel_types, self.episodes_per_step)
        self._step_batch: StepBatch | None = None  # the optimizer step in progress (between TRL's hooks)
        # one row per task (GRPO group); TRL's sampler drops a trailing incomplete generation batch, hence + 1
        n_rows = max(1, args.max_steps) * (self.episodes_per_step // config.grpo.num_generations) + 1
        super().__init__(
            model=model,
            reward_funcs=[env_reward],
            args=args,
            train_dataset=episode_dataset(config, peer_name, n_rows, tasks, task_shard),
            processing_class=tokenizer,
            rollout_func=_rollout,
            callbacks=[*(callbacks or []), _OptimizerPhase(self.clock)],
        )
        self.remove_callback(PrinterCallback)  # it prints log dicts to stdout; per-round metrics go to metrics.jsonl
        # TRL applies this rule only when `tools` are passed; our rollout_func renders tool replies the same way,
        # so multi-turn token ids need a prefix-preserving template too (Qwen3's adds a think block otherwise).
        if not is_chat_template_prefix_preserving(tokenizer):
            self.chat_template = get_training_chat_template(tokenizer)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        # one micro-batch's forward and backward; on a step's first micro-batch it also generates and scores the
        # step's episodes (Trainer.training_step calls _prepare_inputs), whose phases take their seconds from this one
        with self.clock.phase("forward_backward"):
            return super().training_step(model, inputs, num_items_in_batch)

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        # rollout_func receives prompts only; it reads each row's (seed, episode_id) from the step
        self._step_batch = StepBatch(rows=inputs, losses=StepLosses(self._channel_types))
        with self.clock.phase("scoring"):
            output = super()._generate_and_score_completions(inputs)
        self._step_batch.build_channels(self.channels, self.model, self.args.steps_per_generation, self.round_stats,
                                        clock=self.clock)
        return output

    def _compute_loss(self, model: Any, inputs: dict) -> Any:
        # TRL's GRPO loss of this micro-batch, unchanged: already scaled so the K micro-batches add up to the step's
        loss = super()._compute_loss(model, inputs)
        if self._step_batch is None:  # a call outside `train` (no generation batch): a step of one micro-batch
            self._step_batch = StepBatch(rows=[], losses=StepLosses(self._channel_types))
        step = self._step_batch
        step.losses.add("loss_grpo", float(loss.detach()))
        parts = step.next_parts()
        for channel in self.channels:
            part = parts.get(channel.name)
            if part is None or part.rows is None:
                continue
            value = channel.loss(model, channel.to_device(part.rows, loss.device))  # mean over this part
            loss = loss + channel.weight * part.weight * value
            step.losses.add(channel.metrics.loss_key, part.weight * float(value.detach()))
            step.losses.add(channel.metrics.count_key, part.count)
        step.micro_left = max(0, step.micro_left - 1)
        if step.micro_left == 0:  # the optimizer step's last micro-batch (or a call outside `train`)
            mode = "train" if model.training else "eval"
            for key, value in step.losses.as_dict().items():
                if key != "loss_grpo":
                    self._metrics[mode][f"composite/{key}"].append(float(value))
            self.round_stats.add_step(step.losses)
            self._step_batch = None
        return loss

    def refresh_reference(self) -> None:
        """Tell every channel the outer step is done (DPO makes its reference policy the current weights)."""
        for channel in self.channels:
            channel.after_outer_step()

    def take_round_stats(self) -> RoundStats:
        """The round's `RoundStats` since the previous call; a fresh one collects the next round."""
        out, self.round_stats = self.round_stats, RoundStats(self._channel_types, self.episodes_per_step)
        return out


class RoundCallback(TrainerCallback):
    """TRL's side of a node's DiLoCo rounds (`composer_diloco.diloco.DiLoCoRounds`, where the round is): after each
    of the trainer's steps the rounds count it and may end a round; they say when training must stop. When the
    trainer stops, an overlapped round in flight is waited for and theta loaded (`DiLoCoRounds.finish`).

    Args:
        rounds: the node's `DiLoCoRounds`.
    """

    def __init__(self, rounds: Any):
        self.rounds = rounds

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.rounds.after_inner_step(model):
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.rounds.finish(model)
        return control


class OnceTrainingBegins(TrainerCallback):
    """Calls ``begin()`` once, at the first ``on_train_begin``: after transformers' ``train()`` has built the
    optimizer, wrapped the model (``accelerator.prepare``) and made the dataloader, before the first step. A node
    starts its first inner phase there, so that set-up counts as its join, not as inner-loop seconds.

    Args:
        begin: called with no arguments; later ``train()`` calls (a heal's) do not call it again.
    """

    def __init__(self, begin: Any):
        self.begin = begin

    def on_train_begin(self, args, state, control, **kwargs):
        begin, self.begin = self.begin, None
        if begin is not None:
            begin()
        return control


class _OptimizerPhase(TrainerCallback):
    """Counts the optimizer step (AdamW's ``step``, between transformers' ``on_pre_optimizer_step`` and
    ``on_optimizer_step``) as the clock's ``"optimizer"`` phase."""

    def __init__(self, clock: PhaseClock):
        self.clock = clock

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.clock.enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.clock.exit("optimizer")


def _rollout(prompts: list, trainer: ComposerGRPOTrainer) -> dict[str, list]:
    """TRL ``rollout_func``: play one episode per row; returns TRL's required keys plus ``env_mask`` (becomes
    TRL's ``tool_mask``: tool replies carry no loss) and ``env_reward`` (read by `env_reward`)."""
    rows = trainer._step_batch.rows
    if len(rows) != len(prompts):
        raise RuntimeError(f"rollout got {len(prompts)} prompts for {len(rows)} dataset rows")
    episodes, out = play_rollout(trainer, trainer.sessions, trainer.run_config,
                                 [(int(r["seed"]), str(r["episode_id"])) for r in rows])
    trainer.round_stats.add_episodes(episodes)
    trainer._step_batch.episodes = episodes
    return out


def play_rollout(trainer, sessions: list, config: RunConfig, keys: list[tuple[int, str]]) -> tuple[list, dict]:
    """Play one episode per ``(seed, episode_id)`` with ``trainer``'s model and tokenizer (any TRL `GRPOTrainer`).

    Returns:
        ``(episodes, outputs)``: the `Episode` list and TRL's ``rollout_func`` keys (``prompt_ids``,
        ``completion_ids``, ``logprobs``) plus ``env_mask`` and ``env_reward``, one entry per episode.
    """
    episodes = play_episodes(
        trainer.model, trainer.processing_class, sessions, keys, tool_suffix_ids=trainer._get_tool_suffix_ids,
        max_tool_calls=config.env.max_tool_calls, max_turn_tokens=config.env.max_turn_tokens,
        max_seq_len=config.max_seq_len, temperature=config.grpo.temperature,
        max_tool_reply_tokens=config.env.max_tool_reply_tokens,
        clock=getattr(trainer, "clock", None), engine=getattr(trainer, "rollout_engine", "batched"),
    )
    return episodes, {
        "prompt_ids": [e.prompt_ids for e in episodes],
        "completion_ids": [e.completion_ids for e in episodes],
        "logprobs": [e.logprobs for e in episodes],
        "env_mask": [e.env_mask for e in episodes],
        "env_reward": [e.reward for e in episodes],
    }
