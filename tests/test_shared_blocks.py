"""The ``shared-blocks`` codec (`composer_diloco.outer.shared_blocks`): the selection every member computes from the
gathered scores (deterministic, ties to the lower block, weights and screened-out members counted), pack/unpack,
the error-feedback rules, its state, its config and memory rows, and three real processes averaging through
`ExactAverager`'s butterfly to bit-identical means that hold only the kept blocks."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from composer_diloco.config import RunConfig
from composer_diloco.outer.codec_contract import build_codec
from composer_diloco.outer.codecs import CODECS
from composer_diloco.outer.shared_blocks import BlockFeedback, SharedBlocks, group_selection
from tests_support import run_peer_trio

HERE = Path(__file__).parent
SHAPES = [(1000,), (30, 10), (5,)]


def _codec(**kw) -> SharedBlocks:
    return SharedBlocks(SHAPES, **{"block_elems": 100, "density": 0.25, **kw})


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_layout_blocks_stay_within_tensors():
    c = _codec()
    assert [(b.tensor, b.start, b.length) for b in c.blocks][9:] == [(0, 900, 100), (1, 0, 100), (1, 100, 100),
                                                                     (1, 200, 100), (2, 0, 5)]
    assert len(c.blocks) == 10 + 3 + 1 and c.numel == 1305
    assert c.kept_blocks == 4  # ceil(0.25 * 14)
    assert sum(b.length for b in c.blocks) == c.numel
    assert all(b.start + b.length <= int(np.prod(SHAPES[b.tensor])) for b in c.blocks)


def test_selection_is_the_largest_weighted_scores_ties_to_the_lower_block():
    c = _codec()
    x = torch.zeros(c.numel)
    x[300:400] = 5.0  # block 3
    x[1000:1100] = 3.0  # block 10 (tensor 1's first)
    y = torch.zeros(c.numel)
    y[700:800] = 4.0  # block 7
    y[1300:1305] = 100.0  # block 13 (the 5-element tensor)
    sx, sy = c.score_bytes(x), c.score_bytes(y)
    assert list(c.select_blocks([sx, sy], [1.0, 1.0])) == [3, 7, 10, 13]
    # all-zero scores: ties everywhere, the lowest blocks win
    zero = c.score_bytes(torch.zeros(c.numel))
    assert list(c.select_blocks([zero], [1.0])) == [0, 1, 2, 3]
    # the weights count: one block kept, x's block 3 (sum of squares 2500) against y's block 7 (2025)
    one = _codec(density=0.01)
    x, y = torch.zeros(c.numel), torch.zeros(c.numel)
    x[300:400], y[700:800] = 5.0, 4.5  # scores in half octaves: 2^11.5 against 2^11
    assert list(one.select_blocks([one.score_bytes(x), one.score_bytes(y)], [1.0, 1.0])) == [3]
    assert list(one.select_blocks([one.score_bytes(x), one.score_bytes(y)], [1.0, 2.0])) == [7]
    assert list(one.select_blocks([one.score_bytes(y), one.score_bytes(x)], [2.0, 1.0])) == [7]  # order-free
    with pytest.raises(ValueError, match="14 blocks"):
        c.select_blocks([b"\x00" * 3], [1.0])


def test_group_selection_leaves_out_weight_zero_and_screened_members():
    c = _codec()
    a, b = torch.zeros(c.numel), torch.zeros(c.numel)
    a[0:100], b[500:600] = 9.0, 9.0
    meta = [{"weight": 0.0}, {"weight": 1.0, "scores": c.score_bytes(a)}, {"weight": 1.0, "scores": c.score_bytes(b)}]
    assert 0 in group_selection(c, meta, set()) and 5 in group_selection(c, meta, set())
    assert 5 not in group_selection(c, meta, {2})  # member 2 screened out: only member 1's scores count
    with pytest.raises(ValueError, match="no block scores"):
        group_selection(c, [{"weight": 1.0}], set())


def test_pack_unpack_round_trip_writes_zeros_outside_the_kept_blocks():
    c = _codec()
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in SHAPES]
    selected = torch.tensor([1, 10, 13])
    [packed] = c.pack_blocks(tensors, selected)
    assert packed.numel() == 100 + 100 + 5 == c.kept_elements(selected)
    flat = _flat(tensors)
    assert torch.equal(packed, flat[c.positions(selected)])
    out = [torch.full(s, 7.0) for s in SHAPES]
    c.unpack([packed], out, selected)
    expected = torch.zeros(c.numel)
    expected[c.positions(selected)] = flat[c.positions(selected)]
    assert torch.equal(_flat(out), expected)


def test_error_feedback_rules():
    c = _codec(values="fp32")
    ef = BlockFeedback(c)
    delta = [torch.ones(s) for s in SHAPES]
    prepared = ef.prepare_round(delta)
    assert prepared.message is None and len(prepared.gather["scores"]) == len(c.blocks)
    assert prepared.norm == pytest.approx(c.numel ** 0.5)
    meta = [{"weight": 1.0, "scores": prepared.gather["scores"]}]
    ef.observe(meta, set())
    assert ef.settle("averaged", rejected=False, contributed=True) == "sent"
    sel = group_selection(c, meta, set())
    e = ef.buffer
    assert float(e[c.positions(sel)].abs().sum()) == 0.0  # fp32 on the wire: sent exactly
    assert float(e.sum()) == c.numel - c.kept_elements(sel)
    # next round: x = e + delta, written over the buffers
    delta2 = [torch.ones(s) for s in SHAPES]
    ef.prepare_round(delta2)
    assert torch.equal(_flat(delta2), e + 1)
    assert ef.settle("resynced", rejected=False, contributed=True) == "kept"
    assert torch.equal(ef.buffer, e + 1)
    ef.prepare_round([torch.ones(s) for s in SHAPES])
    assert ef.settle("alone", rejected=False, contributed=True) == "applied" and float(ef.buffer.abs().sum()) == 0
    ef.prepare_round([torch.ones(s) for s in SHAPES])
    assert ef.settle("averaged", rejected=True, contributed=True) == "dropped" and float(ef.buffer.abs().sum()) == 0
    ef.prepare_round([torch.ones(s) for s in SHAPES])  # no group seen: nothing known sent
    assert ef.settle("averaged", rejected=False, contributed=True) == "kept"
    assert ef.settle("averaged", rejected=False, contributed=True) == "idle"


def test_fp16_wire_keeps_its_rounding_in_the_error_feedback():
    c = _codec()  # fp16
    ef = BlockFeedback(c)
    x = torch.full((c.numel,), 1.0 + 2 ** -13)  # not representable in fp16
    ef.prepare_round([x[:1000].view(1000), x[1000:1300].view(30, 10), x[1300:].clone()])
    meta = [{"weight": 1.0, "scores": c.score_bytes(x)}]
    ef.observe(meta, set())
    ef.settle("averaged", rejected=False, contributed=True)
    kept = ef.buffer[c.positions(group_selection(c, meta, set()))]
    assert torch.allclose(kept, torch.full_like(kept, 2 ** -13))


def test_state_dict_round_trip_and_refusals():
    c = _codec()
    ef = BlockFeedback(c)
    ef.prepare_round([torch.ones(s) for s in SHAPES])
    ef.settle("resynced", rejected=False, contributed=True)
    other = BlockFeedback(_codec())
    other.load_state_dict(ef.state_dict())
    assert torch.equal(other.buffer, ef.buffer)
    with pytest.raises(ValueError, match="block_elems"):
        BlockFeedback(_codec(block_elems=50)).load_state_dict(ef.state_dict())
    with pytest.raises(ValueError, match="decay"):
        BlockFeedback(c, decay=2.0)


def test_config_registry_and_memory_plan():
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config
    from composer_diloco.policy.memory_plan import plan_for_run

    built = build_codec(RunConfig(compression="shared-blocks", codec_options={"block_elems": 64}), [(1000,)])
    assert built.wire.block_elems == 64 and built.wire.transport == "butterfly" and built.node is not None
    with pytest.raises(ValueError, match="density"):
        RunConfig(compression="shared-blocks", codec_options={"density": 0})
    with pytest.raises(ValueError, match="takes none"):
        RunConfig(compression="fp16", codec_options={"density": 0.5})
    with pytest.raises(ValueError, match="'zstd' is not one of"):
        RunConfig(compression="zstd")
    # the registry's memory row is what the plan counts
    cfg = tiny_model_config(load_default_tokenizer(), 0)
    kw = dict(micro_batch=8, grad_accum=1, device="cuda:0", bf16=True, gradient_checkpointing=False, free=None)
    plain = plan_for_run(RunConfig(model="some/model"), cfg, **kw)
    blocks = plan_for_run(RunConfig(model="some/model", compression="shared-blocks"), cfg, **kw)
    assert blocks.host - plain.host == 4 * CODECS["shared-blocks"].local_state_tensors * plain.shape.params_trainable
    # every registered codec builds, and its entry's transport is its wire codec's
    for name, entry in CODECS.items():
        built = build_codec(RunConfig(compression=name), [(300,), (4, 4)])
        assert getattr(built.wire, "transport", "butterfly") == entry.transport, name
        assert (built.node is None) == (entry.local_state_tensors == 0), name


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_processes_average_the_shared_blocks_to_bit_identical_means(tmp_path):
    """Three real processes, two rounds: every peer ends each round with the same bytes, nonzero only in the blocks
    the weighted scores select, there the weighted mean of the three x_i (up to fp16), and each sends about
    2 (n - 1) / n of the kept values in fp16, not n messages."""
    sys.path.insert(0, str(HERE))
    import shared_blocks_peer as peer

    results = run_peer_trio(HERE / "shared_blocks_peer.py", tmp_path, timeout_s=100)
    c = peer.codec()
    for r in range(peer.ROUNDS):
        per_peer = [res[r] for res in results]
        assert {p["failed_size"] for p in per_peer} == {0}
        assert len({p["mean"] for p in per_peer}) == 1, f"round {r}: peers hold different means"
        order = per_peer[0]["order"]
        assert sorted(order) == [0, 1, 2]
        selected = c.select_blocks([bytes.fromhex(results[i][r]["scores"]) for i in order],
                                   [peer.WEIGHTS[i] for i in order])
        assert all(c.blocks[b].tensor == 0 and c.blocks[b].start >= 10_000 for b in selected.tolist())
        mean = torch.frombuffer(bytearray.fromhex(per_peer[0]["mean"]), dtype=torch.float32)
        xs = [torch.frombuffer(bytearray.fromhex(results[i][r]["x"]), dtype=torch.float32) for i in range(3)]
        expected = sum(w * x for w, x in zip(peer.WEIGHTS, xs)) / sum(peer.WEIGHTS)
        where = c.positions(selected)
        outside = torch.ones(c.numel, dtype=torch.bool)
        outside[where] = False
        assert float(mean[outside].abs().max()) == 0.0
        # fp16 on the way in and out: a relative error of 2^-11 each, of the largest contribution
        scale = torch.stack([x.abs() for x in xs]).max(0).values[where]
        assert bool(((mean[where] - expected[where]).abs() <= 2e-3 * scale + 1e-6).all())
        kept_bytes = 2 * c.kept_elements(selected)  # fp16
        assert all(p["rule"] == "sent" for p in per_peer)
        # butterfly: the group sends 2 (n - 1) x the kept fp16 values in all (+ framing; hivemind splits the vector
        # by bandwidth, so not evenly per peer), 1/48 of the 2 (n - 1) x theta in fp32 of a dense all-reduce
        # + each member's scores counted once for each other member: 3 x 2 x one byte a block
        total = sum(p["bytes_sent"] for p in per_peer) - 3 * 2 * len(c.blocks)
        assert 2 * 2 * kept_bytes <= total <= 2 * 2 * kept_bytes + 4096, (total, kept_bytes)
    # round 1's x_i carries round 0's residual
    x1 = torch.frombuffer(bytearray.fromhex(results[1][1]["x"]), dtype=torch.float32)
    assert not torch.equal(x1, _flat(peer.known_delta(1, 1)))
