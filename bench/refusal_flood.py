"""Benchmark: how many refused DHT requests a closed run's peer absorbs per second, and what a flood costs an insider,
before and after requests were bound to both libp2p peer IDs (issue 14 item 7).

    PYTHONPATH=. python bench/refusal_flood.py [--before-commit 905fe9f] [--seconds 10] [--workers 16]

For each tree ("before": ``git archive`` of ``--before-commit`` unpacked in a temporary folder; "after": this tree)
it starts `outsider_peer.py host` (a coordinator stand-in: a closed DHT and an averager) with a secret, times an
insider's DHT reads of the run config (median and max of 20, milliseconds) idle and then during each flood of
`flood_peer.py` (DHT finds unsigned, DHT finds signed with a wrong secret, the averager's join_group under the
closed prefix), and measures the CPU time the host's processes (its p2pd included) spent per refused request
beyond their own load without a flood (``host_cpu_ms_per_refusal``, milliseconds; ``idle.host_cpu_s_per_s`` is
that own load). Prints one JSON line per tree.
Every process it starts is stopped by pid.

Raises (exits non-zero): ``git archive`` fails, or a host prints no ``peer:`` line within 120 s.
"""

from __future__ import annotations

import argparse
import json
import time
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECRET = "flood-bench-secret-0123456789"
WRONG = "a-wrong-secret-123456"
INSIDER = """
import json, statistics, sys, time
from composer_diloco.outer.swarm import RUNS_KEY, start_dht
from composer_diloco.outer.auth import load_secret
dht = start_dht(initial_peers=[sys.argv[1]], secret=load_secret(None))
try:
    times = []
    for _ in range(20):
        t = time.perf_counter(); found = dht.get(RUNS_KEY, latest=True); times.append((time.perf_counter() - t) * 1e3)
        assert found is not None
    print(json.dumps({"median_ms": round(statistics.median(times), 1), "max_ms": round(max(times), 1)}))
finally:
    dht.shutdown()
"""


def env(tree: Path, secret: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "COMPOSER_DILOCO_SECRET": secret, "OMP_NUM_THREADS": "1"}


def run_json(args: list[str], environ: dict, cwd: Path, timeout_s: float = 180.0) -> dict:
    r = subprocess.run(args, env=environ, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    if r.returncode != 0:
        raise SystemExit(f"{args[1]} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(tree: Path, seconds: float, workers: int) -> dict:
    host = subprocess.Popen([sys.executable, str(tree / "tests" / "outsider_peer.py"), "host"], env=env(tree, SECRET),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=tree, start_new_session=True)
    try:
        line = host.stdout.readline()
        if not line.startswith("peer: "):
            raise SystemExit(f"the host in {tree} printed no peer line")
        peer = line.split()[1]
        cpu0, t0 = tree_cpu_s(host.pid), time.monotonic()  # the host's own load, with an insider and no flood
        out = {"idle": run_json([sys.executable, "-c", INSIDER, peer], env(tree, SECRET), tree)}
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
        idle_cpu_per_s = (tree_cpu_s(host.pid) - cpu0) / (time.monotonic() - t0)
        out["idle"]["host_cpu_s_per_s"] = round(idle_cpu_per_s, 3)
        sys.path.insert(0, str(ROOT))
        from composer_diloco.outer.auth import averaging_prefix

        floods = (("dht_unsigned", [], SECRET), ("dht_wrong_secret", ["--signed"], WRONG),
                  ("join_group", ["--join-prefix", averaging_prefix("composer", SECRET.encode())], SECRET))
        for label, extra, secret in floods:
            cpu0, t0 = tree_cpu_s(host.pid), time.monotonic()
            flooder = subprocess.Popen([sys.executable, str(ROOT / "tests" / "flood_peer.py"), "--target", peer,
                                        "--seconds", str(seconds), "--workers", str(workers), *extra],
                                       env=env(ROOT, secret), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, cwd=ROOT, start_new_session=True)
            try:
                insider = run_json([sys.executable, "-c", INSIDER, peer], env(tree, SECRET), tree)
                flood_out, _ = flooder.communicate(timeout=seconds + 120)
            finally:
                if flooder.poll() is None:
                    flooder.kill()
                    flooder.wait()
            cpu_s, wall_s = tree_cpu_s(host.pid) - cpu0, time.monotonic() - t0
            result = json.loads(flood_out.strip().splitlines()[-1])
            extra_cpu_s = cpu_s - idle_cpu_per_s * wall_s  # what the flood added to the host's own load
            out[label] = {"flood": result, "insider_during": insider, "host_cpu_s": round(cpu_s, 2),
                          "wall_s": round(wall_s, 1),
                          "host_cpu_ms_per_refusal": round(extra_cpu_s * 1e3 / max(result["refused"], 1), 3)}
        return out
    finally:
        host.stdin.close()
        try:
            host.wait(timeout=20)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before-commit", default="905fe9f")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp)
        archive = subprocess.run(["git", "archive", args.before_commit], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        for label, tree in (("before", before), ("after", ROOT)):
            print(json.dumps({"tree": label, **measure(tree, args.seconds, args.workers)}), flush=True)


if __name__ == "__main__":
    main()
