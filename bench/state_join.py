"""Join a full-fine-tuning run at real size on this CPU: a coordinator serving a Qwen3 architecture's state (theta and
the Delayed Nesterov buffers), joiners that download it, check ``global_sha256`` and exit; seconds, MB/s and each
process tree's peak memory.

    python bench/real_arch.py build --arch 0.6b --out runs/qwen3-0.6b-random           # 25 s, 2.4 GB of fp32
    python bench/state_join.py run --model runs/qwen3-0.6b-random --run-dir runs/state-join [--joiners 2] [--round 0]

``--round 1`` (the default): the coordinator resumes (``composer-coordinator start --resume``) from a checkpoint of
round 1 written by this bench (``prepare``), whose theta is the base plus seeded noise and whose outer optimizer state
is seeded noise: nothing the joiner holds matches, every byte of the state travels. ``--round 0``: a new run from the
``--model``; a joiner that loaded the same ``--model`` holds all of it (nothing travels). A joiner does what
`nodes.node.Node.join` does for the state and nothing else (no env server, no memory plan, no training): start a DHT
peer, read the run config, build the policy from ``--model`` (`composer_diloco.policy.load.policy_skeleton`), hash it as the run's base,
`DiLoCoPeer.load_state_from_peers`, compare theta's SHA-256 with the checkpoint's, exit. ``--code DIR`` runs the
coordinator and the joiners from another checkout (the code before the change: its joiners time out).

``cut --layers 8 --out DIR`` writes Qwen3-0.6B's architecture cut to 8 decoder layers (281M parameters, 3.4 GB of
state), the size the issue's CPU run failed at.

Memory: `bench.memory.TreeMemory` samples each tree (the process, hivemind's averager and DHT children, p2pd) every
0.5 s: USS is what the tree holds alone, PSS adds its share of shared memory (hivemind's averager buffers in /dev/shm).
``coordinator_uss_gb`` splits the coordinator's into its last sample before the joiners start (at rest: theta and the
outer state loaded) and its peak while they download (what serving costs on top).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_ENV = "STATE_JOIN_CODE"  # the checkout a child (prepare, join) imports the project from: --code
sys.path.insert(0, os.environ.get(CODE_ENV) or str(ROOT))  # before any project import
CONFIG = ROOT / "configs" / "qwen3_0.6b_full.toml"


def _config(config_path: Path, model: Path):
    from composer_diloco.config import load_config

    return load_config(config_path, model=str(model))


def prepare(model_dir: Path, run_dir: Path, config_path: Path, round_: int, seed: int = 0) -> dict:
    """Write a checkpoint of round ``round_`` into ``run_dir`` whose theta and outer state differ from the base."""
    import torch

    from composer_diloco.checkpoint import save_checkpoint
    from composer_diloco.outer.global_model import GlobalModel, optimizer_factory
    from composer_diloco.policy import load_policy
    from composer_diloco.policy.lora import base_sha256

    config = _config(config_path, model_dir)
    model, tokenizer = load_policy(str(model_dir), seed=0, warmstart_steps=0)
    base = base_sha256(model)
    gm = GlobalModel(model, outer_optimizer=optimizer_factory(config.outer), share_storage=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gm.params:  # theta moved away from the base, as after a round
            p.add_(torch.randn(p.shape, generator=g), alpha=1e-3)
        for t in gm.state()[1][len(gm.params):]:
            if t.is_floating_point() and t.numel() > 1:
                t.copy_(torch.randn(t.shape, generator=g) * 1e-4)
    import inspect

    extra = {"model_sha256": base} if "model_sha256" in inspect.signature(save_checkpoint).parameters else {}
    folder = save_checkpoint(run_dir, round_, model, tokenizer, gm, config.to_json(), **extra)  # (--code: older)
    return {"checkpoint": str(folder), "global_sha256": gm.sha256(), "base_sha256": base,
            "state_bytes": sum(t.numel() * t.element_size() for t in gm.state()[1])}


def join(peer_addr: str, name: str, join_timeout_s: float = 30.0) -> dict:
    """One joiner (module docstring); returns what it measured."""
    from composer_diloco.outer.peer import DiLoCoPeer
    from composer_diloco.outer.swarm import Swarm, fetch_run_config, start_dht
    from nodes import node as node_module

    t0 = time.monotonic()
    dht = start_dht(initial_peers=[peer_addr])
    config = fetch_run_config(dht, run_name=None, timeout_s=60)
    swarm = Swarm(dht, run_name=config.run_name, peer_name=name, role="node", initial_peers=[peer_addr])
    try:  # where the node's skeleton builder lives since the standby (older checkouts: nodes.node)
        from composer_diloco.policy.load import policy_skeleton
    except ImportError:
        policy_skeleton = node_module._policy_skeleton
    model, _ = policy_skeleton(config)
    kwargs = {}
    if hasattr(node_module, "_full_model_sha256"):  # the code before the change checks no base
        kwargs["base_sha256"] = node_module._full_model_sha256(model)
    peer = DiLoCoPeer(model, config, swarm, holds_theta=False, **kwargs)
    t_start = time.monotonic()
    try:
        ok = peer.load_state_from_peers(timeout_s=join_timeout_s)  # a node's --join-timeout (default 30 s)
        seconds = time.monotonic() - t_start
        report = getattr(peer, "last_download", None)
        return {"name": name, "ok": bool(ok), "seconds": round(seconds, 1), "setup_seconds": round(t_start - t0, 1),
                "round": peer.round, "sha256": peer.global_model.sha256() if ok else "",
                "error": getattr(peer, "last_download_error", "") if not ok else "",
                "bytes_moved": getattr(report, "bytes_moved", None), "bytes_kept": getattr(report, "bytes_kept", None),
                "retries": getattr(report, "retries", None), "sources": getattr(report, "sources", None)}
    finally:
        swarm.close()
        peer.shutdown()
        dht.shutdown()


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(args: argparse.Namespace) -> dict:
    """Coordinator + joiners, measured (module docstring)."""
    sys.path.insert(0, str(ROOT))
    from bench.memory import TreeMemory

    code = Path(args.code or ROOT).resolve()
    env = {**os.environ, "PYTHONPATH": str(code), CODE_ENV: str(code), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run_dir, logs = args.run_dir.resolve(), args.run_dir.resolve() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    prepared = None
    if args.round > 0:  # in its own process: its 2 x state of memory is back before the coordinator starts
        out = subprocess.run([sys.executable, __file__, "prepare", "--model", str(args.model), "--run-dir",
                              str(run_dir), "--config", str(args.config), "--round", str(args.round)],
                             capture_output=True, text=True, env=env, cwd=code)
        if out.returncode != 0:
            raise SystemExit(f"prepare failed:\n{out.stderr[-3000:]}")
        prepared = json.loads(out.stdout.strip().splitlines()[-1])
    cmd = [sys.executable, "-m", "coordinator", "start", "--run-dir", str(run_dir), "--config", str(args.config),
           "--model", str(args.model), "--max-idle", "900"] + (["--resume"] if args.round > 0 else [])
    memory = TreeMemory(period_s=0.5).start()
    procs: list[subprocess.Popen] = []
    hwm: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        coordinator = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(logs / "coordinator.log", "w"),
                                       text=True, env=env, cwd=code, start_new_session=True)
        procs.append(coordinator)
        memory.watch("coordinator", coordinator.pid)
        peer_line = ""
        while not peer_line:
            line = coordinator.stdout.readline()
            if not line and coordinator.poll() is not None:
                raise SystemExit(f"the coordinator exited:\n{(logs / 'coordinator.log').read_text()[-3000:]}")
            peer_line = line.removeprefix("peer: ").strip() if line.startswith("peer: ") else ""
        started = time.monotonic() - t0
        time.sleep(5.0)  # the coordinator's memory at rest (its start-up transients over), before anyone downloads
        serving_from = time.time()
        joiners = {}
        for i in range(args.joiners):
            name = f"joiner-{i}"
            joiners[name] = subprocess.Popen(
                [sys.executable, __file__, "join", "--peer", peer_line, "--name", name],
                stdout=subprocess.PIPE, stderr=open(logs / f"{name}.log", "w"), text=True, env=env, cwd=code,
                start_new_session=True)
            procs.append(joiners[name])
            memory.watch(name, joiners[name].pid)
        results = {}
        while any(p.poll() is None for p in joiners.values()):
            for name, p in [("coordinator", coordinator), *joiners.items()]:
                hwm[name] = max(hwm.get(name, 0), _vm_hwm(p.pid))
            time.sleep(0.5)
        for name, p in joiners.items():
            out = p.stdout.read().strip().splitlines()
            results[name] = json.loads(out[-1]) if out else {"ok": False, "error": f"exit {p.returncode}"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        peaks = memory.stop()
    expected = prepared["global_sha256"] if prepared else None
    if expected is None:
        from composer_diloco.checkpoint import latest_checkpoint, read_outer_state

        expected = read_outer_state(latest_checkpoint(run_dir))["global_sha256"]
    for r in results.values():
        r["sha256_matches"] = r.get("sha256") == expected
    coordinator = [x for x in memory.series if x["peer"] == "coordinator"]
    at_rest = [x["uss_bytes"] for x in coordinator if x["time"] < serving_from]
    serving = [x["uss_bytes"] for x in coordinator if x["time"] >= serving_from]
    return {"model": str(args.model), "round": args.round, "code": str(code), "coordinator_start_s": round(started, 1),
            "prepared": prepared, "expected_sha256": expected, "joiners": results,
            "coordinator_uss_gb": {"at_rest": round(at_rest[-1] / 1e9, 2) if at_rest else None,
                                   "peak_while_serving": round(max(serving) / 1e9, 2) if serving else None},
            "peak_gb": {name: {"uss": round(p.uss_bytes / 1e9, 2), "pss": round(p.pss_bytes / 1e9, 2),
                               "vm_hwm_main": round(hwm.get(name, 0) / 1e9, 2)} for name, p in peaks.items()}}


def cut(layers: int, out: Path) -> None:
    """Qwen3-0.6B's architecture with ``layers`` decoder layers, planted like `bench/real_arch.py build`."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.real_arch import qwen3_config
    from composer_diloco.policy import load_default_tokenizer
    from composer_diloco.policy.planted import plant_calls

    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config("0.6b", tokenizer, num_hidden_layers=layers),
                                             dtype=torch.float32)
    plant_calls(model, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()):,} parameters ({layers} layers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--run-dir", type=Path, required=True)
    r.add_argument("--config", type=Path, default=CONFIG)
    r.add_argument("--round", type=int, default=1)
    r.add_argument("--joiners", type=int, default=1)
    r.add_argument("--code", type=Path, help="checkout to run the coordinator and joiners from (default: this one)")
    r.add_argument("--json", type=Path, help="write the result here too")
    p = sub.add_parser("prepare")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--round", type=int, default=1)
    j = sub.add_parser("join")
    j.add_argument("--peer", required=True)
    j.add_argument("--name", default="joiner")
    j.add_argument("--join-timeout", type=float, default=30.0)
    c = sub.add_parser("cut")
    c.add_argument("--layers", type=int, required=True)
    c.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "prepare":
        print(json.dumps(prepare(a.model, a.run_dir, a.config, a.round)))
    elif a.cmd == "join":
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        print(json.dumps(join(a.peer, a.name, a.join_timeout)), flush=True)
        os._exit(0)  # skip the interpreter's teardown of hivemind's shared memory (it can abort at exit)
    elif a.cmd == "cut":
        cut(a.layers, a.out)
    else:
        result = run(a)
        print(json.dumps(result, indent=1))
        if a.json:
            a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
