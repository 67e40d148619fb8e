"""Where one inner step's seconds go, op by op: a node's trainer in this process, placed as a node places it, its
steps timed by phase (`composer_diloco.timing.PhaseClock`, the node's ``inner_phase_seconds``) and one step under
``torch.profiler``.

For each ``--dtype`` in turn (a fresh model each): ``--steps`` inner steps of `ComposerGRPOTrainer` against one local
env server of the run's env, the model placed by `nodes.device.Placement` (bf16: frozen linears in bf16, autocast
forward, TRL's bf16 flag), the micro-batch the whole step (as the node picks when it fits). Per step: seconds, the
phase split, generated tokens. The last step runs under the profiler: the ops with the most self device time and
the most self host time, how many device kernels ran, and their summed device time over the step's wall time (near 1:
the device is the bound; far below: the host, launching kernels, is).

    python bench/profile_step.py --model runs/qwen3-0.6b-random --config runs/gpu/configs/0.6b-16ep-batched.toml \\
        --device cuda --dtype fp32 bf16 --json OUT.json
    (CPU: --device cpu; the config of the 16-episode step: `bench/gpu.py` writes it under OUT/configs)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def profile(model_dir: Path, config_path: Path, device: str, dtype: str, steps: int, top: int) -> dict:
    """The steps of one precision (module docstring): ``{"dtype", "steps": [...], "profile": {...}}``."""
    import torch
    from transformers import TrainerCallback

    from composer_diloco.config import load_config
    from composer_diloco.inner.trainer import ComposerGRPOTrainer, grpo_args
    from composer_diloco.policy import load_policy
    from composer_diloco.policy.lora import apply_lora
    from composer_diloco.rollout.env_process import start_env_server
    from composer_diloco.rollout.sessions import open_env_sessions
    from composer_diloco.timing import PhaseClock, cuda_sync_for
    from nodes.device import Placement

    config = load_config(config_path, model=str(model_dir))
    placement = Placement.resolve(device, dtype)
    model, tokenizer = load_policy(str(model_dir), seed=config.seed, warmstart_steps=0)
    if config.lora is not None:
        model = apply_lora(model, config.lora)
    model = placement.place(model)
    server = start_env_server(config.env.server_module, startup_timeout_s=60, args=config.env.server_args)
    clock = PhaseClock("trainer", sync=cuda_sync_for(placement.device))
    record: dict = {"dtype": placement.dtype, "steps": []}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if placement.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    marks: dict = {}

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.take()
            if state.global_step == steps - 1:
                prof.__enter__()
            marks["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if placement.device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - marks["t0"]
            if state.global_step == steps:
                prof.__exit__(None, None, None)
            last = trainer.round_stats.steps[-1]
            record["steps"].append({"seconds": round(seconds, 3), "profiled": state.global_step == steps,
                                    "phases": {k: round(v, 3) for k, v in clock.take().items()},
                                    "sdpo_sites": last.sdpo_sites, "dpo_pairs": last.dpo_pairs})
            print(json.dumps({"dtype": placement.dtype, **record["steps"][-1]}), flush=True)

    try:
        sessions = open_env_sessions([server.url], config.batch_size, max_tool_calls=config.env.max_tool_calls,
                                     reset_kwargs=config.env.reset_kwargs)
        args = grpo_args(config, output_dir=Path(tempfile.mkdtemp()), max_steps=steps, use_cpu=placement.use_cpu,
                         bf16=placement.bf16)
        trainer = ComposerGRPOTrainer(model=model, tokenizer=tokenizer, config=config, sessions=sessions,
                                      peer_name="profile", args=args, callbacks=[Steps()], clock=clock)
        trainer.train()
        for s in sessions:
            s.close()
    finally:
        server.stop()
    events = prof.key_averages()
    device_key = "self_device_time_total" if placement.device == "cuda" else "self_cpu_time_total"
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    wall_s = record["steps"][-1]["seconds"]
    device_s = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6 if kernels else 0.0
    record["profile"] = {
        "wall_s": wall_s, "kernels": kernels, "device_busy_s": round(device_s, 3),
        "device_busy_share": round(device_s / wall_s, 3) if wall_s else None,
        "host_ops": sum(e.count for e in events),
        "top_device": [{"op": e.key, "calls": e.count, "ms": round(getattr(e, device_key) / 1e3, 2)}
                       for e in sorted(events, key=lambda e: -getattr(e, device_key))[:top]],
        "top_host": [{"op": e.key, "calls": e.count, "ms": round(e.self_cpu_time_total / 1e3, 2)}
                     for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]],
    }
    print(json.dumps({"dtype": placement.dtype, **{k: v for k, v in record["profile"].items()
                                                   if not k.startswith("top")}}), flush=True)
    for key in ("top_device", "top_host"):
        for row in record["profile"][key]:
            print(f"  {placement.dtype} {key:10s} {row['ms']:10.2f} ms {row['calls']:7d} x {row['op'][:90]}")
    return record


def main() -> None:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a save_pretrained folder (bench/real_arch.py build)")
    ap.add_argument("--config", type=Path, required=True, help="the run config")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "auto"])
    ap.add_argument("--steps", type=int, default=3, help="inner steps per precision (the last one is profiled)")
    ap.add_argument("--top", type=int, default=15, help="ops listed per table")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: expected at least 2 (the first step warms up, the last is profiled)")
    records = [profile(a.model, a.config, a.device, d, a.steps, a.top) for d in a.dtype]
    if a.json:
        a.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
