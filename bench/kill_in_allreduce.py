"""A node killed inside an all-reduce, and what it costs the others: the coordinator and ``--nodes`` nodes on
127.0.0.1, node-0 SIGKILLed (its whole process group) right after it sent the first part of its pseudo-gradient in round
``--round``'s all-reduce (`COMPOSER_DILOCO_FAULTS=kill_in_allreduce:R`), with ``--standby`` its warm standby beside it
(`composer-node join --standby`), which takes it over about a second later, while the survivors are still in that
all-reduce. Without a standby nobody comes back under node-0's name.

Reported (``OUT/kill_in_allreduce.json`` and one line on stdout):

    wall_s              the run, start to every process's exit
    survivors_sync_s    per survivor (the other nodes and the coordinator), the seconds its syncs took in round R
                        and in round R + 1 (the all-reduce node-0 died in; the barrier a returning node-0 may hold up)
    returned_first_round  node-0's first round after the kill (None: it never came back)
    returned_failed     node-0's rounds after the kill whose all-reduce found no group (``peers`` 0)
    agree               every round's peers recorded one ``global_sha256``
    exit_codes          every process's exit code (node-0's first life: -9)

    python bench/kill_in_allreduce.py --out runs/kar --standby                 (this checkout)
    python bench/kill_in_allreduce.py --out runs/kar-ov --standby --overlap    (the sync overlapped, as in
                                                                                bench/configs/overlap.toml)
    python bench/kill_in_allreduce.py --out runs/kar-before --standby --code /tmp/before   (another checkout, e.g. a
                                                                                worktree of an older commit)

The run's config: H = 2 inner steps, ``heartbeat_s`` 1, ``heartbeat_ttl_s`` 6, ``averaging_timeout_s`` 45 (so a wait
for a group that never forms shows as ~45 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    """The command line (module docstring); returns 0 when every process exited as expected and the replicas agree."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="run dir and kill_in_allreduce.json")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--round", type=int, default=3, help="the round in whose all-reduce node-0 is killed")
    ap.add_argument("--standby", action="store_true", help="node-0 has a warm standby beside it")
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose code the peers run (default: this one)")
    ap.add_argument("--overlap", action="store_true", help="[outer] overlap = true: the all-reduce runs under the next "
                                                           "inner phase (bench/churn.py --config bench/configs/overlap.toml)")
    a = ap.parse_args()
    if a.out.exists() and any(a.out.iterdir()):
        ap.error(f"--out {str(a.out)!r} is not empty: pick a new folder")
    if not 0 < a.round < a.rounds - 1:
        ap.error(f"--round {a.round} must be between 1 and --rounds - 2 = {a.rounds - 2}")
    code, out = a.code.resolve(), a.out.resolve()  # the peers run in --code's folder
    sys.path[:0] = [str(code / "tests"), str(code)]  # that checkout's process helpers spawn that checkout's code
    from local_run import LocalRun, write_config
    from composer_diloco.metrics import read_metrics, replicas_agree, thetas_by_round

    out.mkdir(parents=True, exist_ok=True)
    config = write_config(out / "run.toml", f"rounds = {a.rounds}\ninner_steps = 2\n[network]\nheartbeat_s = 1.0\n"
                                              "heartbeat_ttl_s = 6.0\naveraging_timeout_s = 45.0\n"
                                              + ("[outer]\noverlap = true\n" if a.overlap else ""))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    run = LocalRun(out / "run", config)
    names = [f"node-{i}" for i in range(a.nodes)]
    t0 = time.time()
    try:
        run.start_coordinator(wait=False, env=env)
        run.start_node("node-0", env={**env, "COMPOSER_DILOCO_FAULTS": f"kill_in_allreduce:{a.round}"})
        for name in names[1:]:
            run.start_node(name, env=env)
        if a.standby:
            run.start_standby("node-0", env=env)
        run.wait_peer_line()
        waited = ["coordinator", *names, *(["node-0-standby"] if a.standby else [])]
        codes = {name: run.wait_exit(name, 600) for name in waited}
    finally:
        run.stop()
    wall = time.time() - t0
    records = read_metrics(run.run_dir)
    killed_at = min((r["time"] for r in records.get("node-0", []) if r["round"] == a.round - 1), default=t0)
    later = [r for r in records.get("node-0", []) if r["time"] > killed_at and r["round"] >= a.round]
    survivors = {name: {r["round"]: round(r["sync_seconds"], 1) for r in records.get(name, [])
                        if r["round"] in (a.round, a.round + 1)} for name in ["coordinator", *names[1:]]}
    by_round = thetas_by_round(records)
    report = {
        "wall_s": round(wall, 1), "survivors_sync_s": survivors,
        "returned_first_round": min((r["round"] for r in later), default=None),
        "returned_failed": sorted(r["round"] for r in later if r.get("peers", 0) == 0),
        "rounds": len(by_round), "of": a.rounds, "agree": replicas_agree(records),
        "exit_codes": codes, "standby": a.standby, "code": str(code), "round": a.round,
    }
    (out / "kill_in_allreduce.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    ok = report["agree"] and all(c == 0 for n, c in codes.items() if n != "node-0") and codes.get("node-0") != 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
