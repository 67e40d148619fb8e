"""The run's last round ends with one theta on every peer, however soon a node leaves after it.

A peer's all-reduce used to return as soon as it held its own average, while, as a reducer, it could still be sending
the averaged parts of its share to the others. A node that shut down right after its last round then cut the end of
its share off the coordinator's average (seen once in CI: the coordinator missed 128 elements, found the node gone
when it came to settle, and the run ended with two thetas). Here node-0 returns its averaged parts late on purpose
(fault ``slow_reply``), in the run's one and only round, and exits as soon as its sync returns.
"""

import pytest

from composer_diloco.checkpoint import latest_checkpoint, read_outer_state
from local_run import LocalRun, assert_agree, write_config

ONE_ROUND = """
rounds = 1
inner_steps = 1
compression = "int8"
[network]
heartbeat_s = 1.0
heartbeat_ttl_s = 6.0
averaging_timeout_s = 30.0
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_node_leaving_after_its_last_round_leaves_one_theta(run_dir, tmp_path):
    run = LocalRun(run_dir, write_config(tmp_path / "one-round.toml", ONE_ROUND))
    try:
        run.start_coordinator(wait=False)  # the node starts beside it (the suite's time)
        # node-0 returns the last averaged part of its share 3 s late: its own average is complete 3 s before the
        # coordinator's, and it leaves at once
        run.start_node("node-0", env={"COMPOSER_DILOCO_FAULTS": "slow_reply:0:3"})
        run.wait_peer_line()
        for name in ("node-0", "coordinator"):
            assert run.wait_exit(name, timeout_s=240) == 0, run.log_tail(name)
    finally:
        run.stop()
    records = run.records()
    coordinator = records["coordinator"][-1]
    assert coordinator["peers"] == 2 and coordinator["status"] == "averaged", coordinator
    assert "returned no average" not in run.log("coordinator"), run.log_tail("coordinator")
    shas = assert_agree(records, [0])
    assert read_outer_state(latest_checkpoint(run_dir))["global_sha256"] == shas[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_peers_settling_the_last_round_find_the_others_still_up(run_dir, tmp_path):
    """node-1 dies in the last round's all-reduce after returning its averaged parts to one peer only, so the
    coordinator and node-0 leave it with different averages: the one that missed a part takes the other's theta
    (`recovery.settle_pick`), which has finished the run by then and stays up until that is done
    (`DiLoCoPeer.serve_until_settled`). The last round's version of test_faults' lost reducer; it does not fail
    without the node's wait at the run's end: the dead node's heartbeat, alive for its TTL at an earlier round,
    holds the coordinator's wait (and the node's) open long enough anyway."""
    run = LocalRun(run_dir, write_config(tmp_path / "two-rounds.toml", ONE_ROUND.replace("rounds = 1", "rounds = 2")))
    try:
        run.start_coordinator(wait=False)  # the nodes start beside it (the suite's time)
        run.start_node("node-0")
        run.start_node("node-1", env={"COMPOSER_DILOCO_FAULTS": "kill_in_reply:1"})
        run.wait_peer_line()
        for name in ("node-0", "coordinator"):
            assert run.wait_exit(name, timeout_s=300) == 0, run.log_tail(name)
        assert run.procs["node-1"].wait(timeout=30) != 0
    finally:
        run.stop()
    assert "fault injection: SIGKILL (after answering one peer" in run.log("node-1"), run.log_tail("node-1")
    records = {n: run.records()[n] for n in ("coordinator", "node-0")}
    shas = assert_agree(records, [0, 1])
    last = [next(r for r in recs if r["round"] == 1) for recs in records.values()]
    # the peer that missed node-1's part took the theta of the one that received it
    assert sorted(r["status"] for r in last) == ["averaged", "resynced"], last
    assert read_outer_state(latest_checkpoint(run_dir))["global_sha256"] == shas[1]
