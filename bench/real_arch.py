"""Qwen3 architectures at their real size, on CPU, with no download: a random model to run, and the memory table.

``build`` writes a randomly initialised ``Qwen3ForCausalLM`` of Qwen3-0.6B's (or 1.7B's, 4B's, 8B's) architecture,
made from a ``transformers.Qwen3Config`` written out below (the sizes of the published ``config.json`` files), as a
``save_pretrained`` folder with the project's shipped tokenizer and chat template (``composer_diloco/assets/``). The
vocabulary stays 151,936 rows although the shipped tokenizer uses the first 878 ids: memory and compute are those of
the real model; an id above 877 decodes to nothing.

Random weights never write a tool call, and a node that ends a run without one exits 1 ("trained on nothing"). So the
folder's weights are random except for one planted lookup table, which makes the model write a well-formed tool call
every turn: every decoder layer's residual writes (``o_proj``, ``down_proj``) are scaled by 0.01, and 10 neurons of
layer 0's MLP map each token of a call to the next one (gate and up rows = the token's embedding direction, the down
column = the next token's; the calls' embedding rows are rescaled so the next token's logit is about 25 at any width).
The call is ``add(a=1, b=2)`` or, with even odds, ``add(a=1)`` (an ``invalid_args`` tool error), so episodes have
tool errors, recoveries, SDPO sites and DPO pairs, and the inner steps real gradients. The shapes, the parameter
count, the FLOPs and the memory are those of the real model; no call answers the task (reward 0).

``plan`` prints the memory plan (`composer_diloco.policy.memory_plan`) of each architecture, full fine-tuning and
LoRA r = 16, and which of 24 / 48 / 80 GB it fits at which micro-batch. ``measure`` measures one inner step of a
folder on this CPU (`measure_training_bytes`, in a fresh process: GRPO through TRL's fused LM head, SDPO and DPO rows,
the DPO reference pass) next to its plan. ``config`` writes a run config with changed settings (e.g. longer
episodes); ``simulate`` prints, per node and round, the measured memory peak next to the planned one
(``memory_peak_bytes`` / ``memory_planned_bytes`` of the metrics lines).

Run:
    python bench/real_arch.py build --arch 0.6b --out runs/qwen3-0.6b-random
    python bench/real_arch.py plan [--seq-len 1024] [--json out.json]
    python bench/real_arch.py measure --model runs/qwen3-0.6b-random --rows 2 --seq-len 256 [--lora] \
        [--sdpo-rows 2 --dpo-pairs 1 --response-tokens 16]
    python bench/real_arch.py config --base configs/qwen3_0.6b_lora.toml --out runs/long.toml \
        --set max_seq_len=512 --set env.max_tool_calls=4      (a config with other settings)
    python bench/real_arch.py steps --model runs/qwen3-0.6b-random [--steps 4] [--full]   (rollout / prep / train:
        seconds and peak resident set)
    python bench/real_arch.py simulate --run-dir runs/real-0.6b -- --model runs/qwen3-0.6b-random --nodes 2 \\
        --config configs/qwen3_0.6b_lora.toml       (simulate, with each process's peak RSS)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

ARCHS = {  # Qwen/Qwen3-*/config.json (hidden, layers, heads, kv heads, head_dim, intermediate, tied embeddings)
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=6144, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
}
GPUS_GB = (24, 48, 80)
LORA = dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def qwen3_config(arch: str, tokenizer=None, **overrides):
    """The ``Qwen3Config`` of ``arch`` (one of `ARCHS`): head_dim 128, vocab 151,936, RoPE theta 1e6, 40,960
    positions, RMSNorm eps 1e-6; pad/eos from ``tokenizer`` when given; ``overrides`` replace any of these
    (e.g. ``num_hidden_layers``, ``vocab_size``)."""
    from transformers import Qwen3Config

    extra = {} if tokenizer is None else dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                              bos_token_id=None)
    kwargs = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, initializer_range=0.02, use_cache=True,
                  **ARCHS[arch], **extra)
    return Qwen3Config(**{**kwargs, **overrides})


def build(arch: str, out: Path, seed: int = 0, plant: bool = True, **overrides) -> Path:
    """Write the random ``arch`` model with the shipped tokenizer to ``out`` (``save_pretrained``, fp32);
    ``overrides`` change the architecture's sizes (`qwen3_config`: e.g. ``num_hidden_layers=2`` for a dry run)."""
    from transformers import AutoModelForCausalLM

    from composer_diloco.policy import load_default_tokenizer
    from composer_diloco.policy.planted import plant_calls

    tokenizer = load_default_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen3_config(arch, tokenizer, **overrides), dtype=torch.float32)
    if plant:
        plant_calls(model, tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: Qwen3 {arch} architecture, {n:,} parameters, random init (seed {seed})"
          f"{', planted tool call' if plant else ''}")
    return out


def plan_table(seq_len: int = 1024, episodes: int = 8) -> list[dict]:
    """One row per architecture and mode (full fine-tuning, LoRA r = 16 on q/k/v/o) of the memory plan on a CUDA GPU
    with bf16 autocast, the default run config with SDPO and DPO on (0.2 each: one SDPO row per episode and 2 * ceil(8
    / K) DPO rows per micro-batch) with rows of ``seq_len`` tokens (``max_seq_len``: the plan's rows when tool replies
    are not capped) and ``episodes`` per inner step: the device bytes at micro-batch 1 (K = ``episodes``), the host
    bytes, and per GPU size (24 / 48 / 80 GB, 95 % usable) the largest micro-batch b of 8, 4, 2, 1 (K = episodes / b)
    that fits, first without then with gradient checkpointing (`composer_diloco.policy.memory_plan.choose_batch`'s
    order)."""
    from composer_diloco.config import LoraSection, LossConfig, load_config
    from composer_diloco.policy.memory_plan import plan_for_run

    # SDPO and DPO on (0.2 each, as section 7 was measured; they default off): full FT then keeps a reference copy
    config = load_config(None, model="qwen3", max_seq_len=seq_len, loss=LossConfig(alpha_sdpo=0.2, beta_dpo=0.2))
    rows = []
    for arch in ARCHS:
        for mode in ("full", "lora"):
            lora = LoraSection(**LORA) if mode == "lora" else None
            cfg = qwen3_config(arch)

            def plan(b, gc, bf16=True, device="cuda"):
                return plan_for_run(config, cfg, micro_batch=b, grad_accum=episodes // b, device=device, bf16=bf16,
                                    gradient_checkpointing=gc, free=None, lora=lora)

            p1 = plan(1, False)
            row = dict(arch=arch, mode=mode, params=p1.shape.params_total, trainable=p1.shape.params_trainable,
                       weights_gb=p1.weights / 1e9, optimizer_gb=p1.optimizer / 1e9, reference_gb=p1.reference / 1e9,
                       gradients_gb=p1.gradients / 1e9, device_gb_b1=p1.device_bytes / 1e9,
                       device_gb_b1_gc=plan(1, True).device_bytes / 1e9, host_gb=p1.host_bytes / 1e9,
                       cpu_fp32_gb_b1=plan(1, False, bf16=False, device="cpu").need / 1e9)
            for gb in GPUS_GB:
                fit = "no"
                for gc in (False, True):
                    ok = [b for b in (8, 4, 2, 1) if plan(b, gc).device_bytes <= gb * 1e9 * 0.95]
                    if ok:
                        fit = f"b={max(ok)}{' +gc' if gc else ''}"
                        break
                row[f"fits_{gb}"] = fit
            rows.append(row)
    return rows


def measure(model_dir: Path, rows: int, seq_len: int, lora: bool, reference: bool = True, sdpo_rows: int = 0,
            dpo_pairs: int = 0, response_tokens: int = 16) -> dict:
    """Measure one inner step of the folder's model on CPU in a fresh process (`measure_training_bytes` with
    ``MALLOC_MMAP_THRESHOLD_=65536``): ``rows`` GRPO rows, ``sdpo_rows`` SDPO sites and ``dpo_pairs`` DPO pairs of
    ``seq_len`` tokens (``response_tokens`` of each SDPO/DPO row scored), next to the plan's state, activation and
    reference-pass bytes (`activation_bytes` with the channels' `LossChannel.memory`, DPO's `reference_pass_bytes`)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoConfig
from composer_diloco.config import LoraSection
from composer_diloco.channels.dpo import DpoChannel, DpoSettings, reference_pass_bytes
from composer_diloco.channels.sdpo import SdpoChannel, SdpoSettings
from composer_diloco.config import RunConfig
from composer_diloco.policy.memory_measure import measure_training_bytes
from composer_diloco.policy.memory_plan import StepShape, activation_bytes, model_shape, plan_memory
lora = LoraSection(**{LORA!r}) if {lora} else None
cfg = AutoConfig.from_pretrained({str(model_dir)!r})
m = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, dtype=torch.float32)
if lora is not None:
    from composer_diloco.policy.lora import apply_lora
    m = apply_lora(m, lora)
meas = measure_training_bytes(m, rows={rows}, seq_len={seq_len}, reference={reference}, lora=lora is not None,
                              sdpo_rows={sdpo_rows}, dpo_pairs={dpo_pairs}, response_tokens={response_tokens})
shape = model_shape(cfg, lora)
step = lambda b: StepShape(shape=shape, micro_batch=b, grad_accum=1, seq_len={seq_len}, response_tokens={response_tokens})
pairs = RunConfig(preference=dict(max_sites=max({dpo_pairs}, 1), max_pairs_per_turn=1))  # DPO plans the config's pairs
sdpo = [SdpoChannel.memory(SdpoSettings(), pairs, step({sdpo_rows}))] if {sdpo_rows} else []
dpo = [DpoChannel.memory(DpoSettings(), pairs, step(1))]
plan = plan_memory(shape, micro_batch={rows}, seq_len={seq_len}, channels=dpo if {reference} else [])
act = activation_bytes(shape, {rows}, {seq_len}, channels=sdpo + (dpo if {dpo_pairs} else []))
print(json.dumps(dict(measured=meas, plan_state=plan.optimizer + plan.reference, plan_gradients=plan.gradients,
                      plan_activations=act, plan_peak=plan.optimizer + plan.reference
                      + max(act + plan.gradients // 4, plan.gradients + plan.step_transient),
                      plan_reference_pass=reference_pass_bytes(shape, max({dpo_pairs}, 1), {seq_len},
                                                               response_tokens={response_tokens}),
                      weights=plan.weights)))
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def write_config(base: Path, out: Path, settings: list[str]) -> Path:
    """Write ``base`` (a TOML run config) with each ``KEY=VALUE`` of ``settings`` set to ``out``: ``KEY`` a dotted
    name (``max_seq_len``, ``env.max_tool_calls``), ``VALUE`` a TOML value (``512``, ``"text"``). The result is read
    back with `composer_diloco.config.load_config`, so a bad setting fails here with the config's own message.

    Raises:
        ValueError: a setting without ``=``; ConfigError: the written config is not valid.
    """
    import tomllib

    import tomli_w

    from composer_diloco.config import load_config

    data = tomllib.loads(base.read_text())
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ValueError(f"--set {setting!r}: expected KEY=VALUE, e.g. env.max_tool_calls=4")
        *sections, name = key.strip().split(".")
        table = data
        for section in sections:
            table = table.setdefault(section, {})
        table[name] = tomllib.loads(f"v = {value.strip()}")["v"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {base} with {', '.join(settings)} (bench/real_arch.py config)\n" + tomli_w.dumps(data))
    load_config(out)
    return out


def watch_simulate(args: list[str], run_dir: Path, poll_s: float = 1.0, timeout_s: float | None = None) -> dict:
    """Run ``python -m coordinator simulate ARGS --run-dir RUN_DIR`` and record each process's peak resident set
    (``VmHWM`` of ``/proc/PID/status``, read every ``poll_s`` seconds while it lives) by its name (``coordinator``,
    ``node-i``, or the command for hivemind's and the env servers' helper processes). After ``timeout_s`` seconds
    (None: no limit) simulate is stopped (TERM: it stops its processes) and its exit code is what it returns then.

    Returns:
        ``{"exit": simulate's exit code, "seconds": wall seconds, "peak_rss": {name: bytes}, "rounds": the metrics
        lines of every peer}``.
    """
    import signal
    import time

    import psutil

    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "simulate", *args, "--run-dir", str(run_dir)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    peaks: dict[str, int] = {}
    parent = psutil.Process(proc.pid)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a TERM still stops simulate (finally)
    try:
        while proc.poll() is None:
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                print(f"simulate ran past {timeout_s:.0f} s: stopping it", file=sys.stderr)
                break
            try:
                children = parent.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for child in children:
                try:
                    cmd = child.cmdline()
                    name = cmd[cmd.index("--name") + 1] if "--name" in cmd else (
                        "coordinator" if "coordinator" in cmd and "start" in cmd else
                        f"{child.name()} (pid {child.pid}, parent {child.ppid()})")
                    hwm = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{child.pid}/status").read_text()
                               .splitlines() if line.startswith("VmHWM:"))
                except (psutil.Error, OSError, ValueError, StopIteration):
                    continue
                peaks[name] = max(peaks.get(name, 0), hwm)
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:  # simulate stops its children with TERM, then KILL, in its own finally
            proc.terminate()
            proc.wait(60)
    rounds = {}
    for path in sorted(run_dir.glob("*/metrics.jsonl")):
        rounds[path.parent.name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"exit": proc.wait(), "seconds": round(time.monotonic() - t0, 1), "peak_rss": peaks, "rounds": rounds}


def time_steps(model_dir: Path, config_path: Path, steps: int, *, lora: bool = True,
               gradient_checkpointing: bool = False) -> list[dict]:
    """Seconds of ``steps`` inner steps of one node's trainer (`ComposerGRPOTrainer`, in this process, against one
    local env server of the run's env), each split into

        rollout  TRL's ``rollout_func``: generation + env calls
        prep     the rest of ``_generate_and_score_completions``: rewards, advantages, the SDPO/DPO collation, DPO
                 trace replay and the reference log-probs
        train    the rest of the step: loss + backward + AdamW step

    (the split of ``bench/overhead.py``). ``lora`` False drops the config's ``[lora]`` (full fine-tuning).

    Returns:
        one dict per step: ``step_s``, ``rollout_s``, ``prep_s``, ``train_s``, ``sdpo_sites``, ``dpo_pairs``,
        ``tokens`` (prompt + completion tokens of the step's episodes), ``longest`` (the longest episode, tokens), and
        ``rollout_gb`` / ``prep_gb`` / ``train_gb``: the process's peak resident set in each part (``VmHWM``, reset
        through ``/proc/self/clear_refs`` at each part's start) over its resident set before the model was loaded.
    """
    import tempfile
    import time

    from transformers import TrainerCallback

    from composer_diloco.config import load_config
    from composer_diloco.inner.trainer import ComposerGRPOTrainer, grpo_args
    from composer_diloco.policy import load_policy
    from composer_diloco.policy.lora import apply_lora
    from composer_diloco.rollout.env_process import start_env_server
    from composer_diloco.rollout.sessions import open_env_sessions

    from composer_diloco.policy.memory_plan import PeakMemory

    peak = PeakMemory("cpu")  # its baseline: this process before the model is loaded
    config = load_config(config_path, model=str(model_dir))
    if not lora:
        config = config.model_copy(update={"lora": None})
    model, tokenizer = load_policy(str(model_dir), seed=config.seed, warmstart_steps=0)
    if config.lora is not None:
        model = apply_lora(model, config.lora)
    server = start_env_server(config.env.server_module, startup_timeout_s=60, args=config.env.server_args)
    rows: list[dict] = []
    clock = {"rollout": 0.0, "gen": 0.0, "t0": 0.0}
    gb = {}
    try:
        sessions = open_env_sessions([server.url], config.batch_size, max_tool_calls=config.env.max_tool_calls,
                                     reset_kwargs=config.env.reset_kwargs)
        args = grpo_args(config, output_dir=Path(tempfile.mkdtemp()), max_steps=steps, use_cpu=True, bf16=False)
        if gradient_checkpointing:
            args.gradient_checkpointing = True
            args.gradient_checkpointing_kwargs = {"use_reentrant": False}

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                clock.update(rollout=0.0, gen=0.0, t0=time.perf_counter())
                peak.reset()

            def on_step_end(self, *a, **k):
                step_s = time.perf_counter() - clock["t0"]
                last = trainer.round_stats.steps[-1]
                gb["train_gb"] = (peak.take() or 0) / 1e9
                rows.append({"step_s": step_s, "rollout_s": clock["rollout"], "prep_s": clock["gen"] - clock["rollout"],
                             "train_s": step_s - clock["gen"], "sdpo_sites": last.sdpo_sites,
                             "dpo_pairs": last.dpo_pairs, "tokens": clock.get("tokens", 0),
                             "longest": clock.get("longest", 0), **gb})

        trainer = ComposerGRPOTrainer(model=model, tokenizer=tokenizer, config=config, sessions=sessions,
                                      peer_name="bench", args=args, callbacks=[Clock()])
        rollout, gen = trainer.rollout_func, trainer._generate_and_score_completions

        def timed_rollout(prompts, trainer_):
            t0 = time.perf_counter()
            out = rollout(prompts, trainer_)
            clock["rollout"] += time.perf_counter() - t0
            clock["tokens"] = sum(len(p) + len(c) for p, c in zip(out["prompt_ids"], out["completion_ids"]))
            clock["longest"] = max(len(p) + len(c) for p, c in zip(out["prompt_ids"], out["completion_ids"]))
            gb["rollout_gb"] = (peak.take() or 0) / 1e9
            return out

        def timed_gen(inputs):
            t0 = time.perf_counter()
            out = gen(inputs)
            clock["gen"] += time.perf_counter() - t0
            gb["prep_gb"] = (peak.take() or 0) / 1e9
            return out

        trainer.rollout_func, trainer._generate_and_score_completions = timed_rollout, timed_gen
        trainer.train()
    finally:
        server.stop()
    return rows


def _memory_words(record: dict) -> list[str]:
    """A node's metrics line's memory figures for the printout: measured and planned peak (GB), the longest episode
    (tokens), SDPO sites and DPO pairs; nothing for the coordinator's lines."""
    if record.get("role") != "node":
        return []
    peak, plan = record.get("memory_peak_bytes"), record.get("memory_planned_bytes")
    gb = "peak_gb {} plan_gb {}".format(*("-" if v is None else f"{v / 1e9:.2f}" for v in (peak, plan)))
    return [gb, "episode_tokens_max", str(record.get("episode_tokens_max")), "sdpo_sites",
            str(record.get("sdpo_sites")), "dpo_pairs", str(record.get("dpo_pairs"))]


def main() -> None:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--arch", choices=sorted(ARCHS), default="0.6b")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-plant", action="store_true", help="plain random weights (no tool call will be written)")
    p = sub.add_parser("plan")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--json", type=Path)
    m = sub.add_parser("measure")
    m.add_argument("--model", type=Path, required=True)
    m.add_argument("--rows", type=int, default=2)
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--lora", action="store_true")
    t = sub.add_parser("steps", help="seconds per inner step, split into rollout / prep / train")
    t.add_argument("--model", type=Path, required=True)
    t.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen3_0.6b_lora.toml")
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--full", action="store_true", help="full fine-tuning (drop the config's [lora])")
    t.add_argument("--gradient-checkpointing", action="store_true")
    c = sub.add_parser("config", help="write a run config with other settings")
    c.add_argument("--base", type=Path, default=ROOT / "configs" / "qwen3_0.6b_lora.toml")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted setting and its TOML value, e.g. env.max_tool_calls=4 (repeat)")
    m.add_argument("--sdpo-rows", type=int, default=0)
    m.add_argument("--dpo-pairs", type=int, default=0)
    m.add_argument("--response-tokens", type=int, default=16)
    w = sub.add_parser("simulate", help="coordinator simulate ARGS..., with each process's peak RSS")
    w.add_argument("--run-dir", type=Path, required=True)
    w.add_argument("--out", type=Path, help="write the result as JSON here")
    a, rest = ap.parse_known_args()
    if a.cmd == "simulate":
        result = watch_simulate([r for r in rest if r != "--"], a.run_dir)
        big = {k: v for k, v in result["peak_rss"].items() if v > 50e6}
        print(json.dumps({"exit": result["exit"], "seconds": result["seconds"],
                          "peak_rss_gb": {k: round(v / 1e9, 2) for k, v in big.items()}}, indent=1))
        for name, recs in result["rounds"].items():
            for r in recs:
                print(name, r.get("round"), r.get("global_sha256", "")[:12], "inner_s", r.get("inner_seconds"),
                      "sync_s", r.get("sync_seconds"), "bytes_sent", r.get("bytes_sent"), *_memory_words(r))
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))
        sys.exit(result["exit"])
    if a.cmd == "build":
        build(a.arch, a.out, a.seed, plant=not a.no_plant)
    elif a.cmd == "config":
        print(f"wrote {write_config(a.base, a.out, a.set)}")
    elif a.cmd == "steps":
        rows = time_steps(a.model, a.config, a.steps, lora=not a.full, gradient_checkpointing=a.gradient_checkpointing)
        for i, r in enumerate(rows):
            print(json.dumps({"step": i, **{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}}))
    elif a.cmd == "plan":
        rows = plan_table(a.seq_len)
        print("| model | mode | parameters (trained) | weights | AdamW | reference | gradients | device, b=1 | "
              "device, b=1 +gc | host | 24 GB | 48 GB | 80 GB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| Qwen3-{r['arch'].upper()} | {r['mode']} | {r['params'] / 1e9:.2f} B "
                  f"({r['trainable'] / 1e6:,.1f} M) | {r['weights_gb']:.1f} | {r['optimizer_gb']:.1f} | "
                  f"{r['reference_gb']:.1f} | {r['gradients_gb']:.1f} | {r['device_gb_b1']:.1f} | "
                  f"{r['device_gb_b1_gc']:.1f} | {r['host_gb']:.1f} | {r['fits_24']} | {r['fits_48']} | "
                  f"{r['fits_80']} |")
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
    else:
        print(json.dumps(measure(a.model, a.rows, a.seq_len, a.lora, sdpo_rows=a.sdpo_rows, dpo_pairs=a.dpo_pairs,
                                 response_tokens=a.response_tokens), indent=1))


if __name__ == "__main__":
    main()
