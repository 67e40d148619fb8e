"""How the rounds of a long localhost run ended: statuses, group sizes, sync seconds, and the transport faults the
peers' logs name. For a run of many short rounds, where a fault of 1 round in a few hundred shows::

    printf 'rounds = 300\\ninner_steps = 1\\n' > /tmp/long.toml
    composer-coordinator simulate --nodes 3 --config /tmp/long.toml --eval-episodes 0 --run-dir runs/long
    python bench/long_run.py runs/long

Counted in the logs: "sent N parts, but we expected M" (an all-reduce reply stream that lost parts in flight) and
"could not find a group" (a peer whose all-reduce group formed without it).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from composer_diloco.metrics import read_metrics  # noqa: E402


def summarize(run_dir: Path) -> dict:
    """Statuses and group sizes over every peer's rounds, node sync seconds (median, max), rounds over 5 s, and the
    two log counts of the module docstring.

    Raises:
        FileNotFoundError: ``run_dir`` holds no metrics.
    """
    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"no metrics under {run_dir}")
    statuses = collections.Counter(r["status"] for recs in records.values() for r in recs)
    peers = collections.Counter(r["peers"] for recs in records.values() for r in recs)
    sync = [r["sync_seconds"] for name, recs in records.items() if name != "coordinator" for r in recs
            if "sync_seconds" in r]
    text = " ".join(" ".join(p.read_text(errors="replace").split()) for p in sorted((run_dir / "logs").glob("*.log")))
    return {"rounds": len(records.get("coordinator", [])), "statuses": dict(statuses), "peers": dict(peers),
            "sync_s_median": round(statistics.median(sync), 2) if sync else None,
            "sync_s_max": round(max(sync), 2) if sync else None, "node_rounds_over_5s": sum(s > 5 for s in sync),
            "truncated_reply_streams": len(re.findall(r"sent \d+ parts, but we expected", text)),
            "could_not_find_a_group": text.count("could not find a group")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    for key, value in summarize(ap.parse_args().run_dir).items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
