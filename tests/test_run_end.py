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
        run.start_coordinator()
        # node-0 returns the last averaged part of its share 3 s late: its own average is complete 3 s before the
        # coordinator's, and it leaves at once
        run.start_node("node-0", env={"COMPOSER_DILOCO_FAULTS": "slow_reply:0:3"})
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

