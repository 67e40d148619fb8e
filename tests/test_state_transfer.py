"""The global model's state between peers (`composer_diloco.outer.state_transfer`), across real processes: a slow
serving peer, a serving peer SIGKILLed mid-download, a round-0 join that holds the base already, another base refused.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import prefork
from tests_support import stop_processes

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(__file__).with_name("state_peer.py")


def _start(name: str, args: list[str], logs: Path, fault: str = "") -> subprocess.Popen:
    """``state_peer.py ARGS`` as its own process (its own group: a fault's SIGKILL takes its p2pd with it)."""
    return prefork.popen([sys.executable, str(PEER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(logs / f"{name}.log", "w"), text=True, cwd=ROOT,
                            env={**os.environ, "COMPOSER_DILOCO_FAULTS": fault}, start_new_session=True)


def _serve(name: str, role: str, logs: Path, fault: str = "") -> subprocess.Popen:
    args = ["serve", "--role", role, "--name", name] + (["--peer", "-"] if role == "node" else [])
    return _start(name, args, logs, fault)


def _go(proc: subprocess.Popen, peer: str) -> None:
    """Hand a process started with ``--peer -`` its peer's multiaddr."""
    proc.stdin.write(peer + "\n")
    proc.stdin.flush()


def _peer_line(proc: subprocess.Popen, name: str, logs: Path) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("peer: "):
            return line.removeprefix("peer: ").strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{name} printed no peer line:\n{(logs / f'{name}.log').read_text()[-3000:]}")


def _joined(proc: subprocess.Popen, phase: int, logs: Path) -> dict:
    out = logs / f"join-{phase}.json"
    proc.wait(timeout=240)
    assert proc.returncode == 0 and out.is_file(), (logs / f"join-{phase}.log").read_text()[-4000:]
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_joins_survive_a_slow_and_a_dying_server_move_only_what_differs_and_refuse_another_base(tmp_path):
    """Servers A (the coordinator: asked first), B and C hold round 0 of one run; joiners ask them for the state.

    - another base (same layout, other weights): refused before any download, in one line naming both hashes;
    - the run's base already loaded (a round-0 join of a --model run): nothing moves, theta checked by its hash;
    - a random skeleton: A waits 12 s before its first chunk (hivemind's download gave up after 10 s) and dies
      after 20 of 64 chunks of the weight; the download resumes from B at the byte it reached, and only theta moves
      (the optimizer's initial state is held already);
    - a peer holding a theta of its own downloads from C only: past its deadline (2 s; C waits 6 s before a first
      chunk), and again while C dies mid-download: each fails in one line, its theta untouched (never a partial one).
    """
    from composer_diloco.outer.global_model import GlobalModel, optimizer_factory
    from composer_diloco.policy.lora import base_sha256
    from state_peer import config, model

    run_theta = GlobalModel(model(0), outer_optimizer=optimizer_factory(config().outer))
    theta_bytes = sum(p.numel() * 4 for p in run_theta.params)
    state_bytes = sum(t.numel() * t.element_size() for t in run_theta.state()[1])
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        # every process starts now and waits for its peer (their imports overlap: the suite's time)
        a = _serve("server-a", "coordinator", logs, fault="slow_state:*:12,kill_in_state_serve:*:20")
        b = _serve("server-b", "node", logs)
        c = _serve("server-c", "node", logs, fault="slow_state:*:6,kill_in_state_serve:*:20")
        joiners = {phase: _start(f"join-{phase}", ["join", "--peer", "-", "--phase", str(phase), "--out",
                                                   str(logs / f"join-{phase}.json")], logs) for phase in (1, 2)}
        procs += [a, b, c, *joiners.values()]
        addr = _peer_line(a, "server-a", logs)
        _go(b, addr)
        b_addr = _peer_line(b, "server-b", logs)
        started = time.monotonic()
        _go(joiners[1], addr)
        first = _joined(joiners[1], 1, logs)
        joined_s = time.monotonic() - started
        assert a.wait(timeout=30) == -9  # SIGKILLed by its fault, mid-download
        _go(c, b_addr)  # C only now: the first joiner's download resumed from B, never from C
        _peer_line(c, "server-c", logs)
        _go(joiners[2], b_addr)
        second = _joined(joiners[2], 2, logs)
        assert c.wait(timeout=30) == -9
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
        stop_processes(procs)

    bad = first["bad"]
    assert bad["raised"] == (f"base model differs from the run's: base_sha256 {base_sha256(model(0))} in the run, "
                             f"{base_sha256(model(2))} here (every peer must load the run's --model, the same weights: "
                             "theta started from them)"), bad

    same = first["same"]
    assert same["ok"] and same["round"] == 0 and same["sha"] == run_theta.sha256(), same
    assert same["moved"] == 0 and same["kept"] == state_bytes, same  # a round-0 join of the base moves nothing

    skeleton = first["skeleton"]
    assert skeleton["ok"] and skeleton["sha"] == run_theta.sha256(), \
        (skeleton, (logs / "join-1.log").read_text()[-3000:])
    assert skeleton["sources"] == ["server-a", "server-b"] and skeleton["retries"] >= 1, skeleton
    assert skeleton["kept"] == state_bytes - theta_bytes, skeleton  # the initial optimizer state was held already
    assert theta_bytes <= skeleton["moved"] < theta_bytes + 4 * 64 * 1024, skeleton  # resumed, not started over
    assert joined_s > 12, joined_s  # A's 12 s of silence before its first chunk were waited out
    log = (logs / "join-1.log").read_text()
    resumed = re.search(r"resuming the state download from server-b at tensor 0 byte (\d+) of 4194304", log)
    assert resumed and 0 < int(resumed[1]) <= 20 * 64 * 1024, log[-3000:]  # where A's stream broke off

    # 2 s for the whole download, C's first chunk after 6 s: the wait for a chunk ends at the deadline (nothing moved),
    # and the holder has 4 s to get its manifest before C writes into the abandoned stream
    deadline = second["deadline"]
    assert not deadline["ok"] and deadline["after"] == second["holder"]["before"], deadline
    assert deadline["error"].startswith("the state of round 0 did not arrive within the 2 s deadline: 0 B of"), deadline

    holder = second["holder"]
    assert not holder["ok"] and holder["after"] == holder["before"] and holder["round"] == 0, holder
    error = holder["error"]
    assert "\n" not in error and "failed at tensor 0 byte" in error and "no other peer holds round 0" in error, error
