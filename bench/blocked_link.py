"""Seconds a node's inner loop is blocked on sync over a throttled link, blocking against overlapped sync, for a
policy far larger than the embedded default, through the node's own round code.

`bench/blocked.py` measures this on loopback with the embedded default (0.90M parameters). Here the question is
the one of issue 17's goal: a 0.5B policy over a 100 Mbit/s link with a 600 s inner phase. Each mode is one run of

- a coordinator (`composer-coordinator start`) and node 0 in network namespace a, node 1 in namespace b, the two
  joined by a veth pair shaped with ``tc ... tbf`` (`bench/netns.py`, root only). Every all-reduce and the state
  download of node 1 cross the link; node 0 and the coordinator share a namespace, as a coordinator colocated
  with one node would;
- the nodes are `nodes.node.Node` itself: join, the DHT, the barrier, the int8 all-reduce, the outer step, overlap's
  hand-off, fold and drain, the metrics line. Only the inner phase is a stand-in (`StandInNode.train`): one small
  random step on every parameter, then a sleep to ``--inner-s`` seconds from the phase's start. The TRL trainer,
  the rollouts and the env are not run; the sleep leaves the CPU to the sync, as a GPU node's inner phase would.

Size. Three processes of a 0.5B fp32 policy hold ~30 GB here (policy, theta, outer momentum, the averager's
buffers, overlap's anchor, the all-reduce's parts), more than this 23 GB machine. So the policy is Qwen3-0.6B's
layer shapes with ``--layers`` of its 28 layers and the shipped tokenizer's vocabulary (`build_policy`: 8 layers,
126M parameters, 0.255 of Qwen2.5-0.5B's 494M) and every other size is scaled by the same factor: the inner phase
``--inner-s`` (default 153 s = 600 s x 126 / 494) at the same 100 Mbit/s link. The bytes per round, the seconds of
the link and the foreground passes all scale with the parameter count, so blocked / inner is the 0.5B run's;
what does not scale (matchmaking, latencies, the barrier) weighs 4x more here than at 0.5B.

Run as root (about 30 min for 4 rounds per mode; the machine should be otherwise idle):

    python bench/blocked_link.py --rounds 4 --out runs/bench-blocked-link

Per mode it writes ``<mode>.jsonl`` (the nodes' metrics lines) and prints the table of `blocked.summarize`; with
``--memory`` also ``<mode>-memory.jsonl`` (each peer's memory, sampled every 0.5 s: `bench/memory.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blocked import summarize, table  # noqa: E402
from memory import TreeMemory  # noqa: E402
from netns import Link, LinkSpec, netns_unusable_reason, stop_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN25_05B_PARAMS = 494_032_768

CONFIG = """run_name = "blocked-link"
model = "{model}"
rounds = {rounds}
inner_steps = 4
checkpoint_every = {rounds}
compression = "{codec}"
[outer]
overlap = {overlap}
[network]
averaging_timeout_s = 600.0
join_timeout_s = 600.0
join_grace_s = 600.0
"""


def build_policy(out: Path, layers: int, seed: int = 0) -> int:
    """Write a random-init Qwen3 policy with Qwen3-0.6B's layer shapes (hidden 1024, 16/8 heads of 128, MLP 3072),
    ``layers`` layers and the shipped tokenizer's vocabulary to ``out`` (``save_pretrained``, fp32); returns its
    parameter count. Kept when ``out`` already holds it."""
    from transformers import AutoModelForCausalLM

    from composer_diloco.policy import load_default_tokenizer
    from real_arch import qwen3_config

    tokenizer = load_default_tokenizer()
    config = qwen3_config("0.6b", tokenizer, num_hidden_layers=layers, vocab_size=len(tokenizer))
    count_file = out / "parameters.txt"
    if count_file.exists() and json.loads(count_file.read_text())["layers"] == layers:
        return json.loads(count_file.read_text())["parameters"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    count_file.write_text(json.dumps({"layers": layers, "parameters": n}))
    return n


# ------------------------------------------------------------------------------------------------------------
# The node with a stand-in inner phase (runs inside a namespace: `python bench/blocked_link.py node ...`)
# ------------------------------------------------------------------------------------------------------------


class _StandInStats:
    """The `composer_diloco.inner.step.RoundStats` surface that a round reads (`composer_diloco.diloco`), for a phase
    with no episodes: ``samples`` is the all-reduce weight the phase claims."""

    episodes_env_error = 0
    no_tool_call = False
    longest_episode_tokens = 0  # (`composer_diloco.policy.memory_plan.round_memory`)
    generated_tokens = 0  # (`composer_diloco.diloco.InnerPhase.record`)
    channel_stats: dict = {}

    def __init__(self, samples: int):
        self.samples = samples

    def record(self) -> dict:
        return {"samples": self.samples, "mean_reward": 0.0, "success_rate": 0.0, "loss_grpo": 0.0, "standin": True}


class _StandInTrainer:
    """What a round calls on its trainer (`composer_diloco.diloco.InnerTrainer`)."""

    def __init__(self, samples: int):
        self.samples = samples

    def take_round_stats(self) -> _StandInStats:
        return _StandInStats(self.samples)

    def refresh_reference(self) -> None:
        pass


def _make_standin_node(inner_s: float, start_at: float, samples: int, nodes: int):
    from composer_diloco.diloco import DiLoCoRounds
    from nodes.node import Node

    class StandInNode(Node):
        """`nodes.node.Node` whose inner phase is one random step on every parameter (std 1e-4) and a sleep to
        ``inner_s`` seconds; everything after the phase (`composer_diloco.diloco.DiLoCoRounds.end_round` and on) is
        the node's own. Round 0 starts on every node together: once all ``nodes`` have joined (each touches
        ``<run dir>/.ready-<name>``), at ``start_at`` (epoch s) at the latest."""

        def train(self) -> int:
            config, peer = self.config, self.peer
            if peer.round >= config.rounds:
                return 0
            self.trainer = _StandInTrainer(samples)
            first = peer.round
            run_dir = Path(self.options.run_dir)
            (run_dir / f".ready-{self.options.name}").touch()
            while len(list(run_dir.glob(".ready-*"))) < nodes and time.time() < start_at:
                if self.stop.event.wait(0.05):
                    break
            gen = torch.Generator().manual_seed(sum(map(ord, self.options.name)))
            rounds = self.rounds = DiLoCoRounds(peer, self.stop.event, self, self.clock, overlap=self.overlap)
            rounds.attach(self.trainer)
            rounds.start_inner_phase()
            while not self.stop.event.is_set():
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen), alpha=1e-4)
                self.stop.event.wait(max(0.0, rounds.started + inner_s - time.monotonic()))
                rounds.steps = config.inner_steps
                rounds.end_round(self.model)
                if peer.round >= config.rounds:
                    break
            rounds.finish(self.model)
            if peer.round >= config.rounds and not self.stop.event.is_set():
                peer.serve_until_settled(self.stop.event, config.network.averaging_timeout_s + 5.0)
            return peer.round - first

    return StandInNode


def node_main(args: argparse.Namespace) -> int:
    """One stand-in node: `nodes.cli.join`'s life cycle with `StandInNode`."""
    from composer_diloco.lifecycle import GracefulStop, setup_logging
    from composer_diloco.reaper import watch_this_process
    from nodes.node import NodeOptions

    torch.set_num_threads(1)
    options = NodeOptions(peer=args.peer, run_dir=args.run_dir, name=args.name, listen=args.listen,
                          join_timeout_s=600.0)
    setup_logging(options.name, False)
    stop = GracefulStop().install()
    node = _make_standin_node(args.inner_s, args.start_at, args.samples, nodes=2)(options, stop)
    watch_this_process()
    try:
        node.join()
        node.train()
        return 130 if stop.event.is_set() else 0
    except Exception as e:
        print(f"{args.name}: error: {e}", file=sys.stderr)
        return 1
    finally:
        node.close()


# ------------------------------------------------------------------------------------------------------------
# The two runs
# ------------------------------------------------------------------------------------------------------------


def _wait_for_peer_line(log: Path, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("peer: "):
                return line.split(" ", 1)[1].strip()
        if proc.poll() is not None:
            raise SystemExit(f"the coordinator exited {proc.returncode} before printing its address:\n"
                             f"{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise SystemExit(f"the coordinator printed no address within {timeout_s:.0f} s")


def run_mode(link: Link, model_dir: Path, out: Path, *, overlap: bool, rounds: int, inner_s: float, codec: str,
             lead_s: float, memory: TreeMemory | None = None) -> list[dict]:
    """One run (coordinator + node 0 in namespace a, node 1 in b); returns the nodes' metrics lines. ``memory``:
    the sampler that watches the three process trees (`bench/memory.py`)."""
    from composer_diloco.metrics import read_metrics

    mode = "overlapped" if overlap else "blocking"
    run_dir = out / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    config = out / f"{mode}.toml"
    config.write_text(CONFIG.format(model=model_dir, rounds=rounds, codec=codec, overlap=str(overlap).lower()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen] = []
    try:
        clog = run_dir / "coordinator.log"
        coordinator = subprocess.Popen(
            link.wrap(0, [sys.executable, "-m", "coordinator", "start", "--config", str(config), "--run-dir",
                          str(run_dir), "--listen", f"/ip4/{link.addresses[0]}/tcp/0"]),
            cwd=ROOT, env=env, stdout=clog.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(coordinator)
        if memory is not None:
            memory.watch("coordinator", coordinator.pid)
        peer = _wait_for_peer_line(clog, coordinator, 300.0)
        # node 1 downloads theta and the outer state over the link first (1 GB, 88 s at 126M parameters, 100 Mbit/s);
        # join_grace_s above lets it join round 0 that late; round 0's inner phase starts on both nodes once both
        # have joined, at start_at at the latest
        start_at = time.time() + lead_s
        for i in range(2):
            procs.append(subprocess.Popen(
                link.wrap(i, [sys.executable, str(Path(__file__).resolve()), "node", "--peer", peer, "--name",
                              f"node-{i}", "--run-dir", str(run_dir), "--listen", f"/ip4/{link.addresses[i]}/tcp/0",
                              "--inner-s", str(inner_s), "--start-at", str(start_at)]),
                cwd=ROOT, env=env, stdout=(run_dir / f"node-{i}.log").open("w"), stderr=subprocess.STDOUT,
                start_new_session=True))
            if memory is not None:
                memory.watch(f"node-{i}", procs[-1].pid)
        budget = lead_s + rounds * (inner_s + 600.0)
        for p in procs[1:]:
            if p.wait(timeout=budget) != 0:
                raise SystemExit(f"{mode}: a node exited {p.returncode}; see {run_dir}/node-*.log")
        coordinator.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process(p)
    records = read_metrics(run_dir)
    return [r for name, recs in sorted(records.items()) if name.startswith("node") for r in recs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    node = sub.add_parser("node", help="(internal) one stand-in node")
    node.add_argument("--peer", required=True)
    node.add_argument("--name", required=True)
    node.add_argument("--run-dir", type=Path, required=True)
    node.add_argument("--listen", required=True)
    node.add_argument("--inner-s", type=float, required=True)
    node.add_argument("--start-at", type=float, default=0.0,
                      help="wall time (epoch s) round 0 starts at, at the latest (sooner once both nodes joined)")
    node.add_argument("--samples", type=int, default=16, help="all-reduce weight each phase claims")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8, help="Qwen3-0.6B layers of the stand-in policy (of 28)")
    ap.add_argument("--inner-s", type=float, default=0.0,
                    help="stand-in inner phase, s (default: 600 s scaled by the policy's size against 0.5B)")
    ap.add_argument("--link", default="100mbit", help="RATE of bench/netns.py, e.g. 100mbit")
    ap.add_argument("--codec", default="int8", choices=["none", "fp16", "int8", "sparse-2bit"])
    ap.add_argument("--lead-s", type=float, default=300.0,
                    help="most seconds from the coordinator's address to round 0 (it starts once both nodes joined)")
    ap.add_argument("--modes", default="blocking,overlapped")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-blocked-link"))
    ap.add_argument("--memory", action="store_true",
                    help="sample each peer's process tree (bench/memory.py) and report its peak bytes")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` stops the processes and the namespaces
    if args.cmd == "node":
        raise SystemExit(node_main(args))
    if why := netns_unusable_reason():
        raise SystemExit(f"bench/blocked_link.py needs network namespaces: {why}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / f"policy-{args.layers}l"
    n = build_policy(model_dir, args.layers)
    inner_s = args.inner_s or round(600.0 * n / QWEN25_05B_PARAMS, 1)
    print(f"policy: {n:,} parameters ({n / QWEN25_05B_PARAMS:.3f} of 0.5B), inner phase {inner_s} s, "
          f"link {args.link}, codec {args.codec}", flush=True)
    rows = []
    with Link(LinkSpec.parse(args.link), prefix=f"cb{os.getpid() % 100000}", octet=7) as link:
        for mode in args.modes.split(","):
            memory = TreeMemory().start() if args.memory else None
            try:
                lines = run_mode(link, model_dir, args.out, overlap=mode == "overlapped", rounds=args.rounds,
                                 inner_s=inner_s, codec=args.codec, lead_s=args.lead_s, memory=memory)
            finally:
                peaks = memory.stop() if memory is not None else {}
            (args.out / f"{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
            rows.append({**summarize(mode, lines, args.rounds), "parameters": n, "inner_s": inner_s,
                         "link": args.link, "codec": args.codec,
                         "bytes_sent_median": statistics.median_low(r["bytes_sent"] for r in lines)})
            if peaks:
                (args.out / f"{mode}-memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in memory.series))
                # bytes: `bench/memory.py slope` turns two sizes' peaks into copies of theta
                rows[-1]["memory"] = {name: {"uss_bytes": p.uss_bytes, "pss_bytes": p.pss_bytes}
                                      for name, p in sorted(peaks.items())}
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print(table(rows, percent_digits=2))

if __name__ == "__main__":
    main()
