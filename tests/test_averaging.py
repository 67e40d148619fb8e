"""The exact all-reduce across real processes: known pseudo-gradients and weights give the hand-computed weighted
mean and Nesterov step, bit-identical on every peer, for each compression."""

from pathlib import Path

import pytest
import torch

from tests_support import run_peer_trio

HERE = Path(__file__).parent
WEIGHTS = [0.0, 1.0, 3.0]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_three_peers_agree_bit_for_bit(tmp_path):
    results = run_peer_trio(HERE / "allreduce_peer.py", tmp_path, timeout_s=200)

    for compression in ("none", "fp16", "int8"):
        per_peer = [r[compression] for r in results]
        assert {p["group"] for p in per_peer} == {3}
        assert len({p["mean_sha"] for p in per_peer}) == 1, f"{compression}: peers hold different means"
        # a peer with a share of the vector (hivemind's load balancing may give one peer none) reduces it for the 2
        # others; each of them closes that reply stream once it holds every part, never the reducer first (a reducer
        # closing first lost the last parts in flight under load)
        closed = [p["closed_by_sender"] for p in per_peer]
        assert set(closed) <= {0, 2} and sum(closed) >= 4, (compression, closed)
        assert len({p["theta_sha"] for p in per_peer}) == 1, f"{compression}: peers hold different theta"
        # second tensor: peer i sent the constant i, weights 0, 1, 3 -> mean (0*0 + 1*1 + 3*2) / 4 = 1.75
        mean = torch.tensor(per_peer[0]["mean_small"])
        tol = {"none": 0.0, "fp16": 1e-3, "int8": 0.05}[compression]
        assert torch.allclose(mean, torch.full_like(mean, 1.75), atol=tol), (compression, mean)
        # outer step from theta = 1: v = g, theta' = 1 - 0.7 * (g + 0.9 g) = 1 - 1.33 g
        theta = torch.tensor(per_peer[0]["theta_small"])
        assert torch.allclose(theta, 1 - 1.33 * mean, atol=1e-6)
    none_bytes = sum(r["none"]["bytes_sent"] for r in results)
    fp16_bytes = sum(r["fp16"]["bytes_sent"] for r in results)
    int8_bytes = sum(r["int8"]["bytes_sent"] for r in results)
    assert 1.8 < none_bytes / fp16_bytes < 2.2 and 3.2 < none_bytes / int8_bytes < 4.4, (
        none_bytes, fp16_bytes, int8_bytes)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_hung_reducer_ends_its_all_reduce_and_says_where_it_stood(tmp_path):
    """A reducer that hangs where no stream timer of hivemind's runs (peer 2 never adds its own part to its share:
    fault ``stall_reducer``) used to wait out the step's whole ``allreduce_timeout`` (40 s here; 45 s at the
    default, seen once under churn, BENCHMARKS.md 3k). Once the others' parts are in, nothing is left to wait for
    but its own share, and the all-reduce's watch (`ExactAllReduceRunner._watch`) ends it half a ``sender_timeout``
    later (1.5 s here), saying where it stood: its step fails within seconds. The two others give its share up
    after hivemind's ``reducer_timeout`` (6 s), as before, and agree: the same zeros in its share."""
    results = run_peer_trio(HERE / "stall_peer.py", tmp_path, timeout_s=200)
    hung, others = results[2], results[:2]
    print(f"\nhung reducer's step failed after {hung['seconds']:.1f} s; the others' took "
          f"{', '.join(format(o['seconds'], '.1f') for o in others)} s")
    assert hung["outcome"] != "averaged" and hung["seconds"] < 20.0, hung  # not the 40 s allreduce_timeout
    assert all(o["outcome"] == "averaged" and o["failed_size"] > 0 for o in others), others
    assert others[0]["mean_sha"] == others[1]["mean_sha"] and others[0]["failed_size"] == others[1]["failed_size"]
    log = (tmp_path / "2.json.log").read_text()
    assert "(only this peer's own share is left): given up" in log and "reducer part 0/" in log, log[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_sender_whose_reducer_stream_broke_and_that_sends_no_more_is_banned_within_seconds(tmp_path):
    """A sender that stops sending with its streams left open (fault ``mute_sender``: what a killed node looked like
    under churn, BENCHMARKS.md 3r), and whose own reducer stream to the others failed: each of the two others bans it
    once it waited `BROKEN_SENDER_S` for its next part, not hivemind's ``sender_timeout`` (20 s here; every survivor
    of a churn run waited 30 s). The two average without it and agree."""
    from composer_diloco.outer.averaging import BROKEN_SENDER_S

    results = run_peer_trio(HERE / "mute_peer.py", tmp_path, timeout_s=200)
    others = results[:2]
    print(f"\nthe others' steps took {', '.join(format(o['seconds'], '.1f') for o in others)} s")
    assert all(o["outcome"] == "averaged" for o in others), others
    assert BROKEN_SENDER_S < 5.0 and all(o["seconds"] < 10.0 for o in others), others  # 20-21 s before: sender_timeout
    assert others[0]["mean_sha"] == others[1]["mean_sha"] and others[0]["failed_size"] == others[1]["failed_size"]
    for i in (0, 1):
        log = (tmp_path / f"{i}.json.log").read_text()
        assert "banned after 1 of" in log and "after its reducer stream broke" in log, log[-3000:]


def test_a_stream_to_a_peer_whose_every_address_refuses_is_unreachable_and_a_reset_is_not():
    """`unreachable` (the reducer's early ban of a sender it can no longer reach, BENCHMARKS.md 3q) on the errors this
    hivemind's daemon really raises: a stream opened to a peer that shut down after the two met (its addresses known,
    its port closed) fails with "failed to dial"; a reset stream is no proof."""
    import asyncio as _asyncio

    from composer_diloco.outer.averaging import unreachable
    from composer_diloco.outer.swarm import start_dht, visible_multiaddr

    here = start_dht(initial_peers=[])
    gone = start_dht(initial_peers=[visible_multiaddr(here)])
    gone_id = gone.peer_id
    gone.shutdown()

    async def open_stream() -> BaseException:
        p2p = await here.replicate_p2p()
        try:
            await p2p.call_binary_stream_handler(gone_id, "composer_diloco.test.nothing")
        except Exception as e:  # noqa: BLE001 - the error is the result
            return e
        raise AssertionError("a stream to a peer that shut down opened")

    try:
        error = _asyncio.run(open_stream())
        assert unreachable(error), repr(error)
        assert not unreachable(ConnectionResetError(104, "Connection reset by peer"))
    finally:
        here.shutdown()
