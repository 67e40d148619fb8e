"""A node's warm standby (`nodes/standby.py`, `composer-node join --standby`).

The first tests hold the node's folder lock in this process (real OS file locks, a real env server and policy
skeleton for the preparation) and check when a standby takes it. The last one is a run on 127.0.0.1: the node's
process is SIGKILLed, its standby takes it over as the same peer and the run goes on with agreement; the standby of a
node that finishes the run exits 0 without joining.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from composer_diloco.checkpoint import latest_checkpoint, read_outer_state
from composer_diloco.config import RunConfig
from composer_diloco.lifecycle import GracefulStop
from composer_diloco.outer.identity import try_lock
from local_run import LocalRun, assert_agree, write_config
from nodes.folder_lock import lock_node_folder
from nodes.standby import (
    FINISHED_FILE, RUN_CONFIG_FILE, TRAINING_FILE, Standby, lock_is_held, mark_finished, mark_training,
)
from tests_support import stop_processes

ROOT = Path(__file__).resolve().parents[1]
AVERAGING_TIMEOUT_S = 15.0  # what survivors wait for a member lost in an all-reduce (tests/test_faults.py's)


def _wait_in_thread(standby: Standby) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(standby.wait()), daemon=True)
    thread.start()
    return thread, got


def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_standby_prepares_from_the_nodes_config_once_the_node_trains_and_takes_the_lock_when_it_ends(tmp_path):
    """While the node holds its folder the standby waits; once the node that wrote its config trains, it prepares from
    that config (its env server launched, the memory plan's inputs computed, the policy skeleton built), not beside
    the node's join; the node's end hands it the lock at once."""
    own = tmp_path / "node-a"
    own.mkdir()
    node_lock = try_lock(own / "node.lock")
    (own / RUN_CONFIG_FILE).write_text(RunConfig().to_json())  # an earlier run of this folder: it joined ...
    mark_training(own)  # ... and trained; this run's node, started beside its standby, joins again
    time.sleep(0.05)
    standby = Standby(own, GracefulStop())
    thread, got = _wait_in_thread(standby)
    try:
        _until(lambda: standby.seen_held)
        time.sleep(1.0)  # several of its polls (LOCK_POLL_S)
        # the node joins: nothing prepared, nor begun, beside it (the folder's files are older than this standby)
        assert not standby._life_trains() and standby.prepared is None
        (own / RUN_CONFIG_FILE).write_text(RunConfig().to_json())  # its join
        time.sleep(0.5)
        assert not standby._life_trains() and standby.prepared is None
        mark_training(own)
        assert standby._life_trains()
        _until(lambda: standby.prepared is not None)
        assert standby.prepared.skeleton is not None and standby.prepared.env_server is not None
        from composer_diloco.policy.memory_plan import plan_inputs
        assert standby.prepared.plan_inputs == plan_inputs(RunConfig())  # the takeover's plan reads free memory only
        assert standby.prepared.plan_inputs.prompt_tokens  # the env's demonstrations rendered: a real bound
        assert standby.prepared.env_server.wait(60).url.startswith("http://127.0.0.1:")  # a healthy env server
        time.sleep(0.5)
        assert thread.is_alive() and standby.seen_held  # the node still holds it: the standby waits
        node_lock.release()
        thread.join(timeout=10)
        assert got and got[0] is not None
        assert try_lock(own / "node.lock") is None  # the standby holds the node's folder now
        assert standby.prepared.for_config(RunConfig()) is standby.prepared  # the run's config: used as prepared
        assert standby.prepared.for_config(RunConfig(inner_steps=9)) is None  # another config: dropped
        assert standby.prepared.env_server.server._process.poll() is not None  # its server stopped
        got[0].release()
    finally:
        if standby.prepared is not None:
            standby.prepared.close()


def test_a_standby_launches_the_next_lives_env_server_once_the_life_it_forked_trains(tmp_path):
    """After a fork the next life's env server waits until the life trains (`TRAINING_FILE` written after its join's
    `RUN_CONFIG_FILE`: the server's start took the takeover's CPU on a loaded box), or `PREPARE_AFTER_S` after that
    join; then one real server is launched, and only one."""
    import os

    from nodes.standby import PREPARE_AFTER_S, ForkedLife, Prepared

    own = tmp_path / "node-a"
    own.mkdir()
    standby = Standby(own, GracefulStop())
    try:
        for joined in (time.time(), time.time() - PREPARE_AFTER_S):  # a life that trains; one that never does
            (own / TRAINING_FILE).unlink(missing_ok=True)
            (own / RUN_CONFIG_FILE).write_text(RunConfig().to_json())
            os.utime(own / RUN_CONFIG_FILE, (joined, joined))
            standby.prepared = Prepared(RunConfig(), None, None, 0.0)
            if joined > time.time() - PREPARE_AFTER_S:
                mark_training(own)  # the last life trained; then this standby forked the next one
                time.sleep(0.05)
                standby.life, standby.successor_due = ForkedLife(pid=0, started=time.time(), lines=1), True
                assert not standby._life_trains()  # forked, its run config not written yet: waits
                (own / RUN_CONFIG_FILE).write_text(RunConfig().to_json())
                assert not standby._life_trains()  # joined, not training yet: waits
                mark_training(own)
            else:
                standby.life, standby.successor_due = ForkedLife(pid=0, started=joined, lines=1), True
            assert standby._life_trains()
            standby._prepare_successor_when_due()
            launched = standby.prepared.env_server
            assert launched is not None and not standby.successor_due
            standby._prepare_successor_when_due()
            assert standby.prepared.env_server is launched  # launched once
            assert launched.wait(60).url.startswith("http://127.0.0.1:")
            launched.stop()
    finally:
        if standby.prepared is not None:
            standby.prepared.close()


def test_a_standby_exits_without_joining_when_the_node_finished_its_run(tmp_path):
    own = tmp_path / "node-a"
    own.mkdir()
    node_lock = try_lock(own / "node.lock")
    mark_finished(own, 3)  # an earlier run's end, before the standby started: not this one's
    standby = Standby(own, GracefulStop(), own_env_server=False)
    thread, got = _wait_in_thread(standby)
    _until(lambda: standby.seen_held)
    mark_finished(own, 5)
    node_lock.release()
    thread.join(timeout=10)
    assert got == [None] and (own / FINISHED_FILE).exists()
    assert try_lock(own / "node.lock") is not None  # it let go of the lock


def test_a_standby_started_beside_its_node_lets_the_node_take_its_folder_first(tmp_path):
    """Started together, the node gets its folder even when the standby is ready first (it takes a free lock only
    after seeing it held, or after ``alone_after_s`` without a node: then it starts the node itself)."""
    own = tmp_path / "node-a"
    own.mkdir()
    standby = Standby(own, GracefulStop(), own_env_server=False, alone_after_s=60)
    thread, got = _wait_in_thread(standby)
    time.sleep(1.0)  # it has tried the free lock a few times by now
    node_lock = lock_node_folder(own, "node-a", tmp_path)  # the node's first act: it retries past the probe
    assert thread.is_alive() and not got
    _until(lambda: standby.seen_held)  # the node runs
    node_lock.release()
    thread.join(timeout=10)
    assert got and got[0] is not None
    got[0].release()

    alone = Standby(tmp_path / "node-b", GracefulStop(), own_env_server=False, alone_after_s=0.5)
    lock = alone.wait()  # no node ever held it: after alone_after_s it starts the node itself
    assert lock is not None and not alone.seen_held
    lock.release()


_TORCH_HELD = """
import os, sys, time
class _HoldTorch:  # `import torch` waits while the file sys.argv[1] exists: the node's heavy imports, made endless
    def find_spec(self, name, path=None, target=None):
        while name == "torch" and os.path.exists(HOLD):
            time.sleep(0.05)
        return None
HOLD = sys.argv.pop(1)
sys.meta_path.insert(0, _HoldTorch())
from nodes.cli import app
app()
"""


@pytest.mark.timeout(120)
def test_a_node_holds_its_folder_before_its_imports(tmp_path):
    """`composer-node join` takes its folder lock first (`nodes.folder_lock`), before torch is imported: a standby
    started beside a node whose imports are slow (a loaded box, a cold disk) sees the folder held, instead of taking
    it after its ``--join-timeout`` as if no node ran (then the node exited 1, "in use": seen in a churn run)."""
    hold = tmp_path / "hold-torch"
    hold.touch()
    own = tmp_path / "run" / "node-a"
    node = subprocess.Popen([sys.executable, "-c", _TORCH_HELD, str(hold), "join", "--peer",
                             "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
                             "--run-dir", str(tmp_path / "run"), "--name", "node-a", "--device", "cpu"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _until(lambda: lock_is_held(own) or node.poll() is not None, timeout_s=90)
        assert node.poll() is None and lock_is_held(own), node.stderr.read().decode()[-2000:] if node.poll() else ""
    finally:
        hold.unlink()
        stop_processes([node])


LIVES_PEER = ROOT / "tests" / "standby_lives_peer.py"


def _standby_of_lives(own: Path, ending: str, *extra: str) -> subprocess.Popen:
    """tests/standby_lives_peer.py on ``own`` (forked from the suite's template: its imports are done), its log to
    ``own.log``, its last line (exit code, torch threads) on stdout."""
    import prefork

    own.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{own}.log", "ab") as log:
        return prefork.popen([sys.executable, str(LIVES_PEER), str(own), "--ending", ending, *extra], stdout=subprocess.PIPE,
                             stderr=log, text=True, cwd=ROOT, start_new_session=True)


def _lives(own: Path) -> list[dict]:
    path = own / "lives.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(180)
def test_a_standby_forks_each_life_of_its_node_and_stands_by_it_again(tmp_path):
    """One standby process, three lives (`Standby.run_lives`): each forked from it, the leader of its own process
    group, holding the node's folder from its first instant, alone (the standby closed its descriptor of the lock:
    `FileLockHeld.hand_over`), with torch's threads back at the standby's start count while the standby itself waits
    at one; the first two SIGKILLed, each followed by the next life at once; the third finishes the run and the
    standby exits 0."""
    own = tmp_path / "node-a"
    standby = _standby_of_lives(own, "killed,killed,finished")
    try:
        out, _ = standby.communicate(timeout=150)
    finally:
        stop_processes([standby])
    log = Path(f"{own}.log").read_text()
    assert standby.returncode == 0, log[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"standby_exit": 0, "standby_torch_threads": 1}
    lives = _lives(own)
    assert [x["ending"] for x in lives] == ["killed", "killed", "finished"], lives
    assert len({x["pid"] for x in lives}) == 3 and {x["parent"] for x in lives} == {standby.pid}, lives
    for x in lives:
        assert x["own_session"] and x["holds_lock"] and not x["another_open_file_can_lock"], x
        assert x["standby_let_go"], x  # no descriptor of the standby's kept the lock
        assert x["torch_threads"] == 2 and not x["prepared"], x  # nothing prepared: no run config was written
    assert log.count("standby takes over node-a") == 3, log[-3000:]
    assert log.count("was killed by SIGKILL") == 2 and "exited 0" in log, log[-3000:]


@pytest.mark.timeout(180)
def test_a_standby_that_starts_its_node_forks_the_first_life_at_once_and_stands_by_it(tmp_path):
    """``--with-standby`` (`Standby`'s ``first_life_lock``): the process holds the node's folder from its start and
    forks the first life with it at once (not after ``alone_after_s``, 60 s here), flagged as the first
    (`Standby.starting_first_life`: its join counts from the command's start); that life is SIGKILLed and the next
    one is a takeover as with ``--standby``, not flagged."""
    own = tmp_path / "node-a"
    t0 = time.monotonic()
    standby = _standby_of_lives(own, "killed,finished", "--starts-node")
    try:
        out, _ = standby.communicate(timeout=150)
    finally:
        stop_processes([standby])
    log = Path(f"{own}.log").read_text()
    assert standby.returncode == 0 and time.monotonic() - t0 < 60, log[-3000:]
    lives = _lives(own)
    assert [(x["ending"], x["first_life"]) for x in lives] == [("killed", True), ("finished", False)], lives
    for x in lives:
        assert x["own_session"] and x["holds_lock"] and x["standby_let_go"] and x["parent"] == standby.pid, x
    assert "standby: starting node-a's first life" in log and log.count("standby takes over node-a") == 1, log[-3000:]
    assert "no process of it started" not in log, log[-3000:]


@pytest.mark.timeout(180)
def test_a_standby_stops_forking_lives_that_fail_at_their_start(tmp_path):
    """Lives that exit with an error before any round line (a node that cannot start) are not forked for ever: after
    `MAX_FAILED_LIVES` in a row the standby exits 1 and says why."""
    from nodes.standby import MAX_FAILED_LIVES

    own = tmp_path / "node-a"
    standby = _standby_of_lives(own, "failed")
    try:
        standby.communicate(timeout=150)
    finally:
        stop_processes([standby])
    log = Path(f"{own}.log").read_text()
    assert standby.returncode == 1, log[-3000:]
    assert len(_lives(own)) == MAX_FAILED_LIVES, _lives(own)
    assert f"the last {MAX_FAILED_LIVES} lives of node-a ended with an error before any round" in log, log[-3000:]


@pytest.mark.timeout(180)
def test_a_standby_whose_node_ended_the_run_without_learning_exits_1_without_taking_over(tmp_path):
    """A life that reached the run's end and failed it ("trained on nothing") marks the run finished with that error:
    its standby exits 1 and forks no life to join a run that is over (which exited 0 on "the run is already over")."""
    own = tmp_path / "node-a"
    standby = _standby_of_lives(own, "nothing,finished")
    try:
        standby.communicate(timeout=150)
    finally:
        stop_processes([standby])
    log = Path(f"{own}.log").read_text()
    assert standby.returncode == 1 and len(_lives(own)) == 1, log[-3000:]
    assert "node-a finished its run with an error (trained on nothing" in log, log[-3000:]


def test_a_standby_that_loaded_a_model_with_a_progress_bar_may_still_fork():
    """A ``--model``'s ``from_pretrained`` shows a tqdm bar, and tqdm's monitor thread made every fork of a standby
    unsafe (it then joined as the node itself, and no standby was left: seen with an untrained ``--model``).
    `single_threaded_torch` keeps the thread from starting."""
    code = ("import time, tqdm; from nodes.fork import fork_unsafe, single_threaded_torch; single_threaded_torch(); "
            "[time.sleep(0.01) for _ in tqdm.tqdm(range(50))]; print(fork_unsafe())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stdout + out.stderr[-2000:]


@pytest.mark.timeout(180)
def test_a_stopped_standby_stops_the_life_it_forked(tmp_path):
    """SIGTERM to the standby (a job's stop, Ctrl+C) reaches the life it forked, in its own process group: the life
    stops on it (130), and the standby exits 130 with no process of the life left."""
    import psutil

    own = tmp_path / "node-a"
    standby = _standby_of_lives(own, "wait")
    try:
        _until(lambda: _lives(own) or standby.poll() is not None, timeout_s=120)
        life = _lives(own)[0]["pid"]
        standby.send_signal(signal.SIGTERM)
        standby.communicate(timeout=30)
    finally:
        stop_processes([standby])
    log = Path(f"{own}.log").read_text()
    assert standby.returncode == 130, log[-3000:]
    assert "exited 130" in log and not psutil.pid_exists(life), log[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_killed_nodes_standby_takes_it_over_as_the_same_peer_again_and_again(run_dir, tmp_path):
    """node-1's process is SIGKILLed in round 2's all-reduce: the survivors go on within the averaging timeout, and
    its standby (started beside it) forks its next life, which takes over as the same peer ID, with the env server and
    policy the standby prepared, while the survivors are still in that all-reduce. It joins the next round (that group
    can take no member, `joins_round`) instead of training round 2 to find no group. That life is SIGKILLed in turn
    after the first inner step of round 5's phase (its whole process group, as a crash of the node's process takes
    it), and the same standby, prepared again, forks a third life: it goes on from the cut phase's journal
    (`composer_diloco.inner.journal`: the step's progress on its theta, its episodes in the all-reduce's weight). That
    one is SIGKILLed as it enters round 8's barrier, its phase handed off: the swarm averages round 8 without it, and
    the fourth life re-sends that phase in its own (its progress and episodes, as the journal kept them) and trains
    the rest of the run, every round agreeing, as the same peer; its standby exits 0 when the node finishes the run.
    node-0 runs under its standby, one command (``--with-standby``): the command forks its first life at once, whose
    join counts from the command's start, and exits 0 once that life finished the run. (The fault tests' node killed in an all-reduce: one run for both, the suite's
    time.)"""
    rounds, killed_in, cut_in, lost_in = 11, 2, 5, 8
    hold = tmp_path / "hold-node-1"  # while it exists node-1 pauses after each inner step: its standby prepares
    config = write_config(tmp_path / "standby.toml", f"rounds = {rounds}\ninner_steps = 2\n[network]\n"
                                                     "heartbeat_s = 1.0\nheartbeat_ttl_s = 6.0\n"
                                                     f"averaging_timeout_s = {AVERAGING_TIMEOUT_S}\n"
                                                     "round_slack_s = 400.0\n"
                                                     # a loaded CI box may take a few rounds to take over
                                                     "[inner]\njournal_max_stale_rounds = 50\n")
    run = LocalRun(run_dir, config)
    hold.touch()
    try:
        run.start_coordinator(wait=False)
        run.start_node("node-0", "--with-standby")  # node-0 under its standby, one command
        run.start_node("node-1", env={"COMPOSER_DILOCO_FAULTS": f"hold:*:{hold},kill_in_allreduce:{killed_in}"})
        # armed in the standby's process, so in every life it forks: the first it forks dies in round 5's phase, the
        # second in round 8's barrier (a few rounds on: a takeover on a loaded box may take more than a round)
        run.start_standby("node-1", env={"COMPOSER_DILOCO_FAULTS": f"kill_after_step:{cut_in}:1,"
                                                                   f"kill_in_barrier:{lost_in}"})
        run.wait_peer_line()
        run.wait_until(lambda: "standby prepared for run" in run.log("node-1-standby"), 300,
                       "node-1's standby to prepare")
        hold.unlink()
        assert run.wait_exit("node-1", 300) == -9  # killed in round 2's all-reduce
        killed_at = time.time()
        assert f"SIGKILL (in the all-reduce of round {killed_in})" in run.log("node-1"), run.log_tail("node-1")
        went_on = run.wait_round("coordinator", killed_in, timeout_s=120)
        print(f"\nnode SIGKILLed in the all-reduce: the run went on after {went_on['time'] - killed_at:.1f} s "
              f"(status {went_on['status']})")
        assert went_on["time"] - killed_at < AVERAGING_TIMEOUT_S + 10.0  # then at most a resync
        run.assert_exit_ok("coordinator", "node-0", "node-1-standby")
    finally:
        hold.unlink(missing_ok=True)
        run.stop()
    taken = run.log("node-1-standby")
    assert taken.count("standby takes over node-1 (its process ended): joining as it, prepared in") == 3, taken[-3000:]
    assert f"SIGKILL (after inner step 1 of round {cut_in}'s phase)" in taken, taken[-3000:]
    assert f"SIGKILL (entering the barrier of round {lost_in})" in taken, taken[-3000:]
    assert "node-1's life 1 (pid" in taken and "was killed by SIGKILL" in taken, taken[-3000:]
    assert "node-1's life 2 runs as pid" in taken and "node-1's life 2 (pid" in taken, taken[-3000:]
    assert taken.count("env server envs.tool_env.server up at") == 3  # one it launched for each life, while waiting
    # the folder lock proved the key's holder ended: hivemind's check that it is free (seconds) is skipped
    assert "Checking that identity" not in taken, taken[-3000:]
    assert "all-reduce failed" not in taken and "could not find a group" not in taken, taken[-3000:]
    ids = re.findall(r"peer ID (\S+) \(its key", run.log("node-1") + " " + taken)
    assert len(ids) == 4 and len(set(ids)) == 1, ids
    # node-0's command forked its first life at once, which trained the whole run; then that command exited 0
    under = run.log("node-0")
    assert "standby: starting node-0's first life" in under and "node-0's life 1 runs as pid" in under, under[-3000:]
    assert "standby takes over" not in under and "node-0 finished its run: the standby exits" in under, under[-3000:]
    records = run.records()
    mine = [r["round"] for r in records["node-1"]]
    assert mine[:3] == [0, 1, killed_in + 1] and mine[-1] == rounds - 1 and mine == sorted(set(mine)), mine
    assert cut_in - 1 in mine and cut_in not in mine and lost_in not in mine, mine
    # the second life re-sent round 2's phase, which its first life handed off before it was killed in that round's
    # all-reduce, unless a group that averaged round 2 counted node-1 (it died mid-way: what it had sent may have
    # reached the survivors' average: then it records it as landed); the coordinator averaged its episodes either way
    second = next(r for r in records["node-1"] if r["round"] == killed_in + 1)
    counted = any(r["status"] == "averaged" and "node-1" in r["members"] and "node-1" not in r["rejected"]
                  for name in ("coordinator", "node-0") for r in records[name] if r["round"] == killed_in)
    phase = records["node-1"][0]["samples"]  # a whole phase's episodes (its 2 inner steps)
    print(f"round {killed_in}'s phase of the killed node: {'counted by the survivors' if counted else 're-sent'}")
    if counted:  # recorded as landed: its seconds and episodes reached round 2's model, with no line of its life
        assert "resent_round" not in second, second
        assert {k: second.get(k) for k in ("landed_round", "landed_samples")} == \
            {"landed_round": killed_in, "landed_samples": phase}, second
        assert second["landed_inner_seconds"] > 0, second
    else:
        assert {k: second.get(k) for k in ("resent_round", "resent_samples")} == \
            {"resent_round": killed_in, "resent_samples": phase}, second
        assert second["resent_inner_seconds"] > 0, second
    weights = {r["round"]: r["weight_total"] for r in records["coordinator"]}
    node0 = {r["round"]: r["samples"] for r in records["node-0"]}
    if second["status"] == "averaged" and second["round"] in node0:
        assert weights[second["round"]] == node0[second["round"]] + second["samples"] + (0 if counted else phase)
    # the third life's first phase went on from round 5's journaled step: its progress and its episodes reached the
    # all-reduce (the coordinator averaged node-0's episodes and both of node-1's lives')
    went_on_from = next(r for r in records["node-1"] if r["round"] > cut_in)
    per_step = records["node-1"][0]["samples"] // 2
    assert {k: went_on_from.get(k) for k in ("resumed_round", "resumed_steps", "resumed_samples")} == \
        {"resumed_round": cut_in, "resumed_steps": 1, "resumed_samples": per_step}, went_on_from
    assert went_on_from["resumed_inner_seconds"] > 0 and went_on_from["inner_steps"] >= 1, went_on_from
    if went_on_from["status"] == "averaged" and went_on_from["round"] in node0:
        assert weights[went_on_from["round"]] == node0[went_on_from["round"]] + went_on_from["samples"] + per_step
    # the fourth life re-sent round 8's phase: handed off, never averaged (the swarm's round 8 went on without it);
    # its episodes are a whole phase's, or fewer where round 8 was its life's first phase, caught up early
    resent = next(r for r in records["node-1"] if r["round"] > lost_in)
    assert not any("node-1" in r["members"] for name in ("coordinator", "node-0") for r in records[name]
                   if r["round"] == lost_in)
    assert resent.get("resent_round") == lost_in and resent["resent_samples"] in range(per_step, phase + 1, per_step)
    assert resent["resent_inner_seconds"] > 0 and "resumed_round" not in resent, resent
    if resent["status"] == "averaged" and resent["round"] in node0:
        assert weights[resent["round"]] == node0[resent["round"]] + resent["samples"] + resent["resent_samples"]
    assert f"re-sent the inner phase of round {lost_in} whose sync its last life did not see end" in taken, \
        taken[-3000:]
    # each life's first line says where its join went (`JOIN_PHASES`): the first from its process's start, each
    # takeover from the kill, without the imports, the skeleton or the env server's launch its standby did
    [first0] = [r for r in records["node-0"] if "join_seconds" in r]  # its join counts from the command's start
    assert first0["joined_as"] == "process" and first0["join_seconds"].get("imports", 0) > 0, first0
    opening = [r for r in records["node-1"] if "join_seconds" in r]
    assert [r["joined_as"] for r in opening] == ["process"] + ["standby, prepared"] * 3, opening
    assert {"imports", "dht", "state", "trainer"} <= opening[0]["join_seconds"].keys()
    for taken_over in opening[1:]:
        assert {"dht", "env", "state", "trainer"} <= taken_over["join_seconds"].keys(), taken_over["join_seconds"]
        assert not {"imports", "model"} & taken_over["join_seconds"].keys(), taken_over["join_seconds"]
    assert 0 < sum(opening[1]["join_seconds"].values()) < opening[1]["inner_started"] - killed_at + 2.0, opening[1]
    shas = assert_agree(records, range(rounds))
    assert read_outer_state(latest_checkpoint(run_dir))["global_sha256"] == shas[rounds - 1]
