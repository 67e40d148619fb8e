"""A ``sparse-2bit`` run on 127.0.0.1 with a lost node. A node SIGKILLed in the all-gather and restarted under the
same name takes back its error feedback from ``<run-dir>/<node>/codec_state.pt``
(`nodes.node.Node._restore_codec_state`), and every peer agrees on ``global_sha256`` in every round, before and after."""


import pytest
import torch

from composer_diloco.checkpoint import CODEC_STATE_FILE
from local_run import LocalRun, assert_agree, write_config

CONFIG = """
rounds = {rounds}
inner_steps = 2
compression = "sparse-2bit"
[network]
round_slack_s = 60.0
heartbeat_s = 1.0
heartbeat_ttl_s = 6.0
averaging_timeout_s = 15.0  # a lost peer costs hivemind's next-chunk timeout, a third of it
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_node_killed_in_the_all_gather_restarts_with_its_error_feedback_and_replicas_agree(run_dir, tmp_path):
    """node-1 is SIGKILLed right after its round-1 message went to the first of the two others: one survivor may hold
    a mean with it and the other one without; `recovery.settle_pick` brings them back to one theta. node-1, restarted
    under the same name, takes back the error feedback it saved, rejoins and averages; the run finishes with every
    replica on one theta every round. (One run for the kill and the restart: the suite's time.)"""
    rounds = 5
    hold = tmp_path / "hold-node-0"  # while it exists node-0 pauses after each inner step
    run = LocalRun(run_dir, write_config(tmp_path / "sparse.toml", CONFIG.format(rounds=rounds)))
    saved = run_dir / "node-1" / CODEC_STATE_FILE
    try:
        run.start_coordinator(wait=False)  # the nodes start beside it (the suite's time)
        run.start_node("node-0", env={"COMPOSER_DILOCO_FAULTS": f"hold:*:{hold}"})
        run.start_node("node-1", env={"COMPOSER_DILOCO_FAULTS": "kill_in_allreduce:1"})
        run.wait_peer_line()
        run.wait_until(lambda: run.procs["node-1"].poll() is not None, 300, "node-1 to die in round 1's all-gather")
        assert run.procs["node-1"].returncode == -9
        assert "SIGKILL (in the all-reduce of round 1)" in run.log("node-1")
        before = torch.load(saved, weights_only=True)
        assert before["round"] >= 0 and before["codec_state"]["buffer"].abs().sum() > 0

        restarted_at = run.restart_while_held(  # the run cannot end before node-1 is back (without the fault)
            "node-1", hold, lambda: f"error feedback of round {before['round']} restored" in run.log("node-1"),
            "the restarted node-1 to restore its error feedback")
        run.assert_exit_ok("node-0", "node-1", "coordinator")
    finally:
        hold.unlink(missing_ok=True)
        run.stop()
    records = run.records()
    print("\nround 1 after the kill:", {n: [r["status"] for r in recs if r["round"] == 1] for n, recs in records.items()})
    assert_agree(records, range(rounds))
    assert 1 not in [r["round"] for r in records["node-1"] if r["time"] < restarted_at]  # killed in round 1
    rejoined = [r for r in records["node-1"] if r["time"] > restarted_at]
    assert rejoined and all(r["status"] == "averaged" for r in rejoined), rejoined
    # what a sparse round costs a node at N = 3: its ~19 KB message to each of the two others (the kill's round 1 and
    # the rounds without node-1 aside)
    full = [(r["round"], r["bytes_sent"]) for r in records["node-0"] if r["status"] == "averaged" and r["peers"] == 3
            and r["round"] != 1]
    assert full and all(20_000 < sent < 60_000 for _, sent in full), full
