"""`composer-coordinator status`: a read-only DHT client that shows the swarm, and is never a peer of the run.

The closed-run refusal (no secret, a wrong one) is checked in `tests/test_closed_run.py`'s
`test_closed_run_refuses_outsiders`, against the closed run it starts anyway.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import prefork
from local_run import write_config
from tests_support import error_line

ROOT = Path(__file__).resolve().parents[1]
DEAD = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # nobody listens on port 9
# long enough to outlast the status reads (~1.5-3 s a round here); the run is stopped once they are done
LIVE_CONFIG = """
rounds = 40
inner_steps = 1
"""


def status(*args: str, timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return prefork.run([sys.executable, "-m", "coordinator", "status", *args], capture_output=True, text=True,
                       timeout=timeout_s, cwd=ROOT, env={**os.environ, **(env or {})})


# a table row whose cells up to the phase are set: peer, role, device, dtype, round, phase, ..., age s
ROW = re.compile(r"^ ?(coordinator|node-\d+) +(coordinator|node) +(\S+) +(fp32|bf16) +(\d+) +(\w+) .*?([\d.]+)"
                 r"(?: late)? *$", re.MULTILINE)


def rows(stdout: str) -> dict[str, tuple[str, ...]]:
    """The status table's rows by peer name: ``(peer, role, device, dtype, round, phase, age s)``."""
    return {m.group(1): m.groups() for m in ROW.finditer(stdout)}


# -- the parts that need no run ----------------------------------------------------------------------------------
def test_round_facts_name_the_dropped_and_the_screened_with_their_reasons():
    from composer_diloco.outer.peer import SyncResult
    from composer_diloco.outer.swarm import PeerRecord
    from coordinator.status import SwarmStatus, round_facts, summary_lines, table_rows

    result = SyncResult(round=2, peers=3, weight_total=32.0, sync_seconds=1.0, wait_seconds=0.2, bytes_sent=10,
                        global_sha256="ab" * 32, status="averaged", rejected=["node-1"],
                        rejected_reasons={"node-1": "non-finite pseudo-gradient"},
                        members=["coordinator", "node-0", "node-1"])
    live = [PeerRecord("coordinator", "coordinator", 3, 100.0, sha="ab" * 32),
            PeerRecord("node-0", "node", 3, 99.0, sha="ab" * 32, info={"device": "cpu", "phase": "inner"}),
            PeerRecord("node-1", "node", 3, 99.0, lineage={3: "ab" * 8}),
            PeerRecord("node-2", "node", 2, 99.5)]
    facts = round_facts(result, live, previous_group=["coordinator", "node-0", "node-1", "node-3"])
    assert facts["group"] == ["coordinator", "node-0", "node-1"] and facts["last_round"] == 2
    assert facts["screened"] == {"node-1": "non-finite pseudo-gradient"}
    assert set(facts["dropped"]) == {"node-2", "node-3"}  # alive but left out; gone since the round before
    assert "heartbeat expired" in facts["dropped"]["node-3"] and "not in round 2" in facts["dropped"]["node-2"]

    live[0] = PeerRecord("coordinator", "coordinator", 3, 100.0, sha="ab" * 32, info={"phase": "sync", **facts})
    joining = [PeerRecord("node-4", "node", 4, 98.0, 98.0)]
    text = "\n".join(summary_lines(SwarmStatus("composer", 8, live, joining, 101.0)))
    assert "in round 3 of 8" in text and "last round 2: agreement: yes, 3 peer(s) on theta abababababab" in text, text
    assert "round 2 at the coordinator: averaged, 3 peer(s) (coordinator, node-0, node-1); dropped: node-2" in text
    assert "screened: node-1 (non-finite pseudo-gradient)" in text and "node-3 (in round 1's" in text, text
    table = {r[0]: r for r in table_rows(SwarmStatus("composer", 8, live, joining, 101.0))}
    assert table["node-0"][2] == "cpu" and table["node-0"][5] == "inner" and table["node-4"][5] == "joining"

    # the coordinator is a moment ahead: node-1 still loads round 2's average (node-2, dropped, is not waited for)
    live[2] = PeerRecord("node-1", "node", 2, 99.0, info={"phase": "sync"})
    text = "\n".join(summary_lines(SwarmStatus("composer", 8, live, [], 101.0)))
    assert "last round 2: agreement: yes, 2 peer(s) on theta abababababab; still finishing it: node-1\n" in text, text

    live[2] = PeerRecord("node-1", "node", 3, 99.0, sha="cd" * 32)  # a replica that parted
    text = "\n".join(summary_lines(SwarmStatus("composer", 8, live, [], 101.0)))
    assert "agreement: NO: abababababab: coordinator, node-0; cdcdcdcdcdcd: node-1" in text, text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer, expected", [
    ("localhost:4000", "--peer 'localhost:4000' is not a multiaddr"),
    ("/ip4/127.0.0.1/tcp/4000", "has no /p2p/<peer id> part"),
    ("/ip4/not-an-ip/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", "is not a multiaddr"),
])
def test_status_of_an_address_that_is_not_a_multiaddr(peer, expected):
    r = status("--peer", peer)
    assert r.returncode == 1 and expected in error_line(r), r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.timeout(60)
def test_status_where_nobody_answers_is_one_line_within_its_timeout():
    started = time.monotonic()
    r = status("--peer", DEAD, "--timeout", "6")
    took = time.monotonic() - started
    assert r.returncode == 1 and "no peer answered at --peer " + DEAD in error_line(r), r.stderr
    assert "secret" in error_line(r)  # a closed run refusing us looks the same: the line says so
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stderr
    assert took < 6 + 5, took  # the timeout, plus the interpreter's start and exit


# -- against a live run ------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_status_of_a_live_run_lists_every_node_and_is_no_peer_then_sigterm_stops_it_all(run_dir, tmp_path):
    """`simulate` with 2 nodes: `status` lists both nodes with their round, device and phase and the run's round;
    `--watch` redraws until Ctrl-C; and the client is in no round's group, metrics or peer list.

    Then a SIGTERM to `simulate` (a process manager, ``kill``, a CI timeout) stops its coordinator, its nodes and
    their env servers and p2pd daemons, as Ctrl+C does, and it exits 143. (They run in their own sessions, so
    before the fix they ran on after `simulate` was gone.) One run for both: the suite's time."""
    import psutil

    from composer_diloco.metrics import read_metrics
    from tests_support import alive, cmdline, process_tree, stop_processes

    err_path = tmp_path / "simulate.err"
    with open(err_path, "w") as err:
        sim = prefork.popen(
            [sys.executable, "-m", "coordinator", "simulate", "--nodes", "2", "--config",
             str(write_config(tmp_path / "live.toml", LIVE_CONFIG)), "--eval-episodes", "0", "--run-dir",
             str(run_dir)], stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env={**os.environ, "COLUMNS": "1000"})
    started: list[psutil.Process] = []

    def records() -> dict[str, list[dict]]:
        return read_metrics(run_dir)

    def wait_round(name: str, rnd: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while rnd not in [r["round"] for r in records().get(name, [])]:
            assert sim.poll() is None and time.monotonic() < deadline, \
                f"{name} did not end round {rnd}:\n{err_path.read_text()[-3000:]}"
            time.sleep(0.5)

    try:
        for name in ("node-0", "node-1"):
            wait_round(name, 0, timeout_s=240)
        peer = re.search(r"coordinator at (\S+);", err_path.read_text().replace("\n", "")).group(1)

        # --watch (on a terminal) and a one-shot read at once: the suite's time
        watch = prefork.popen([sys.executable, "-m", "coordinator", "status", "--peer", peer, "--watch"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "200"})
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: watch.stdout.read(1), "")), daemon=True)
        reader.start()
        try:
            once = status("--peer", peer, "--verbose")
            # --watch redraws every 2 s; Ctrl-C ends it with exit 0
            deadline = time.monotonic() + 60
            while "".join(chunks).count("age s") < 2:  # the first draw, then a redraw
                assert watch.poll() is None and time.monotonic() < deadline, watch.stderr.read()[-3000:]
                time.sleep(0.2)
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=30)
            reader.join(timeout=10)
        finally:
            if watch.poll() is None:
                watch.kill()

        assert once.returncode == 0, once.stderr[-3000:]
        table = rows(once.stdout)
        assert set(table) == {"coordinator", "node-0", "node-1"}, once.stdout
        run_round = int(re.search(r"run 'composer': in round (\d+) of 40", once.stdout).group(1))
        assert run_round >= 1, once.stdout
        for name in ("node-0", "node-1"):
            _, role, device, precision, round_, phase, age = table[name]
            assert (role, device, precision) == ("node", "cpu", "fp32"), table[name]
            assert run_round - 1 <= int(round_) <= run_round + 1 and phase in ("inner", "sync"), table[name]
            assert float(age) < 10, table[name]
        assert table["coordinator"][1:6] == ("coordinator", "cpu", "fp32", str(run_round), "sync"), once.stdout
        # every peer is on the one theta, or named as still loading it (the nodes' syncs end just after the
        # coordinator's)
        agreed = re.search(r"last round \d+: agreement: yes, (\d) peer\(s\) on theta [0-9a-f]{12}"
                           r"(?:; still finishing it: ([\w, -]+))?\n", once.stdout)
        assert agreed, once.stdout
        finishing = agreed.group(2).split(", ") if agreed.group(2) else []
        assert int(agreed.group(1)) + len(finishing) == 3 and set(finishing) <= {"node-0", "node-1"}, once.stdout
        assert re.search(r"round \d+ at the coordinator: averaged, 3 peer\(s\) \(coordinator, node-0, node-1\); "
                         r"dropped: none; screened: none", once.stdout), once.stdout
        client_id = re.search(r"reading as DHT client (\w+)", once.stderr).group(1)

        out = "".join(chunks)
        assert watch.returncode == 0, watch.stderr.read()[-3000:]
        last = rows(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.rsplit("age s", 1)[1]))
        assert {"coordinator", "node-0", "node-1"} <= set(last), out[-3000:]

        done = max(r["round"] for r in records()["coordinator"])
        for name in ("coordinator", "node-0", "node-1"):  # a round that began after the reads ends
            wait_round(name, done + 1, timeout_s=120)

        # every kind of process the run starts is up: coordinator, nodes, their env servers, p2pd daemons
        started = process_tree(sim.pid)[1:]
        cmds = [cmdline(p) for p in started]
        assert sum("-m nodes" in c for c in cmds) >= 2 and sum("envs.tool_env.server" in c for c in cmds) >= 2, cmds
        sim.send_signal(signal.SIGTERM)
        sim.wait(timeout=30)
        assert sim.returncode == 128 + signal.SIGTERM, err_path.read_text()[-3000:]
        time.sleep(1.0)
        left = [cmdline(p) for p in started if alive(p)]
        assert left == [], left
    finally:
        stop_processes([sim])
        for p in started:  # never leak what the test started, whatever failed
            try:
                p.kill()
            except psutil.Error:
                pass

    # the client was no peer: every round's group is the coordinator and the 2 nodes; nothing names it
    recs = records()  # (the rounds the stop cut short are left out)
    assert set(recs) == {"coordinator", "node-0", "node-1"}
    for name, lines in recs.items():
        assert all(r["peers"] == 3 for r in lines if r["round"] <= done + 1), (name, [(r["round"], r["peers"])
                                                                                     for r in lines])
    for folder, _, files in os.walk(run_dir):  # metrics, peers.json, logs, checkpoints: the client's ID nowhere
        for file in files:
            assert client_id.encode() not in (Path(folder) / file).read_bytes(), Path(folder) / file

