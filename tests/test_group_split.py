"""A round that hivemind's matchmaking splits into several all-reduce groups heals before the next inner phase.

Four real peers (their own DHTs and averagers, the real barrier and all-reduce). In round 0 node-c and node-d are
made to look for their group under other group bits, as two groups that formed apart in one window would, so
{node-a, node-b} and {node-c, node-d} each average on their own and theta forks. node-c and node-d, whose groups were
smaller than the four peers their barrier found and lacked the authority (node-a, the lowest name), take node-a's
theta as soon as it is published (`recovery.after_group_split`): every peer ends round 0 on one theta.
Before that fix, the fork lived a whole round (healed at the next sync, `recovery.split_check`). In round 1 the
authority itself finds no group while the three others average: it stops looking once they have finished the round
(`DiLoCoPeer._await_step`, not after the step's timeout) and takes their theta (`recovery.after_failed_round`) rather
than step alone, and they keep it. Round 2 averages all four.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from composer_diloco.config import load_config
from composer_diloco.outer.global_model import GlobalModel, optimizer_factory

from tests_support import close_peers, end_peer_scenario, run_scenario_in_child

SPLIT_CONFIG = """
rounds = 3
[outer]
lr = 1.0
momentum = 0.0
nesterov = false
[network]
matchmaking_time_s = 2.0
averaging_timeout_s = 10.0
round_slack_s = 30.0
heartbeat_s = 1.0
heartbeat_ttl_s = 6.0
"""
NAMES = ["node-a", "node-b", "node-c", "node-d"]
SPLIT = {0: {"node-c", "node-d"}, 1: {"node-a"}}  # by round: the peers that look for its group under other bits
OTHER_BITS = "1" * 32  # `round_group_bits` of a round no run reaches


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_round_split_into_two_groups_ends_on_the_authoritys_theta(tmp_path):
    """The peers run in a child process (several hivemind averagers in one process can abort at its exit)."""
    r = run_scenario_in_child("test_group_split", "split_scenario", tmp_path)
    assert "scenario passed" in r.stdout, (r.stdout[-3000:], r.stderr[-6000:])
    assert "matchmaking split the round" in r.stderr, r.stderr[-6000:]
    # round 1: node-a stopped looking for a group once the three others had finished the round, instead of searching
    # out the step's timeout (`DiLoCoPeer._await_step`)
    assert "node-a round 1: node-b, node-c, node-d finished the round without this peer's group" in r.stderr, \
        r.stderr[-6000:]


def split_scenario(tmp_path: Path) -> None:
    """The body of the test above, in its own process; prints "scenario passed" and leaves at once."""
    from composer_diloco.outer.peer import DiLoCoPeer, round_group_bits
    from composer_diloco.outer.swarm import Swarm, start_dht, visible_multiaddr
    from test_outer_optimizer import Tiny

    (tmp_path / "split.toml").write_text(SPLIT_CONFIG)
    config = load_config(tmp_path / "split.toml")
    dhts, peers = [], {}
    try:
        for name in NAMES:
            dhts.append(start_dht(initial_peers=[visible_multiaddr(dhts[0])] if dhts else []))
            swarm = Swarm(dhts[-1], run_name=config.run_name, peer_name=name, role="node")
            peers[name] = DiLoCoPeer(Tiny(), config, swarm)
            swarm.set_round(0, sha=peers[name].global_model.sha256())
            swarm.start_heartbeat(config.network.heartbeat_s, config.network.heartbeat_ttl_s)
        for name in NAMES:
            averager = peers[name].averager
            moved = {round_group_bits(r) for r, names in SPLIT.items() if name in names}
            set_bits = averager.set_group_bits
            averager.set_group_bits = lambda bits, set_bits=set_bits, moved=moved: set_bits(
                OTHER_BITS if bits in moved else bits)
        start = GlobalModel(Tiny(), outer_optimizer=optimizer_factory(config.outer))
        results: dict[str, list] = {name: [] for name in NAMES}

        def train_and_sync(name: str, r: int) -> None:
            model = Tiny()
            peers[name].global_model.load_into(model)
            with torch.no_grad():  # "inner steps": each node moves theta its own way
                model.a.add_(0.1 * (r + 1) * (NAMES.index(name) - 1.5))
            results[name].append(peers[name].sync(model, 1.0))

        for r in range(config.rounds):
            threads = [threading.Thread(target=train_and_sync, args=(n, r)) for n in NAMES]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert all(len(results[n]) == r + 1 for n in NAMES), {n: results[n] for n in NAMES}

        first = {n: results[n][0] for n in NAMES}
        print({n: (x.status, x.peers, x.global_sha256[:12]) for n, x in first.items()}, flush=True)
        # round 0: two groups of two; the authority's half averaged, the other half took its theta at once
        assert [first[n].status for n in NAMES] == ["averaged", "averaged", "resynced", "resynced"], first
        assert first["node-a"].peers == first["node-b"].peers == 2, first
        assert len({x.global_sha256 for x in first.values()}) == 1, first
        # node-a's theta is the mean of node-a's and node-b's pseudo-gradients only (outer lr 1: averaging)
        assert first["node-a"].global_sha256 != start.sha256()
        # round 1: the authority found no group; it took the theta the other three averaged to
        second = {n: results[n][1] for n in NAMES}
        print({n: (x.status, x.peers, x.global_sha256[:12]) for n, x in second.items()}, flush=True)
        assert second["node-a"].status == "resynced", second
        assert {(second[n].status, second[n].peers) for n in NAMES[1:]} == {("averaged", 3)}, second
        assert len({x.global_sha256 for x in second.values()}) == 1, second
        # round 2: all four averaged from that one theta
        third = {n: results[n][2] for n in NAMES}
        assert {(x.status, x.peers) for x in third.values()} == {("averaged", 4)}, third
        assert len({x.global_sha256 for x in third.values()}) == 1, third
        assert len({p.round for p in peers.values()}) == 1
    finally:
        close_peers(peers.values(), dhts)
    end_peer_scenario()
