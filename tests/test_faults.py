"""Fault injection with real processes: a lost coordinator, slow and corrupt nodes, a kill while writing a checkpoint.

Each test runs a coordinator and two nodes on 127.0.0.1 (`local_run.LocalRun`), injects faults, and checks that the
survivors go on within the averaging timeout, agree on ``global_sha256`` every round, and finish the run. The seconds
until the run went on are printed (``pytest -s``) for the operations notes. A node lost in its inner phase and
restarted runs in `tests/test_reaper.py` (its main process SIGKILLed, as an OOM killer does), one lost inside the
all-reduce in `tests/test_standby.py` and `tests/test_overlap.py`: one run each, the suite's time.
"""

import json
import time

import pytest

import prefork
from composer_diloco.checkpoint import latest_checkpoint, read_outer_state
from local_run import LocalRun, assert_agree, free_listen_address, write_config

# What survivors wait for a peer lost in an all-reduce: the tiny model's all-reduce takes ~1 s here, so 15 s leaves a
# loaded CI machine room while keeping each fault's wait short (hivemind's next-chunk timeout is a third of it).
AVERAGING_TIMEOUT_S = 15.0
FAULT_CONFIG = """
rounds = {rounds}
inner_steps = {inner_steps}
[network]
round_slack_s = 60.0
heartbeat_s = 1.0
heartbeat_ttl_s = 6.0
averaging_timeout_s = {averaging_timeout_s}
{extra}
"""


def config(tmp_path, rounds: int, inner_steps: int = 2, extra: str = ""):
    return write_config(tmp_path / "faults.toml", FAULT_CONFIG.format(rounds=rounds, inner_steps=inner_steps,
                                                                      averaging_timeout_s=AVERAGING_TIMEOUT_S,
                                                                      extra=extra))


def start(run: LocalRun, env: dict[str, dict[str, str]] | None = None, *coordinator_args: str) -> None:
    """The coordinator and both nodes at once (the nodes re-dial its line until it listens), as a job script does."""
    run.start_coordinator(*coordinator_args, env=(env or {}).get("coordinator"), wait=False)
    for name in ("node-0", "node-1"):
        run.start_node(name, env=(env or {}).get(name))
    run.wait_peer_line()


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_coordinator_killed_nodes_go_on_and_it_reloads_from_a_live_node(run_dir, tmp_path):
    """Also (issue 37): restarted with the same command, the coordinator has the same peer ID (its key is in the run
    dir), so the ``peer:`` line it printed first still works: a node started on it after the restart joins; and
    the live nodes, absent from its ``peers.json`` (whose one entry is dead), find it by re-dialing that line: it
    reloads their round from them, and none of them steps alone after the restart. A node restarted while the
    coordinator is down joins through the peer it trained with in its last life."""
    rounds = 7
    hold = tmp_path / "hold-nodes"  # while it exists the nodes pause after each inner step
    run = LocalRun(run_dir, config(tmp_path, rounds=rounds))
    held = {"COMPOSER_DILOCO_FAULTS": f"hold:*:{hold}"}
    listen = ("--listen", free_listen_address())
    try:
        # the worst moment to lose it: in round 2's all-reduce, after it returned its averaged part to one
        # node and not to the other, so the two nodes leave the all-reduce with different averages
        start(run, {"coordinator": {"COMPOSER_DILOCO_FAULTS": "kill_in_reply:2"}, "node-0": held, "node-1": held},
              *listen)
        first_line = run.peer
        run.procs["coordinator"].wait(timeout=300)
        killed_at = time.time()
        coordinator_log = run.log("coordinator")
        assert "fault injection: SIGKILL (after answering one peer" in coordinator_log, run.log_tail("coordinator")
        checkpoint_round = read_outer_state(latest_checkpoint(run_dir))["round"]

        settled = max(run.wait_round(n, 2, timeout_s=120)["time"] for n in ("node-0", "node-1"))
        print(f"\ncoordinator SIGKILLed mid-reply: both nodes left round 2 {max(0.0, settled - killed_at):.1f} s after")
        without = {n: run.records()[n] for n in ("node-0", "node-1")}
        assert_agree(without, [2])
        at_2 = [next(r for r in recs if r["round"] == 2) for recs in without.values()]
        # the node that missed the coordinator's part took the theta of the one that received it
        assert sorted(r["status"] for r in at_2) == ["averaged", "resynced"], at_2
        assert all(r["peers"] == 3 for r in at_2), at_2
        # without it they average among themselves, past the checkpoint it wrote before dying
        went_on = run.wait_round("node-0", checkpoint_round, timeout_s=120)
        run.wait_round("node-1", checkpoint_round, timeout_s=60)
        print(f"their first round without it (round {checkpoint_round}) ended {went_on['time'] - killed_at:.1f} s "
              "after the kill")
        without = {n: run.records()[n] for n in ("node-0", "node-1")}
        assert_agree(without, [checkpoint_round])
        assert next(r for r in without["node-0"] if r["round"] == checkpoint_round)["peers"] == 2

        # the nodes pause (alive, heartbeating) until the restarted coordinator has taken their state: however
        # slow the machine, the run cannot end before it is back
        hold.touch()
        # a node restarted while the coordinator is down, on the same line (the only --peer its job script knows, now
        # dead) joins through the peers of its last life (run_dir/node-1/peers.json): node-0
        run.kill("node-1")
        run.start_node("node-1", env=held, peer=first_line)
        run.wait_until(lambda: run.log("node-1").count("global model of round") >= 2, 120,
                       "node-1, restarted while the coordinator is down, to load theta through node-0")
        assert "also dialing the 1 peer(s) this node saw in its last life" in run.log("node-1"), run.log_tail("node-1")
        # the issue-37 case: the only peer the restarted coordinator knows of is dead, so the live nodes, never in
        # its peers.json now, must find it themselves (they re-dial their --peer, the same line: the same key)
        (run_dir / "peers.json").write_text(json.dumps([DEAD_PEER]))
        run.start_coordinator(*listen, wait=False)
        restarted_at = time.time()
        run.start_node("node-2", "--peer", DEAD_PEER, peer=first_line)  # a job script's lines from before the kill
        assert run.wait_peer_line() == first_line  # the same command and --run-dir: the same peer line
        run.wait_until(lambda: "the newest checkpoint was round" in run.log("coordinator"), 240,
                       "the restarted coordinator to reload from a live node")
        run.wait_until(lambda: "loaded round" in run.log("node-2"), 240, "node-2 to join on the first peer line")
        hold.unlink()
        run.assert_exit_ok("coordinator", "node-0", "node-1", "node-2")
    finally:
        hold.unlink(missing_ok=True)
        run.stop()
    log = run.log("coordinator")
    assert f"(the newest checkpoint was round {checkpoint_round})" in log, log[-3000:]
    records = run.records()
    after = [r for r in records["coordinator"] if r["time"] > killed_at]
    assert after and after[0]["round"] > checkpoint_round, after  # it did not go back to its checkpoint
    print(f"restarted coordinator rejoined at round {after[0]['round']}")
    for name in ("node-0", "node-1"):  # once they met, nobody stepped alone
        assert not [r for r in records[name] if r["time"] > restarted_at and r["status"] == "alone"], records[name]
    shas = assert_agree(records, range(rounds))
    final = read_outer_state(latest_checkpoint(run_dir))
    assert final["round"] == rounds and final["global_sha256"] == shas[rounds - 1]
    assert records["node-2"] and all(r["global_sha256"] == shas[r["round"]] for r in records["node-2"])


DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
"""A peer line nobody answers (port 9, discard)."""


CHECKPOINT_WRITER = """
import sys
from composer_diloco import faults
from composer_diloco.outer.global_model import GlobalModel
from composer_diloco.policy import build_tiny_model, load_default_tokenizer
from composer_diloco.checkpoint import save_checkpoint

run_dir, round_ = sys.argv[1], int(sys.argv[2])
faults.install(sys.argv[3])  # this script is its own entry point: it arms the plan as the console scripts do
tokenizer = load_default_tokenizer()
model = build_tiny_model(tokenizer, seed=round_)
save_checkpoint(run_dir, round_, model, tokenizer, GlobalModel(model, lr=0.7, momentum=0.9), "{}")
"""


@pytest.mark.timeout(180)
def test_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    import subprocess
    import sys

    from composer_diloco.policy import load_policy
    from local_run import ROOT

    def write(round_: int, faults: str = "") -> subprocess.CompletedProcess:
        return prefork.run([sys.executable, "-c", CHECKPOINT_WRITER, str(tmp_path), str(round_), faults],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, start_new_session=True)

    assert write(1).returncode == 0
    good = read_outer_state(latest_checkpoint(tmp_path))
    killed = write(2, faults="kill_in_checkpoint:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert list((tmp_path / "checkpoints").glob(".tmp-round-000002-*")), "the kill came before the files were written"
    assert latest_checkpoint(tmp_path).name == "round-000001"
    assert read_outer_state(latest_checkpoint(tmp_path))["global_sha256"] == good["global_sha256"]
    load_policy(str(latest_checkpoint(tmp_path)), seed=0, warmstart_steps=0)  # loads whole



@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_corrupt_and_slow_pseudo_gradients_every_peer_weighs_alike(run_dir, tmp_path):
    """Corrupt contributions: round 0, node-1's pseudo-gradient is a norm outlier; round 1, it holds a NaN; round 2,
    both nodes' do, so every contribution is dropped and the round is "skipped" (theta unchanged, the run goes on).

    A slow node: node-1 is also slow (each inner step 5 s longer) and trains on half the run's batch (``--batch-size
    4``: 4 episodes per step against node-0's 8): it stops at the round budget every round, and in round 3 (nothing
    dropped) every peer weighs each node by the samples it trained on (steps x its batch), so theta is the same
    everywhere. (One run for both: the suite's time.)"""
    rounds, budget_s, delay_s = 4, 8.0, 5.0
    run = LocalRun(run_dir, config(tmp_path, rounds=rounds, inner_steps=4, extra=f"round_budget_s = {budget_s}"))
    try:
        run.start_coordinator(wait=False)
        run.start_node("node-0", env={"COMPOSER_DILOCO_FAULTS": "nan_pseudo_gradient:2"})
        run.start_node("node-1", "--batch-size", "4", "--grad-accum", "1",
                       env={"COMPOSER_DILOCO_FAULTS": f"step_delay:*:{delay_s},scale_pseudo_gradient:0:1000,"
                                                      "nan_pseudo_gradient:1,nan_pseudo_gradient:2"})
        run.wait_peer_line()
        run.assert_exit_ok("coordinator", "node-0", "node-1")
    finally:
        run.stop()
    records = run.records()
    initial = read_outer_state(run_dir / "checkpoints" / "round-000000")["global_sha256"]
    shas = assert_agree(records, range(rounds))
    assert len({initial, shas[0], shas[1]}) == 3  # theta moved in rounds 0 and 1, by node-0's pseudo-gradient
    for rnd in (0, 1):
        at = {n: next(r for r in recs if r["round"] == rnd) for n, recs in records.items()}
        assert all(r["rejected"] == ["node-1"] and r["peers"] == 3 and r["status"] == "averaged"
                   for r in at.values()), at
        assert at["coordinator"]["weight_total"] == at["node-0"]["samples"]
    skipped = {n: next(r for r in recs if r["round"] == 2) for n, recs in records.items()}
    assert all(r["status"] == "skipped" and sorted(r["rejected"]) == ["node-0", "node-1"]
               for r in skipped.values()), skipped
    assert skipped["coordinator"]["weight_total"] == 0
    assert shas[2] == shas[1]  # nothing left to step with: theta unchanged
    log = run.log("node-0")
    assert "dropped the pseudo-gradient of node-1: pseudo-gradient norm" in log
    assert "dropped the pseudo-gradient of node-1: non-finite pseudo-gradient" in log
    assert "round 2: no contribution left after screening: theta unchanged" in log

    for rnd in range(rounds):
        fast, slow, coordinator = (next(r for r in records[n] if r["round"] == rnd)
                                   for n in ("node-0", "node-1", "coordinator"))
        print(f"\nround {rnd}: fast node {fast['inner_steps']} steps in {fast['inner_seconds']:.1f} s, waited "
              f"{fast['wait_seconds']:.1f} s; slow node {slow['inner_steps']} steps in {slow['inner_seconds']:.1f} s")
        assert slow["deadline_hit"] and 1 <= slow["inner_steps"] < 4, slow
        assert slow["inner_seconds"] < budget_s + delay_s + 10.0  # at most one step past the deadline
        assert fast["inner_steps"] == 4 and not fast["deadline_hit"]
        assert fast["samples"] == 4 * 8 and slow["samples"] == slow["inner_steps"] * 4, (fast, slow)  # its own batch
        assert fast["wait_seconds"] < 60.0  # round_slack_s: nobody was given up on
        assert coordinator["peers"] == 3
    last = {n: records[n][-1] for n in ("node-0", "node-1", "coordinator")}
    assert last["coordinator"]["status"] == "averaged" and last["coordinator"]["rejected"] == [], last
    assert last["coordinator"]["weight_total"] == last["node-0"]["samples"] + last["node-1"]["samples"]  # by samples
    assert shas[3] != shas[2]  # both moved it
