"""Peak host memory of process trees, sampled in a background thread, in copies of theta.

A peer of a run is a process tree: the Python process, hivemind's averager child, the p2p daemon. Summing RSS over
the tree counts a shared page once per process mapping it, so `TreeMemory` sums each process's USS (pages only it
maps: private) and PSS (every page divided by the number of processes mapping it), from ``/proc/PID/smaps_rollup``
through ``psutil.Process.memory_full_info``. PSS - USS is the tree's share of shared memory: hivemind's averager
buffers and the tensors torch passes between processes (`file_system` sharing: ``/dev/shm/torch_*`` files).

Used by ``bench/blocked_link.py --memory``. A peak also holds what does not grow with theta (the interpreter, torch,
transformers, the p2p daemon: ~0.5-1 GB a tree), so the copies of theta a peer holds are read off two runs at two
policy sizes, the difference of the peaks over the difference of theta's bytes::

    python bench/memory.py slope runs/mem-1l/summary.json runs/mem-4l/summary.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass
class Peak:
    """The largest sample of one tree.

    Attributes:
        uss_bytes: the largest sum of private bytes over the tree (bytes).
        pss_bytes: the largest sum of proportional bytes over the tree (bytes), private and shared.
    """

    uss_bytes: int = 0
    pss_bytes: int = 0


class TreeMemory:
    """Samples the memory of named process trees every ``period_s`` seconds until `stop`.

    Args:
        period_s: seconds between samples (one sample of a 4-process tree reads 4 smaps_rollup files: ~1 ms).

    `watch(name, pid)` adds a tree (the process and its descendants at each sample); `peaks` holds one `Peak` per
    name, `series` every sample as ``{"time": epoch s, "peer": name, "uss_bytes", "pss_bytes"}`` (to line up with
    the peers' logs). A process that exits between listing and reading is skipped for that sample.
    """

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.peaks: dict[str, Peak] = {}
        self.series: list[dict] = []
        self._roots: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-memory", daemon=True)

    def watch(self, name: str, pid: int) -> None:
        """Sample the tree rooted at ``pid`` under ``name`` from now on."""
        self._roots[name] = pid
        self.peaks.setdefault(name, Peak())

    def start(self) -> TreeMemory:
        """Start sampling; returns self."""
        self._thread.start()
        return self

    def stop(self) -> dict[str, Peak]:
        """Stop sampling (after one last sample); returns `peaks`."""
        self._stop.set()
        self._thread.join(timeout=10)
        return self.peaks

    def _loop(self) -> None:
        while True:
            for name, pid in list(self._roots.items()):
                uss, pss = _tree_bytes(pid)
                if pss:
                    self.series.append({"time": round(time.time(), 2), "peer": name, "uss_bytes": uss, "pss_bytes": pss})
                peak = self.peaks[name]
                peak.uss_bytes, peak.pss_bytes = max(peak.uss_bytes, uss), max(peak.pss_bytes, pss)
            if self._stop.wait(self.period_s):
                return


def _tree_bytes(pid: int) -> tuple[int, int]:
    """(USS, PSS) summed over ``pid`` and its descendants, bytes; (0, 0) once the root has exited."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    uss = pss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        uss += info.uss
        pss += info.pss
    return uss, pss


def slope(small: list[dict], large: list[dict]) -> list[dict]:
    """Copies of theta per peer and mode from two `bench/blocked_link.py --memory` summaries at two policy sizes:
    (peak_large - peak_small) / (4 bytes x (parameters_large - parameters_small)), private (USS), shared
    (PSS - USS) and total (PSS).

    Raises:
        ValueError: a summary without memory samples, or two summaries of one size.
    """
    rows = []
    for a, b in zip(small, large, strict=True):
        if "memory" not in a or "memory" not in b:
            raise ValueError("a summary has no memory samples: run bench/blocked_link.py with --memory")
        theta = 4.0 * (b["parameters"] - a["parameters"])
        if theta <= 0:
            raise ValueError(f"the second summary's policy ({b['parameters']:,}) must be larger than the first's "
                             f"({a['parameters']:,})")
        for name in sorted(a["memory"]):
            ma, mb = a["memory"][name], b["memory"][name]
            uss, pss = mb["uss_bytes"] - ma["uss_bytes"], mb["pss_bytes"] - ma["pss_bytes"]
            rows.append({"mode": a["mode"], "peer": name, "private": round(uss / theta, 1),
                         "shared": round((pss - uss) / theta, 1), "total": round(pss / theta, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slope", help="copies of theta per peer from two summaries at two policy sizes")
    s.add_argument("small", type=Path)
    s.add_argument("large", type=Path)
    args = ap.parse_args()
    rows = slope(json.loads(args.small.read_text()), json.loads(args.large.read_text()))
    print("| mode | peer | private | shared | total (copies of theta) |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['peer']} | {r['private']} | {r['shared']} | {r['total']} |")


if __name__ == "__main__":
    main()
