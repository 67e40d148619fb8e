"""Seconds per inner step of `ComposerGRPOTrainer` against plain TRL `GRPOTrainer`, and the cost of each extra channel.

Five arms train side by side in one process, on copies of the same embedded default policy (warm-started, cached
under ``--out``), the same default `RunConfig`, batch (``grpo_args``: tasks_per_step * G episodes per step) and
rollouts (the same ``play_episodes`` call against one local OpenEnv server, given to both trainers as TRL's
``rollout_func``):

    a  trl         plain ``trl.GRPOTrainer``
    b  ours        ``ComposerGRPOTrainer`` with alpha_sdpo = 0 and beta_dpo = 0
    c  +sdpo       SDPO hint distillation only (alpha_sdpo = 0.2, beta_dpo = 0)
    d  +dpo        trace-replay DPO only (alpha_sdpo = 0, beta_dpo = 0.2)
    e  +sdpo+dpo   both (0.2 and 0.2: the weights of BENCHMARKS.md section 1; both channels default off)

Each arm's ``train()`` runs in its own thread, but only one arm works at a time: the arms take turns one inner step
each (a b c d e, then e d c b a, ...), so background load on the machine hits all arms alike. Before each turn the
arm's weights are set back to the same theta_0 and every RNG is reseeded with the step number, so at step k every
arm plays the same episodes (checked: ``same_episodes`` in the JSON); the AdamW state carries on. A step is split into

    rollout  ``rollout_func``: generation + env calls (the same code for every arm)
    prep     the rest of ``_generate_and_score_completions``: TRL's rewards and advantages, plus (c-e) our collator,
             DPO trace replay and reference log-probs
    train    the rest of the step: loss + backward + AdamW step (+ TRL's logging)

Seconds are medians over the steps after ``--warmup``, spread the 25th-75th percentile. Ratios to arm a are
taken step by step (step k of both arms played the same episodes, which cancels their varying lengths), then
summarized the same way. Generation dominates on CPU, so the ratio that tells our trainer's own overhead is b/a on
``train`` (target <= 1.05); b/a on the whole step is printed too. Run:

    python bench/overhead.py --steps 8 --out runs/bench-overhead
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, set_seed
from transformers.trainer_callback import PrinterCallback
from trl import GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

from composer_diloco.config import RunConfig
from composer_diloco.rollout.env_process import start_env_server
from composer_diloco.rollout.sessions import open_env_sessions
from composer_diloco.policy import load_policy
from composer_diloco.inner.trainer import ComposerGRPOTrainer, env_reward, episode_dataset, grpo_args, play_rollout

log = logging.getLogger("bench.overhead")

PEER = "bench"  # every arm plays the episodes of this peer name
ARMS = {  # name -> (alpha_sdpo, beta_dpo), set whatever the config's defaults (both 0: off); None = plain TRL
    "a_trl": None,
    "b_ours": (0.0, 0.0),
    "c_sdpo": (0.2, 0.0),
    "d_dpo": (0.0, 0.2),
    "e_both": (0.2, 0.2),
}
PARTS = ("step_s", "rollout_s", "prep_s", "train_s")
TURN_TIMEOUT_S = 900.0  # one inner step of one arm; longer means a hung thread


# --------------------------------------------------------------------------------------------------
# Turn-taking between the arms' training threads
# --------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One arm: its trainer, its thread, its turn-taking semaphores and what it measured.

    Attributes:
        name: key in `ARMS`.
        trainer: the arm's trainer (built before any timing).
        steps: rows of per-step measurements: seconds of ``step_s``, ``rollout_s``, ``prep_s``, ``train_s``,
            plus ``episodes_sha256``, ``sdpo_sites``, ``dpo_pairs``.
    """

    name: str
    trainer: Any = None
    steps: list[dict] = field(default_factory=list)
    go: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    done: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    error: BaseException | None = None
    thread: threading.Thread | None = None
    _t0: float = 0.0
    _rollout_s: float = 0.0
    _gen_score_s: float = 0.0
    _episodes: str = ""


class TurnCallback(TrainerCallback):
    """Blocks the arm's training thread between its turns; at the start of a turn resets weights and RNGs.

    Args:
        arm: the arm this callback belongs to.
        theta0: the parameters every turn starts from (same order as ``model.parameters()``).
        seed: base of the per-step RNG seed (step k reseeds with ``seed + k``).
    """

    def __init__(self, arm: Arm, theta0: list[torch.Tensor], seed: int):
        self.arm, self.theta0, self.seed = arm, theta0, seed

    def _wait_turn(self, model: torch.nn.Module, step: int) -> None:
        self.arm.done.release()  # tell the scheduler this arm is idle
        self.arm.go.acquire()
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), self.theta0, strict=True):
                p.copy_(p0)
        set_seed(self.seed + step)
        self.arm._rollout_s = self.arm._gen_score_s = 0.0
        self.arm._t0 = time.perf_counter()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._wait_turn(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        arm, t1 = self.arm, time.perf_counter()
        record = arm.trainer.round_stats.steps[-1] if isinstance(arm.trainer, ComposerGRPOTrainer) else None
        step_s = t1 - arm._t0
        arm.steps.append({
            "step_s": step_s, "rollout_s": arm._rollout_s, "prep_s": arm._gen_score_s - arm._rollout_s,
            "train_s": step_s - arm._gen_score_s, "episodes_sha256": arm._episodes,
            "sdpo_sites": record.sdpo_sites if record else 0, "dpo_pairs": record.dpo_pairs if record else 0,
        })
        if state.global_step < state.max_steps:
            self._wait_turn(model, state.global_step)
        else:
            arm.done.release()  # the last step: train() returns without waiting


def _timed_rollout(arm: Arm, rollout: Callable) -> Callable:
    """Wrap a TRL ``rollout_func`` so that its seconds and a hash of its completions land on ``arm``."""

    def wrapper(prompts: list, trainer: Any) -> dict:
        t0 = time.perf_counter()
        out = rollout(prompts, trainer)
        arm._rollout_s += time.perf_counter() - t0
        arm._episodes = hashlib.sha256(json.dumps([out["prompt_ids"], out["completion_ids"]]).encode()).hexdigest()
        return out

    return wrapper


def _timed_generate_and_score(arm: Arm, method: Callable) -> Callable:
    """Wrap ``trainer._generate_and_score_completions`` (bound) so that its seconds land on ``arm``."""

    def wrapper(inputs: list[dict]) -> dict:
        t0 = time.perf_counter()
        out = method(inputs)
        arm._gen_score_s += time.perf_counter() - t0
        return out

    return wrapper


def _train_in_thread(arm: Arm) -> None:
    try:
        arm.trainer.train()
    except BaseException as e:  # reported by the scheduler, which raises it in the main thread
        arm.error = e
        arm.done.release()


def _wait_idle(arm: Arm) -> None:
    """Wait until ``arm`` finished its turn; re-raise its thread's exception. Raises RuntimeError on a hang."""
    if not arm.done.acquire(timeout=TURN_TIMEOUT_S):
        raise RuntimeError(f"arm {arm.name}: no step finished within {TURN_TIMEOUT_S:.0f} s")
    if arm.error is not None:
        raise RuntimeError(f"arm {arm.name} failed: {arm.error!r}") from arm.error


# --------------------------------------------------------------------------------------------------
# Building the arms
# --------------------------------------------------------------------------------------------------


def plain_rollout(config: RunConfig, sessions: list) -> Callable:
    """A TRL ``rollout_func`` for plain `GRPOTrainer` that plays the same episodes as our trainer's ``_rollout``.

    Our trainer reads each row's ``(seed, episode_id)`` from the dataset rows it keeps; plain TRL hands the prompts
    only, so the episode id is read back from the prompt text (``"episode <id>"``, `episode_dataset`) and the seed
    is ``config.seed``, as in every row. Returns the same keys as `composer_diloco.inner.trainer._rollout`.
    """

    def rollout(prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        keys = [(config.seed, p[-1]["content"].removeprefix("episode ")) for p in prompts]
        return play_rollout(trainer, sessions, config, keys)[1]

    return rollout


def build_arm(name: str, model: Any, tokenizer: Any, base: RunConfig, sessions: list, *, max_steps: int,
              scratch: Path, theta0: list[torch.Tensor]) -> Arm:
    """The trainer of arm ``name`` on a copy of ``model``, wrapped for timing and turn-taking.

    Args:
        name: a key of `ARMS`.
        model, tokenizer: the policy (copied, so the arms train independent weights).
        base: the run config; the arm sets its ``loss.alpha_sdpo`` / ``loss.beta_dpo`` to `ARMS`' weights.
        sessions: env sessions shared by all arms (only one arm plays at a time).
        max_steps: inner steps of the arm's ``train()`` (warm-up + measured).
        scratch: TRL's output folder (nothing is written there).
        theta0: the weights every turn starts from.
    """
    arm = Arm(name)
    weights = ARMS[name]
    config = base
    if weights is not None:
        loss = {**base.loss.model_dump(), "alpha_sdpo": weights[0], "beta_dpo": weights[1]}
        config = RunConfig.model_validate({**base.model_dump(), "loss": loss})
    args = grpo_args(config, output_dir=scratch / name, max_steps=max_steps, use_cpu=True, bf16=False)
    callback = TurnCallback(arm, theta0, config.seed)
    policy = copy.deepcopy(model)
    if weights is None:
        episodes_per_step = args.per_device_train_batch_size * args.steps_per_generation
        n_rows = max_steps * (episodes_per_step // config.grpo.num_generations) + 1  # as ComposerGRPOTrainer
        trainer = GRPOTrainer(model=policy, reward_funcs=[env_reward], args=args,
                              train_dataset=episode_dataset(config, PEER, n_rows), processing_class=tokenizer,
                              rollout_func=plain_rollout(config, sessions), callbacks=[callback])
        trainer.remove_callback(PrinterCallback)
        if not is_chat_template_prefix_preserving(tokenizer):  # the template our trainer renders tool replies with
            trainer.chat_template = get_training_chat_template(tokenizer)
    else:
        trainer = ComposerGRPOTrainer(model=policy, tokenizer=tokenizer, config=config, sessions=sessions,
                                      peer_name=PEER, args=args, callbacks=[callback])
    trainer.rollout_func = _timed_rollout(arm, trainer.rollout_func)
    trainer._generate_and_score_completions = _timed_generate_and_score(arm, trainer._generate_and_score_completions)
    arm.trainer = trainer
    return arm


# --------------------------------------------------------------------------------------------------
# Running and reporting
# --------------------------------------------------------------------------------------------------


def run_interleaved(arms: list[Arm], total_steps: int) -> None:
    """Run ``total_steps`` inner steps of every arm, one arm at a time, in order a..e then e..a, and so on.

    Each arm's thread starts (and builds its optimizer) before any timed step; after its last step the thread is
    joined before the next arm runs. Raises RuntimeError when an arm fails or hangs.
    """
    for arm in arms:  # start one at a time: setup of one arm must not overlap another's steps
        arm.thread = threading.Thread(target=_train_in_thread, args=(arm,), name=f"arm-{arm.name}", daemon=True)
        arm.thread.start()
        _wait_idle(arm)
    for step in range(total_steps):
        for arm in arms if step % 2 == 0 else arms[::-1]:
            arm.go.release()
            _wait_idle(arm)
            if step == total_steps - 1:
                arm.thread.join(TURN_TIMEOUT_S)


def summarize(values: list[float]) -> dict:
    """Median, 25th and 75th percentile (seconds) of ``values``, and the values themselves."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "values": [round(v, 4) for v in values]}


def report(arms: list[Arm], warmup: int) -> dict:
    """Per arm: `summarize` of each part over the measured steps (seconds), mean SDPO sites / DPO pairs per step,
    the ratio of the arm's median to plain TRL's (``ratio_step``, ``ratio_train``) and `summarize` of the per-step
    ratios arm / plain TRL (``paired_ratio_step``, ``paired_ratio_train``; step k of both played the same episodes).
    ``arms[0]`` must be plain TRL."""
    out: dict[str, dict] = {}
    for arm in arms:
        measured = arm.steps[warmup:]
        row = {part: summarize([s[part] for s in measured]) for part in PARTS}
        row["sdpo_sites_per_step"] = statistics.fmean(s["sdpo_sites"] for s in measured)
        row["dpo_pairs_per_step"] = statistics.fmean(s["dpo_pairs"] for s in measured)
        out[arm.name] = row
    base, base_steps = out["a_trl"], arms[0].steps[warmup:]
    for arm in arms:
        row = out[arm.name]
        for part in ("step_s", "train_s"):
            key = part.removesuffix("_s")
            row[f"ratio_{key}"] = row[part]["median"] / base[part]["median"]
            # step k of every arm played the same episodes: the per-step ratio cancels their varying lengths
            pairs = [s[part] / b[part] for s, b in zip(arm.steps[warmup:], base_steps, strict=True)]
            row[f"paired_ratio_{key}"] = summarize(pairs)
    return out


def markdown(results: dict) -> str:
    """The results as a markdown table: seconds and per-step ratios to arm a, as median [p25-p75]."""
    lines = ["| arm | step s | rollout s | prep s | train s | step / a | train / a | sdpo sites | dpo pairs |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(stats: dict) -> str:
        return f"{stats['median']:.3f} [{stats['p25']:.3f}-{stats['p75']:.3f}]"

    for name, row in results.items():
        cells = [cell(row[p]) for p in (*PARTS, "paired_ratio_step", "paired_ratio_train")]
        lines.append(f"| {name} | {' | '.join(cells)} | {row['sdpo_sites_per_step']:.1f} | "
                     f"{row['dpo_pairs_per_step']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build the arms, run them interleaved, print the table and write ``<out>/overhead.json``. Returns 0."""
    defaults = RunConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="measured inner steps per arm")
    ap.add_argument("--warmup", type=int, default=1, help="inner steps per arm run first and not measured")
    ap.add_argument("--warmstart-steps", type=int, default=None,
                    help=f"warm-start steps of the default policy (default {defaults.warmstart.steps}, "
                         "0 with --smoke); cached per user (composer_diloco.policy.cache)")
    ap.add_argument("--smoke", action="store_true", help="2 measured steps per arm, no warm-up, no warm start")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-overhead"))
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 2, 0
        args.warmstart_steps = 0 if args.warmstart_steps is None else args.warmstart_steps
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps {args.steps} / --warmup {args.warmup}: expected steps >= 1 and warmup >= 0")
    warmstart_steps = defaults.warmstart.steps if args.warmstart_steps is None else args.warmstart_steps
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" warning, once per arm
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    config = defaults
    model, tokenizer = load_policy(None, seed=config.warmstart.seed, warmstart_steps=warmstart_steps)
    theta0 = [p.detach().clone() for p in model.parameters()]
    total = args.warmup + args.steps
    server, sessions = None, []
    try:
        server = start_env_server(config.env.server_module, startup_timeout_s=config.env.connect_timeout_s)
        sessions = open_env_sessions([server.url], config.batch_size, max_tool_calls=config.env.max_tool_calls)
        with tempfile.TemporaryDirectory(prefix="bench-overhead-") as scratch:
            arms = [build_arm(name, model, tokenizer, config, sessions, max_steps=total, scratch=Path(scratch),
                              theta0=theta0) for name in ARMS]
            run_interleaved(arms, total)
    finally:
        for s in sessions:
            s.close()
        if server is not None:
            server.stop()

    results = report(arms, args.warmup)
    hashes = [[s["episodes_sha256"] for s in arm.steps] for arm in arms]
    same = all(h == hashes[0] for h in hashes)
    command = "python bench/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {
        "command": command.strip(), "steps": args.steps, "warmup": args.warmup, "warmstart_steps": warmstart_steps,
        "episodes_per_step": config.batch_size, "loss": config.loss.model_dump(), "torch_threads":
        torch.get_num_threads(), "same_episodes": same, "wall_s": round(time.perf_counter() - started, 1),
        "arms": results,
    }
    (args.out / "overhead.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(markdown(results))
    print(f"\n{args.steps} measured + {args.warmup} warm-up steps per arm, {config.batch_size} episodes per step; "
          f"same episodes in every arm: {'yes' if same else 'NO'}; {payload['wall_s']:.0f} s; "
          f"JSON: {args.out / 'overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
