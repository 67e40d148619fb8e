"""Does it learn as well as synchronous training? Reward and success against samples trained, arm by arm.

Every arm is a real localhost run (`composer-coordinator simulate`: a coordinator and N node processes, real
hivemind all-reduces, real env servers) on the embedded default, with one shared warm start (the "pretrained"
policy) and the run seed varied across seeds (episodes, sampling). Arms, all at the same total sample budget
``--budget`` (episodes summed over nodes):

    sync-N{2,4}          the synchronous baseline: ONE process whose batch is the N nodes' batches together
                         (tasks_per_step = N), outer SGD with lr 1 and no momentum, so theta is exactly the
                         inner model after every round: plain single-process GRPO(+SDPO+DPO) training
    diloco-N{2,4}-H{4,16,64}   N nodes, one GRPO group (4 episodes) per inner step each, H inner steps per
                         round, DiLoCo's outer Nesterov SGD with the paper's lr 0.7, momentum 0.9 (the config's
                         default for a real model; set explicitly here)
    avg-N{2,4}-H{4,16,64}      the same with outer lr 1, no momentum: theta becomes the weighted mean of the
                         nodes' models every round (parameter averaging, FedAvg / DiLoCo with the outer step off)
    grpo-N2-H16, grpo+sdpo-N2-H16   the channel ablation beside avg-N2-H16 (= GRPO + SDPO + DPO)
    overlap-N4-H16       avg-N4-H16 with ``[outer] overlap = true`` (each round's sync overlapped with the next
                         round's inner phase, theta folded in one round late: `composer_diloco.outer.overlap`)
    sparse-N4-H16        avg-N4-H16 with the sparse-2bit codec (top-k 1/64 + 2-bit values + error feedback)
    grpo-*               the outer-optimizer sweep on the shipped loss (GRPO alone), BENCHMARKS.md 1d
    grpo-sparse-N4-H16   grpo-avg-N4-H16 with the sparse-2bit codec (BENCHMARKS.md 3b)
    grpo-blocks-N4-H16   grpo-avg-N4-H16 with the shared-blocks codec (block top-k on a shared selection, butterfly)
    grpo-blocks-d32-int8-N4-H16   the same with twice the blocks (1/32) sent in int8 (the same bytes of values)
    coding-*             the coding env (``configs/coding.toml`` under the arm's keys: `Arm.base`), N = 4, H = 16
    nesterov-lrL-mM-N4-H{4,16}   N = 4 with outer Nesterov SGD at lr L, momentum M, chosen so that the
                         steady-state step lr / (1 - M) is 1, averaging's (DiLoCo's 0.7 / 0.9 is 7)

The curve of a run is the on-policy training reward of every inner step (``step_rewards`` of the nodes'
``metrics.jsonl``), placed at the samples trained so far by the whole swarm, binned every ``--bin`` samples;
across seeds: the mean and the min-max band. Run (resumable: finished runs are kept):

    python bench/learning.py run --seeds 0 1 --budget 1024 --out runs/bench-learning
    python bench/learning.py report --out runs/bench-learning --figures bench/figures

``run --smoke`` plays one tiny arm (one round of N = 2, H = 2) for the CI smoke test.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w  # openenv's dependency, hence ours

from composer_diloco.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
GROUP = 4  # the default config's GRPO group size G: episodes per task
COLLAPSED = 0.05  # a run whose last-quarter reward is below this collapsed: the policy no longer makes valid calls


@dataclass(frozen=True)
class Arm:
    """One configuration of the sweep.

    Attributes:
        name: label in tables and plots.
        nodes: node processes N.
        inner_steps: H.
        tasks_per_step: GRPO groups per inner step per node (batch = tasks_per_step * 4 episodes).
        sync: the synchronous baseline (one process; outer lr 1, no momentum).
        averaging: outer lr 1 and no momentum (parameter averaging) instead of DiLoCo's Nesterov 0.7 / 0.9.
        alpha_sdpo, beta_dpo: the extra channels' weights (0 = off).
        overlap: ``[outer] overlap`` (the sync of round t in the background while round t+1 trains).
        compression: the pseudo-gradient codec (the config's ``compression``: a name of `composer_diloco.outer.codecs`).
        codec_options: its ``[codec_options]`` table's lines verbatim (TOML), or None for its defaults.
        outer: ``(lr, momentum, nesterov)`` of the outer SGD, overriding ``sync`` / ``averaging`` / DiLoCo's.
        outer_toml: the ``[outer]`` section's optimizer lines verbatim (another optimizer), overriding ``outer``.
        base: a config file (relative to the repository) under the arm's own keys, e.g. ``configs/coding.toml``
            for the coding env: its env, sequence length, temperature and inner lr stay; the arm's keys win.
        dpo_score: ``[loss] dpo_score`` (None: the config's, "accepted"), e.g. "recovery" (issue 40).
        warmstart: the ``[warmstart]`` section's lines verbatim (TOML), e.g. a longer warm start that teaches hint
            use (``hint_rate``, issue 40), or None for the config's.
    """

    name: str
    nodes: int
    inner_steps: int
    tasks_per_step: int = 1
    sync: bool = False
    averaging: bool = False
    alpha_sdpo: float = 0.2
    beta_dpo: float = 0.2
    overlap: bool = False
    compression: str = "none"
    codec_options: str | None = None
    outer: tuple[float, float, bool] | None = None
    outer_toml: str | None = None
    base: str | None = None
    inner_lr: float | None = None
    dpo_score: str | None = None
    warmstart: str | None = None

    def samples_per_round(self) -> int:
        """Episodes trained per round by the whole swarm."""
        return self.nodes * self.inner_steps * self.tasks_per_step * GROUP

    def rounds(self, budget: int) -> int:
        """Rounds that spend ``budget`` samples. Raises ValueError when the budget is not a whole number of rounds."""
        per = self.samples_per_round()
        if budget % per:
            raise ValueError(f"--budget {budget} is not a multiple of {per} samples per round of {self.name}")
        return budget // per

    def config_toml(self, seed: int, rounds: int) -> str:
        """The run config of this arm and seed (TOML)."""
        lr, momentum, nesterov = self.outer or ((1.0, 0.0, False) if self.sync or self.averaging
                                                else (0.7, 0.9, True))  # DiLoCo's; the embedded default averages
        outer = f"lr = {lr}\nmomentum = {momentum}\nnesterov = {str(nesterov).lower()}\n"
        if self.outer_toml is not None:
            outer = self.outer_toml.strip() + "\n"
        own = (f'run_name = "learning"\nseed = {seed}\nrounds = {rounds}\ninner_steps = {self.inner_steps}\n'
                f"checkpoint_every = {max(rounds, 1)}\n"
                + (f'compression = "{self.compression}"\n' if self.compression != "none" else "")
                + (f"[codec_options]\n{self.codec_options.strip()}\n" if self.codec_options else "")
                + f"[grpo]\ntasks_per_step = {self.tasks_per_step}\n"
                f"[loss]\nalpha_sdpo = {self.alpha_sdpo}\nbeta_dpo = {self.beta_dpo}\n"
                + (f'dpo_score = "{self.dpo_score}"\n' if self.dpo_score is not None else "")
                + (f"[inner]\nlr = {self.inner_lr}\n" if self.inner_lr is not None else "")
                + (f"[warmstart]\n{self.warmstart.strip()}\n" if self.warmstart else "")
                + f"[outer]\n{outer}{'overlap = true' + chr(10) if self.overlap else ''}"
                f"[network]\nmatchmaking_time_s = 1.0\n")
        if self.base is None:
            return own
        return tomli_w.dumps(_merged(tomllib.loads((ROOT / self.base).read_text()), tomllib.loads(own)))


def _merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s keys written over it, tables merged key by key (TOML has no include)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


GRPO = {"alpha_sdpo": 0.0, "beta_dpo": 0.0}  # the shipped loss: GRPO alone
CODING = "configs/coding.toml"


def delayed_nesterov(lr: float, momentum: float, delay: int = 4) -> str:
    """The ``[outer]`` lines of Delayed Nesterov (`composer_diloco.outer.delayed_nesterov`) for `Arm.outer_toml`."""
    return (f'optimizer = "composer_diloco.outer.delayed_nesterov.DelayedNesterov"\nlr = {lr}\n'
            f"kwargs = {{momentum = {momentum}, delay = {delay}}}")


ARMS = [
    Arm("sync-N2", nodes=1, inner_steps=16, tasks_per_step=2, sync=True),
    Arm("sync-N4", nodes=1, inner_steps=16, tasks_per_step=4, sync=True),
    *(Arm(f"avg-N{n}-H{h}", nodes=n, inner_steps=h, averaging=True) for n in (2, 4) for h in (4, 16, 64)),
    Arm("grpo-N2-H16", nodes=2, inner_steps=16, averaging=True, alpha_sdpo=0.0, beta_dpo=0.0),
    Arm("grpo+sdpo-N2-H16", nodes=2, inner_steps=16, averaging=True, beta_dpo=0.0),
    *(Arm(f"diloco-N{n}-H{h}", nodes=n, inner_steps=h) for n in (2, 4) for h in (4, 16, 64)),
    Arm("overlap-N4-H16", nodes=4, inner_steps=16, averaging=True, overlap=True),  # beside avg-N4-H16
    Arm("sparse-N4-H16", nodes=4, inner_steps=16, averaging=True, compression="sparse-2bit"),
    *(Arm(f"nesterov-lr{lr}-m{m}-N4-H{h}", nodes=4, inner_steps=h, outer=(lr, m, True))
      for h in (4, 16) for lr, m in ((0.5, 0.5), (0.2, 0.8))),
    # The outer-optimizer sweep on the shipped loss (GRPO alone: the channels default off since section 1c), N = 4.
    # Run with --eval-episodes 256: the fixed held-out evaluation of section 1b tells these arms apart where the
    # training curves cannot.
    Arm("grpo-sync-N4", nodes=1, inner_steps=16, tasks_per_step=4, sync=True, **GRPO),
    *(Arm(f"grpo-avg-N4-H{h}", nodes=4, inner_steps=h, averaging=True, **GRPO) for h in (4, 16)),
    Arm("grpo-overlap-N4-H16", nodes=4, inner_steps=16, averaging=True, overlap=True, **GRPO),
    *(Arm(f"grpo-{'nesterov' if nesterov else 'heavyball'}-lr{lr}-m{m}-N4-H{h}", nodes=4, inner_steps=h,
          outer=(lr, m, nesterov), **GRPO)
      for h, lr, m, nesterov in ((16, 0.5, 0.5, True), (4, 0.5, 0.5, True), (4, 0.5, 0.5, False),
                                 (4, 0.2, 0.8, True), (4, 0.7, 0.9, True))),
    # Delayed Nesterov (arXiv 2401.09135, composer_diloco.outer.delayed_nesterov): momentum moved every 4 rounds
    *(Arm(f"grpo-delayed-lr{lr}-m{m}-d4-N4-H4", nodes=4, inner_steps=4, outer_toml=delayed_nesterov(lr, m), **GRPO)
      for lr, m in ((0.8, 0.5), (0.7, 0.9))),
    # the same question at N = 2, H = 16 (8 rounds): averaging, Nesterov at averaging's step, DiLoCo's, delayed
    Arm("grpo-avg-N2-H16", nodes=2, inner_steps=16, averaging=True, **GRPO),
    *(Arm(f"grpo-nesterov-lr{lr}-m{m}-N2-H16", nodes=2, inner_steps=16, outer=(lr, m, True), **GRPO)
      for lr, m in ((0.5, 0.5), (0.7, 0.9))),
    Arm("grpo-delayed-lr0.7-m0.9-d4-N2-H16", nodes=2, inner_steps=16, outer_toml=delayed_nesterov(0.7, 0.9), **GRPO),
    # N = 2, H = 4 (32 rounds): the most outer steps of the sweep, where outer momentum has the most rounds to act
    Arm("grpo-sync-N2", nodes=1, inner_steps=16, tasks_per_step=2, sync=True, **GRPO),
    Arm("grpo-avg-N2-H4", nodes=2, inner_steps=4, averaging=True, **GRPO),
    *(Arm(f"grpo-nesterov-lr{lr}-m{m}-N2-H4", nodes=2, inner_steps=4, outer=(lr, m, True), **GRPO)
      for lr, m in ((0.5, 0.5), (0.7, 0.9))),
    Arm("grpo-delayed-lr0.7-m0.9-d4-N2-H4", nodes=2, inner_steps=4, outer_toml=delayed_nesterov(0.7, 0.9), **GRPO),
    # N = 8, H = 4 (8 rounds): where the outer lr that works best is expected to grow (arXiv 2503.09799)
    Arm("grpo-sync-N8", nodes=1, inner_steps=16, tasks_per_step=8, sync=True, **GRPO),
    Arm("grpo-avg-N8-H4", nodes=8, inner_steps=4, averaging=True, **GRPO),
    *(Arm(f"grpo-nesterov-lr{lr}-m{m}-N8-H4", nodes=8, inner_steps=4, outer=(lr, m, True), **GRPO)
      for lr, m in ((0.5, 0.5), (0.7, 0.9))),
    Arm("grpo-delayed-lr0.7-m0.9-d4-N8-H4", nodes=8, inner_steps=4, outer_toml=delayed_nesterov(0.7, 0.9), **GRPO),
    # N = 8, H = 16: run with --budget 2048 (4 rounds; beside grpo-sync-N8 at the same budget, in its own --out)
    Arm("grpo-avg-N8-H16", nodes=8, inner_steps=16, averaging=True, **GRPO),
    Arm("grpo-nesterov-lr0.7-m0.9-N8-H16", nodes=8, inner_steps=16, outer=(0.7, 0.9, True), **GRPO),
    Arm("grpo-delayed-lr0.7-m0.9-d4-N8-H16", nodes=8, inner_steps=16, outer_toml=delayed_nesterov(0.7, 0.9), **GRPO),
    # H = 64: run with --budget 2048 at N = 2, 4096 at N = 4, 8192 at N = 8 (4 rounds; beside grpo-sync-N{n} at the
    # same budget, in its own --out)
    *(arm for n in (2, 4, 8) for arm in (
        Arm(f"grpo-avg-N{n}-H64", nodes=n, inner_steps=64, averaging=True, **GRPO),
        Arm(f"grpo-nesterov-lr0.7-m0.9-N{n}-H64", nodes=n, inner_steps=64, outer=(0.7, 0.9, True), **GRPO),
        Arm(f"grpo-delayed-lr0.7-m0.9-d4-N{n}-H64", nodes=n, inner_steps=64, outer_toml=delayed_nesterov(0.7, 0.9),
            **GRPO))),
    # N = 8, H = 64: is plain Nesterov's lead over averaging its step size, not its momentum? SGD without momentum
    # at Nesterov 0.7 / 0.9's first step, lr x (1 + m) = 1.33 mean pseudo-gradients, and at its mean step over 4
    # rounds (1.33, 1.90, 2.41, 2.87 for a constant pseudo-gradient: 2.1) (--budget 8192)
    *(Arm(f"grpo-sgd-lr{lr}-N8-H64", nodes=8, inner_steps=64, outer=(lr, 0.0, False), **GRPO) for lr in (1.33, 2.1)),
    # The coding env (configs/coding.toml: its own tokenizer, GRPO alone, T = 1, inner lr 1e-4), N = 4, H = 16 against
    # its sync baseline
    Arm("coding-sync-N4", nodes=1, inner_steps=16, tasks_per_step=4, sync=True, base=CODING, **GRPO),
    Arm("coding-avg-N4-H16", nodes=4, inner_steps=16, averaging=True, base=CODING, **GRPO),
    # the coding baseline at other inner lrs (with the project's tokenizer 2e-5 did not learn at 2,048 episodes, 5e-5
    # unlearned and 1e-4 collapsed; with the coding env's own, 2e-5 against the config's 1e-4)
    *(Arm(f"coding-sync-N4-lr{name}", nodes=1, inner_steps=16, tasks_per_step=4, sync=True, base=CODING,
          inner_lr=lr, **GRPO) for name, lr in (("2e-5", 2e-5), ("5e-5", 5e-5))),
    Arm("coding-delayed-lr0.7-m0.9-d4-N4-H16", nodes=4, inner_steps=16, outer_toml=delayed_nesterov(0.7, 0.9),
        base=CODING, **GRPO),
    # the published composite (GRPO + 0.2 SDPO + 0.2 DPO) beside coding-avg-N4-H16 (GRPO alone), and each channel alone
    Arm("coding-composite-avg-N4-H16", nodes=4, inner_steps=16, averaging=True, base=CODING),
    Arm("coding-sdpo-avg-N4-H16", nodes=4, inner_steps=16, averaging=True, base=CODING, beta_dpo=0.0),
    Arm("coding-dpo-avg-N4-H16", nodes=4, inner_steps=16, averaging=True, base=CODING, alpha_sdpo=0.0),
    # issue 40: DPO whose chosen is the whole scripted recovery (dpo_score = "recovery"), alone beside GRPO
    Arm("coding-dpo-recovery-avg-N4-H16", nodes=4, inner_steps=16, averaging=True, base=CODING, alpha_sdpo=0.0,
        dpo_score="recovery"),
    # the sparse codec on the shipped loss, beside grpo-avg-N4-H16 (section 1d) and sparse-N4-H16 (the old composite)
    Arm("grpo-sparse-N4-H16", nodes=4, inner_steps=16, averaging=True, compression="sparse-2bit", **GRPO),
    # the shared-blocks codec (block top-k on a shared selection, in the butterfly), beside the two above
    Arm("grpo-blocks-N4-H16", nodes=4, inner_steps=16, averaging=True, compression="shared-blocks", **GRPO),
    # twice the blocks in int8 instead of fp16: the same bytes of values (BENCHMARKS.md 2b)
    Arm("grpo-blocks-d32-int8-N4-H16", nodes=4, inner_steps=16, averaging=True, compression="shared-blocks",
        codec_options='density = 0.03125\nvalues = "int8"', **GRPO),
]
# issue 40 item 3: the channels on a warm start whose policy was taught to read SDPO's hint (hint_rate 1: every failed
# call of a demonstration is followed by the hint; 300 steps, where its teacher beats its student by +0.46 ± 0.12,
# BENCHMARKS.md 1c), against the same 300-step warm start without hints; N = 2, H = 4 (the README's run) and N = 4,
# H = 16
HINTED, UNHINTED = "steps = 300\nhint_rate = 1.0", "steps = 300"
ARMS += [
    Arm("ws300-grpo-avg-N2-H4", nodes=2, inner_steps=4, averaging=True, warmstart=UNHINTED, **GRPO),
    Arm("ws300-sdpo-avg-N2-H4", nodes=2, inner_steps=4, averaging=True, warmstart=UNHINTED, beta_dpo=0.0),
    Arm("hint1-grpo-avg-N2-H4", nodes=2, inner_steps=4, averaging=True, warmstart=HINTED, **GRPO),
    Arm("hint1-sdpo-avg-N2-H4", nodes=2, inner_steps=4, averaging=True, warmstart=HINTED, beta_dpo=0.0),
    Arm("hint1-composite-avg-N2-H4", nodes=2, inner_steps=4, averaging=True, warmstart=HINTED),
    Arm("hint1-grpo-avg-N4-H16", nodes=4, inner_steps=16, averaging=True, warmstart=HINTED, **GRPO),
    Arm("hint1-sdpo-avg-N4-H16", nodes=4, inner_steps=16, averaging=True, warmstart=HINTED, beta_dpo=0.0),
]

SMOKE_ARMS = [Arm("diloco-N2-H2", nodes=2, inner_steps=2)]


def run_arm(arm: Arm, seed: int, budget: int, out: Path, eval_episodes: int = 0) -> Path:
    """Play one arm with one seed (skipped when its run already finished); returns its run directory.

    ``eval_episodes > 0`` ends the run with simulate's fixed held-out evaluation (warm start against the final
    model, section 1b); its ``eval: ...`` lines are kept in ``done.json``.

    Raises:
        SystemExit: the simulation exited non-zero (its stderr tail is shown).
    """
    run_dir = out / arm.name / f"seed{seed}"
    done = run_dir / "done.json"
    if done.is_file():
        return run_dir
    if run_dir.exists():  # an interrupted attempt: start it over
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)  # one warm start (the "pretrained" policy) for every arm and seed: the per-user cache
    rounds = arm.rounds(budget)
    config = run_dir / "config.toml"
    config.write_text(arm.config_toml(seed, rounds))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "coordinator", "simulate", "--eval-episodes", str(eval_episodes), "--nodes", str(arm.nodes),
                             "--config", str(config), "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"{arm.name} seed {seed}: simulate exited {result.returncode}\n{result.stderr[-3000:]}")
    evals = [line for line in result.stdout.splitlines() if line.startswith("eval: ")]
    done.write_text(json.dumps({"arm": arm.name, "seed": seed, "rounds": rounds,
                                "wall_s": round(time.monotonic() - started, 1), "eval": evals}))
    print(f"{arm.name} seed {seed}: {rounds} rounds in {time.monotonic() - started:.0f} s", flush=True)
    return run_dir


def step_curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """``[(samples trained so far, mean reward, success rate), ...]`` per inner step of the whole swarm.

    Step ``j`` of round ``r`` is placed after the samples of rounds < r plus ``j + 1`` steps of every node.
    """
    nodes = {name: recs for name, recs in read_metrics(run_dir).items()
             if recs and recs[0].get("role") == "node"}
    rounds = sorted({rec["round"] for recs in nodes.values() for rec in recs})
    curve, before = [], 0
    for r in rounds:
        at = [rec for recs in nodes.values() for rec in recs if rec["round"] == r]
        steps = max(len(rec["step_rewards"]) for rec in at)
        per_step = sum(rec["samples"] for rec in at) / steps
        for j in range(steps):
            rewards = [rec["step_rewards"][j] for rec in at if j < len(rec["step_rewards"])]
            success = [rec["step_success"][j] for rec in at if j < len(rec["step_success"])]
            curve.append((round(before + (j + 1) * per_step), statistics.fmean(rewards), statistics.fmean(success)))
        before += sum(rec["samples"] for rec in at)
    return curve


def flat_groups(run_dir: Path) -> float | None:
    """The nodes' ``frac_reward_zero_std`` (GRPO groups whose rewards are all equal: no advantage, no GRPO signal)
    averaged over every node-round of the run; None for a run whose metrics predate the key."""
    values = [rec["frac_reward_zero_std"] for recs in read_metrics(run_dir).values() for rec in recs
              if rec.get("role") == "node" and "frac_reward_zero_std" in rec]
    return statistics.fmean(values) if values else None


def binned(curve: list[tuple[int, float, float]], width: int) -> dict[int, tuple[float, float]]:
    """Mean (reward, success) of the steps whose sample count falls in each bin ``(k - 1) * width < x <= k * width``,
    keyed by the bin's right edge."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for x, reward, success in curve:
        edge = -(-x // width) * width
        bins.setdefault(edge, []).append((reward, success))
    return {edge: (statistics.fmean(v[0] for v in vs), statistics.fmean(v[1] for v in vs))
            for edge, vs in sorted(bins.items())}


_EVAL = re.compile(r"eval: (greedy|sampled T=[\d.]+): warm start ([\d.]+) -> round \d+ ([\d.]+) "
                   r"\(([+-][\d.]+) \+- ([\d.]+) paired se, (\d+) tasks\)")


def parse_eval(lines: list[str]) -> dict[str, tuple[float, float, float]]:
    """simulate's ``eval: ...`` lines as ``{"greedy" | "sampled": (warm start, final - warm start, paired se)}``."""
    out = {}
    for line in lines:
        m = _EVAL.match(line)
        if m:
            out["greedy" if m[1] == "greedy" else "sampled"] = (float(m[2]), float(m[4]), float(m[5]))
    return out


def summarize(out: Path, width: int) -> dict[str, dict]:
    """Per arm: the binned curves of each finished seed, the across-seed mean/min/max, the mean reward over the
    first quarter of the budget, the final score (mean reward and success over the last quarter), the rounds
    (syncs) and the wall seconds."""
    summary = {}
    for arm in ARMS + SMOKE_ARMS:
        seeds = sorted((out / arm.name).glob("seed*/done.json"))
        if not seeds:
            continue
        per_seed, firsts, finals, walls, rounds, evals, flats = [], [], [], [], 0, [], []
        for done in seeds:
            info = json.loads(done.read_text())
            evals.append(parse_eval(info.get("eval", [])))
            curve = step_curve(done.parent)
            per_seed.append(binned(curve, width))
            last = curve[-1][0]
            tail = [c for c in curve if c[0] > 0.75 * last]
            firsts.append(statistics.fmean(c[1] for c in curve if c[0] <= 0.25 * last or c is curve[0]))
            finals.append((statistics.fmean(c[1] for c in tail), statistics.fmean(c[2] for c in tail)))
            walls.append(info["wall_s"])
            rounds = info["rounds"]
            if (flat := flat_groups(done.parent)) is not None:
                flats.append(flat)
        edges = sorted(set.intersection(*(set(b) for b in per_seed)))
        band = {e: [b[e][0] for b in per_seed] for e in edges}
        summary[arm.name] = {
            "seeds": len(seeds), "rounds": rounds, "wall_s": statistics.fmean(walls),
            "first_reward": firsts, "final_reward": [f[0] for f in finals], "final_success": [f[1] for f in finals],
            "curve": {e: (statistics.fmean(v), min(v), max(v)) for e, v in band.items()},
            "eval": evals, "flat_groups": flats,
        }
    return summary


def plot(summary: dict[str, dict], figures: Path) -> list[Path]:
    """Reward-vs-samples PNGs (mean line, min-max band over seeds): DiLoCo N=2 and N=4 against their synchronous
    baselines, and the channel ablation. Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {
        "learning_n2.png": ("N = 2 nodes (parameter averaging) vs one synchronous process",
                            ["sync-N2", "avg-N2-H4", "avg-N2-H16", "avg-N2-H64"]),
        "learning_n4.png": ("N = 4 nodes (parameter averaging) vs one synchronous process",
                            ["sync-N4", "avg-N4-H4", "avg-N4-H16", "avg-N4-H64"]),
        "learning_nesterov.png": ("Outer Nesterov (lr 0.7, momentum 0.9) vs averaging, N = 2",
                                  ["sync-N2", "diloco-N2-H4", "diloco-N2-H16", "diloco-N2-H64", "avg-N2-H16"]),
        "learning_channels.png": ("Loss channels, N = 2, H = 16, averaging",
                                  ["grpo-N2-H16", "grpo+sdpo-N2-H16", "avg-N2-H16"]),
        "learning_hinted.png": ("SDPO on a warm start taught to read its hints (hint1) and without (ws300), N = 2, H = 4",
                                ["ws300-grpo-avg-N2-H4", "ws300-sdpo-avg-N2-H4", "hint1-grpo-avg-N2-H4",
                                 "hint1-sdpo-avg-N2-H4", "hint1-composite-avg-N2-H4"]),
        "learning_hinted_n4.png": ("SDPO on a warm start taught to read its hints, N = 4, H = 16",
                                   ["hint1-grpo-avg-N4-H16", "hint1-sdpo-avg-N4-H16"]),
        "learning_outer_h4.png": ("Outer optimizers, GRPO alone, N = 4, H = 4",
                                  ["grpo-avg-N4-H4", "grpo-nesterov-lr0.5-m0.5-N4-H4",
                                   "grpo-heavyball-lr0.5-m0.5-N4-H4", "grpo-nesterov-lr0.2-m0.8-N4-H4",
                                   "grpo-nesterov-lr0.7-m0.9-N4-H4", "grpo-delayed-lr0.8-m0.5-d4-N4-H4",
                                   "grpo-delayed-lr0.7-m0.9-d4-N4-H4"]),
        "learning_outer_h16.png": ("GRPO alone, N = 4, H = 16: sync, averaging, overlap, Nesterov",
                                   ["grpo-sync-N4", "grpo-avg-N4-H16", "grpo-overlap-N4-H16",
                                    "grpo-nesterov-lr0.5-m0.5-N4-H16"]),
        "learning_outer_n2.png": ("Outer optimizers, GRPO alone, N = 2 (H = 4 solid, H = 16 dashed)",
                                  ["grpo-sync-N2", "grpo-avg-N2-H4", "grpo-nesterov-lr0.5-m0.5-N2-H4",
                                   "grpo-nesterov-lr0.7-m0.9-N2-H4", "grpo-delayed-lr0.7-m0.9-d4-N2-H4",
                                   "grpo-avg-N2-H16", "grpo-nesterov-lr0.5-m0.5-N2-H16",
                                   "grpo-nesterov-lr0.7-m0.9-N2-H16", "grpo-delayed-lr0.7-m0.9-d4-N2-H16"]),
        "learning_outer_n8.png": ("Outer optimizers, GRPO alone, N = 8, H = 4",
                                  ["grpo-sync-N8", "grpo-avg-N8-H4", "grpo-nesterov-lr0.5-m0.5-N8-H4",
                                   "grpo-nesterov-lr0.7-m0.9-N8-H4", "grpo-delayed-lr0.7-m0.9-d4-N8-H4"]),
        "learning_outer_n8_h16.png": ("Outer optimizers, GRPO alone, N = 8, H = 16 (2,048 samples)",
                                      ["grpo-sync-N8", "grpo-avg-N8-H16", "grpo-nesterov-lr0.7-m0.9-N8-H16",
                                       "grpo-delayed-lr0.7-m0.9-d4-N8-H16"]),
        "learning_sparse.png": ("The sparse-2bit codec, GRPO alone, N = 4, H = 16",
                                ["grpo-avg-N4-H16", "grpo-sparse-N4-H16"]),
        "learning_codecs.png": ("The two sparse codecs against none, GRPO alone, N = 4, H = 16",
                                ["grpo-avg-N4-H16", "grpo-sparse-N4-H16", "grpo-blocks-N4-H16",
                                 "grpo-blocks-d32-int8-N4-H16"]),
        "learning_coding.png": ("The coding env (its own tokenizer), N = 4, H = 16",
                                ["coding-sync-N4", "coding-avg-N4-H16", "coding-delayed-lr0.7-m0.9-d4-N4-H16",
                                 "coding-composite-avg-N4-H16", "coding-sdpo-avg-N4-H16", "coding-dpo-avg-N4-H16",
                                 "coding-dpo-recovery-avg-N4-H16",
                                 "coding-sync-N4-lr2e-5"]),
        "learning_outer_h64.png": ("Outer optimizers, GRPO alone, N = 2, H = 64 (2,048 samples)",
                                   ["grpo-sync-N2", "grpo-avg-N2-H64", "grpo-nesterov-lr0.7-m0.9-N2-H64",
                                    "grpo-delayed-lr0.7-m0.9-d4-N2-H64"]),
        **{f"learning_outer_n{n}_h64.png": (f"Outer optimizers, GRPO alone, N = {n}, H = 64 ({1024 * n:,} samples)",
                                            [f"grpo-sync-N{n}", f"grpo-avg-N{n}-H64",
                                             f"grpo-nesterov-lr0.7-m0.9-N{n}-H64",
                                             f"grpo-delayed-lr0.7-m0.9-d4-N{n}-H64",
                                             *(f"grpo-sgd-lr{lr}-N{n}-H64" for lr in (1.33, 2.1))])
           for n in (4, 8)},
    }
    placed = {n for _, names in panels.values() for n in names}
    others = [n for n in summary if n not in placed]  # e.g. the smoke arm
    if others:
        panels["learning_other.png"] = ("Other arms", others)
    figures.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (title, names) in panels.items():
        names = [n for n in names if n in summary]
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name in names:
            curve = summary[name]["curve"]
            xs = sorted(curve)
            label = name if name != "avg-N2-H16" or "channels" not in filename else "grpo+sdpo+dpo-N2-H16"
            dashed = "dashed" in title and name.endswith("-H16")
            ax.plot(xs, [curve[x][0] for x in xs], "--" if dashed else "-",
                    label=f"{label} ({summary[name]['seeds']} seeds)")
            ax.fill_between(xs, [curve[x][1] for x in xs], [curve[x][2] for x in xs], alpha=0.15)
        ax.set_xlabel("samples trained (episodes, all nodes)")
        ax.set_ylabel("mean reward of the step's episodes")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(figures / filename, dpi=110)
        plt.close(fig)
        written.append(figures / filename)
    return written


def table(summary: dict[str, dict]) -> str:
    """Markdown table: first- and last-quarter reward, last-quarter success (mean ± std over seeds, min-max), rounds,
    the share of GRPO groups with equal rewards (`flat_groups`; "-" for runs that predate it), the runs that collapsed
    (last-quarter reward below `COLLAPSED`), wall seconds."""
    def stat(values: list[float]) -> str:
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.fmean(values):.3f} ± {spread:.3f} ({min(values):.3f}-{max(values):.3f})"

    lines = ["| arm | seeds | rounds (syncs) | reward, first quarter | reward, last quarter | success, last quarter "
             "| groups with equal rewards | collapsed | wall s/run |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        collapsed = sum(r < COLLAPSED for r in s["final_reward"])
        lines.append(f"| {name} | {s['seeds']} | {s['rounds']} | {stat(s['first_reward'])} | "
                     f"{stat(s['final_reward'])} | {stat(s['final_success'])} | "
                     f"{stat(s['flat_groups']) if s['flat_groups'] else '-'} | {collapsed}/{s['seeds']} | "
                     f"{s['wall_s']:.0f} |")
    return "\n".join(lines)


def eval_table(summary: dict[str, dict]) -> str:
    """Markdown table of the arms run with ``--eval-episodes``: the fixed held-out evaluation's final - warm start
    per seed (paired se), sampled and greedy, their mean over seeds (± its standard error: std / sqrt(seeds)), and
    the runs whose sampled success fell below `COLLAPSED`."""
    lines = ["| arm | rounds (syncs) | sampled: final - warm start per seed (paired se) | mean ± se | greedy per seed "
             "| collapsed |", "|---|---:|---|---:|---|---|"]
    for name, s in summary.items():
        evals = [e for e in s["eval"] if "sampled" in e]
        if not evals:
            continue
        sampled = [e["sampled"] for e in evals]
        greedy = [e["greedy"][1] for e in evals if "greedy" in e]
        collapsed = sum(w + d < COLLAPSED for w, d, _ in sampled)
        diffs = [d for _, d, _ in sampled]
        mean = f"{statistics.fmean(diffs):+.3f}"
        if len(diffs) > 1:
            mean += f" ± {statistics.stdev(diffs) / len(diffs) ** 0.5:.3f}"
        lines.append(f"| {name} | {s['rounds']} | {' / '.join(f'{d:+.3f} ({se:.3f})' for _, d, se in sampled)} | "
                     f"{mean} | "
                     f"{' / '.join(f'{g:+.3f}' for g in greedy)} | {collapsed}/{len(sampled)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="play the arms (finished runs are kept)")
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    run.add_argument("--budget", type=int, default=1024, help="samples (episodes, all nodes) per run")
    run.add_argument("--arms", nargs="*", default=None, help="arm names (default: all)")
    run.add_argument("--out", type=Path, default=Path("runs/bench-learning"))
    run.add_argument("--eval-episodes", type=int, default=0,
                     help="end each run with the fixed held-out evaluation on this many tasks (0 = none)")
    run.add_argument("--smoke", action="store_true", help="one tiny arm, one seed, one round (CI smoke test)")
    report = sub.add_parser("report", help="table and PNGs from the finished runs")
    report.add_argument("--out", type=Path, default=Path("runs/bench-learning"))
    report.add_argument("--figures", type=Path, default=Path("bench/figures"))
    report.add_argument("--bin", type=int, default=64, help="samples per curve point")
    args = parser.parse_args()

    if args.command == "run":
        arms = SMOKE_ARMS if args.smoke else ARMS
        if args.arms:
            unknown = sorted(set(args.arms) - {a.name for a in arms})
            if unknown:
                raise SystemExit(f"unknown arm(s) {unknown} (expected some of {[a.name for a in arms]})")
            arms = [a for a in arms if a.name in args.arms]
        seeds, budget = ([0], 16) if args.smoke else (args.seeds, args.budget)
        for arm in arms:
            arm.rounds(budget)  # every bad budget fails before the first run
        for seed in seeds:  # seed-major: a cut-short sweep still has every arm at the first seeds
            for arm in arms:
                run_arm(arm, seed, budget, args.out, args.eval_episodes)
        return
    summary = summarize(args.out, args.bin)
    if not summary:
        raise SystemExit(f"--out {str(args.out)!r} holds no finished run (expected ARM/seedK/done.json)")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    evals = eval_table(summary)
    if evals:
        print(f"\nThe fixed held-out evaluation:\n\n{evals}")
    for path in plot(summary, args.figures):
        print(path)


if __name__ == "__main__":
    main()
