"""bench/sync_cost.py still runs: one small size over a 100 Mbit/s veth pair as root, else a loopback smoke (one
of the two, to keep the suite's time: both go through the same peers and averager)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = pytest.mark.bench  # not in the default run: python -m pytest -m bench

ROOT = Path(__file__).resolve().parents[1]
NO_NETNS = os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None


def run_bench(out: Path, *args: str, timeout_s: float) -> dict:
    """Run the bench with ``args``; return its results.json (asserting exit 0)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sync_cost.py"), *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| size |" in r.stdout  # the markdown table
    return json.loads((out / "results.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.skipif(not NO_NETNS, reason="covered by the throttled-veth test below")
def test_sync_cost_smoke(tmp_path):
    rows = run_bench(tmp_path / "out", "--smoke", timeout_s=140)["rows"]
    assert [(r["size"], r["link"], r["codec"], r["source"]) for r in rows] == [
        ("default", "loopback", "none", "measured")]
    row = rows[0]
    assert row["allreduce_s"] > 0 and row["outer_s"] > 0 and row["sync_s"] >= row["allreduce_s"] + row["outer_s"]
    # two peers, fp32: each sends the half it does not reduce and returns the half it does: 4 bytes an element
    assert row["bytes_per_peer"] >= 4 * row["numel"]
    assert 0 < row["utilization"] < 1


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(NO_NETNS, reason="network namespaces need root and the ip/tc commands")
def test_sync_cost_over_a_throttled_veth(tmp_path):
    before = set(_namespaces())
    result = run_bench(tmp_path / "out", "--sizes", "2M", "--extrapolate", "", "--links", "100mbit", "--codecs",
                       "none", timeout_s=230)
    (row,) = result["rows"]
    assert row["link"] == "100mbit" and row["allreduce_s"] > 0
    # a physical bound, not a timing ratio: 8 MB of payload cannot cross a 100 Mbit/s tbf much faster than that
    assert row["goodput_mbit_s"] < 110
    assert not {n for n in _namespaces() if n.startswith("sc")} - before  # its namespaces are gone again


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_sync_cost_three_peers_sparse_codec(tmp_path):
    """``--peers 3`` with the sparse-2bit all-gather: three processes average in one group, each sends a message."""
    rows = run_bench(tmp_path / "out", "--sizes", "default", "--extrapolate", "", "--links", "loopback", "--codecs",
                     "sparse-2bit", "--peers", "3", "--rounds", "1", timeout_s=140)["rows"]
    (row,) = rows
    assert (row["peers"], row["codec"], row["group_close"]) == (3, "sparse-2bit", "full")
    assert row["allreduce_s"] > 0 and row["encode_s"] > 0 and row["sync_s"] > row["allreduce_s"] + row["encode_s"]
    # every peer sent its message to the two others; a message is far below a byte per element (fp32 sends 4)
    assert 0 < row["bytes_per_peer_min"] <= row["bytes_per_peer_max"] < row["numel"]
