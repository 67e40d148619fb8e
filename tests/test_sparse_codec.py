"""The ``sparse-2bit`` codec (`composer_diloco.outer.sparse`): round trip and exact sizes, error feedback carried
across rounds (and a test that fails without it), the settle rules (resync included), its state in checkpoints, and
three real processes averaging through `ExactAverager`'s all-gather to bit-identical means."""

import hashlib
import math
import struct
import sys
import types
from pathlib import Path

import pytest
import torch

from composer_diloco.checkpoint import (
    CheckpointError, load_codec_state, read_codec_state, save_checkpoint, save_codec_state,
)
from composer_diloco.config import RunConfig
from composer_diloco.outer.codec_contract import build_codec
from composer_diloco.outer.peer import DiLoCoPeer
from composer_diloco.outer.sparse import CodecError, ErrorFeedback, SparseCodec, weighted_mean
from tests_support import run_peer_trio

HERE = Path(__file__).parent
SHAPES = [(5000,), (64, 64), (7, 3)]


def _codec(**kw) -> SparseCodec:
    return SparseCodec(SHAPES, **{"topk_fraction": 1 / 64, "chunk_elems": 1024, **kw})


def _randn(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_layout_counts_chunks_and_k():
    c = _codec()
    # 5000 = 4 x 1024 + 904 (k 16, 16, 16, 16, 15); 4096 = 4 x 1024 (k 16 each); 21 (k 1)
    assert (c.numel, c.chunks, c.kept) == (5000 + 4096 + 21, 4 + 1 + 4 + 1, 4 * 16 + 15 + 4 * 16 + 1)
    assert c.dense_bytes() == 4 * c.numel


def test_round_trip_keeps_the_top_k_of_each_chunk_with_their_signs_and_exact_size():
    c = _codec()
    delta = _randn(0)
    message = c.encode(delta)
    positions, values = c.decode_sparse(message)
    assert positions.dtype == torch.int64 and values.dtype == torch.float32 and positions.shape == (c.kept,)
    flat = _flat(delta)
    expected = []
    for g in c.groups:
        for j in range(g.chunks):
            start = g.offset + j * g.length
            top = flat[start:start + g.length].abs().topk(g.k).indices + start
            expected.append(top.sort().values)
    assert torch.equal(positions, torch.cat(expected))  # the indices survive exactly
    assert torch.equal(torch.sign(values), torch.sign(flat[positions]))
    # exact size: header (2 + 1 + 8), 4 bf16 levels a chunk, 2 bits a value, b low bits + unary part an index
    magic, b, unary_bits = struct.unpack_from("<2sBQ", message)
    assert magic == b"S2"
    size = 11 + 8 * c.chunks + math.ceil(c.kept / 4) + math.ceil(c.kept * b / 8) + math.ceil(unary_bits / 8)
    assert len(message) == size <= c.max_message_bytes()
    # about 1 + b + 1 bits an index (Rice), far under fp32's 32 bits per element
    assert 4 * c.numel / len(message) > 100
    dense = c.decode(message)
    assert torch.equal(dense[positions], values) and int((dense != 0).sum()) <= c.kept


def test_values_on_four_bf16_levels_decode_exactly():
    """Kept values of magnitude 1 (fewer than half of a chunk's k) and 2, either sign: the 2-bit code splits them at
    the median magnitude (2), each code's level is the mean of equal values, so they decode bit for bit."""
    c = _codec()
    flat = torch.full((c.numel,), 1e-4)  # everything else is smaller than any kept entry
    g = torch.Generator().manual_seed(1)
    for grp in c.groups:
        for j in range(grp.chunks):
            start = grp.offset + j * grp.length
            where = torch.randperm(grp.length, generator=g)[:grp.k] + start
            magnitude = torch.full((grp.k,), 2.0)
            magnitude[:(grp.k - 1) // 2] = 1.0
            flat[where] = magnitude * (torch.randint(0, 2, (grp.k,), generator=g) * 2 - 1)
    decoded = c.decode(c.encode(flat))
    kept = flat.abs() > 1e-3
    assert torch.equal(decoded[kept], flat[kept]) and int((decoded != 0).sum()) == c.kept


def test_bad_messages_and_bad_parameters_raise_one_line():
    c = _codec()
    message = c.encode(_randn(2))
    for bad in (message[:5], message[:-1], message + b"\0", b"XX" + message[2:]):
        with pytest.raises(CodecError):
            c.decode(bad)
    with pytest.raises(ValueError, match="0.0"):
        SparseCodec(SHAPES, topk_fraction=0.0, chunk_elems=64)
    with pytest.raises(ValueError, match="chunk_elems 0"):
        SparseCodec(SHAPES, topk_fraction=0.5, chunk_elems=0)
    with pytest.raises(ValueError, match="9117"):
        c.encode([torch.zeros(3)])
    with pytest.raises(ValueError, match="1.5"):
        ErrorFeedback(c, decay=1.5)
    with pytest.raises(ValueError, match="sparse-2bit"):
        RunConfig.model_validate({"compression": "int8", "sparse_codec": {}})
    with pytest.raises(ValueError, match="topk_fraction"):
        RunConfig.model_validate({"compression": "sparse-2bit", "sparse_codec": {"topk_fraction": 2}})


def test_weighted_mean_is_the_weighted_mean_of_the_decoded_messages():
    c = _codec()
    messages = [c.encode(_randn(s)) for s in (3, 4, 5)]
    mean = weighted_mean(c, messages, [1.0, 2.0, 3.0])
    dense = torch.stack([c.decode(m) for m in messages]).double()
    expected = (dense * torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)).sum(0) / 6
    assert mean.dtype == torch.float32 and torch.allclose(mean.double(), expected, atol=1e-6)
    again = weighted_mean(c, messages, [1.0, 2.0, 3.0])
    assert mean.numpy().tobytes() == again.numpy().tobytes()
    with pytest.raises(ValueError):
        weighted_mean(c, messages, [1.0, 0.0, 3.0])


def test_error_feedback_sends_the_residual_in_later_rounds():
    """One pseudo-gradient, then zeros: what round 0 did not send goes out in later rounds, so the decoded messages
    add up to the pseudo-gradient; and at every round sum(decoded) + e == sum(inputs) (nothing lost)."""
    c = _codec()
    ef = ErrorFeedback(c)
    delta = _randn(6)
    flat = _flat(delta)
    sent = torch.zeros(c.numel)
    errors = []
    for r in range(120):
        message, norm = ef.prepare(delta if r == 0 else [torch.zeros(s) for s in SHAPES])
        decoded = c.decode(message)
        assert norm == pytest.approx(float(decoded.double().norm()), rel=1e-6)
        assert ef.settle("averaged", rejected=False, contributed=True) == "sent"
        sent += decoded
        assert torch.allclose(sent + ef.buffer, flat, atol=1e-5)
        errors.append(float((flat - sent).norm() / flat.norm()))
    assert errors[0] > 0.8  # one message carries 1/64 of the entries
    assert errors[-1] < 1e-3  # ... the rest followed


def test_dropping_error_feedback_would_fail_this_test():
    """The same pseudo-gradient every round for 64 rounds: with error feedback the sum of what was sent tracks the
    sum of the inputs; with the residual thrown away each round (what a codec without error feedback does) it stays
    ~93% off, since every round sends the same top 1/64."""
    c = _codec()
    delta = _randn(7)
    target = 64 * _flat(delta)
    results = {}
    for keep in (True, False):
        ef = ErrorFeedback(c)
        sent = torch.zeros(c.numel)
        for _ in range(64):
            message, _ = ef.prepare(delta)
            sent += c.decode(message)
            ef.settle("averaged", rejected=False, contributed=True)
            if not keep:
                ef.buffer.zero_()
        results[keep] = float((target - sent).norm() / target.norm())
    assert results[True] < 0.5 and results[False] > 0.9, results


def test_settle_rules_including_resync():
    c = _codec()
    ef = ErrorFeedback(c)
    assert ef.settle("averaged", rejected=False, contributed=True) == "idle"  # nothing prepared
    d0, d1 = _randn(8), _randn(9)
    message, _ = ef.prepare(d0)
    ef.settle("averaged", rejected=False, contributed=True)
    e0 = ef.buffer.clone()
    assert torch.equal(e0, _flat(d0) - c.decode(message))
    # a resync after the node had prepared (the round failed, it took a peer's theta): the message counts as not
    # delivered, so e <- e + Delta and it goes out later
    ef.prepare(d1)
    assert ef.settle("resynced", rejected=False, contributed=True) == "kept"
    assert torch.equal(ef.buffer, e0 + _flat(d1))
    e1 = ef.buffer.clone()
    ef.prepare(d1)
    assert ef.settle("alone", rejected=False, contributed=True) == "applied"  # theta took Delta whole
    assert torch.equal(ef.buffer, e1)
    ef.prepare(d1)
    assert ef.settle("averaged", rejected=True, contributed=True) == "dropped"
    assert not ef.buffer.any()
    ef.prepare(d1)
    assert ef.settle("skipped", rejected=False, contributed=True) == "kept"


def test_peer_sync_settles_a_resync_without_touching_the_buffer_it_did_not_use():
    """`DiLoCoPeer.sync` hands the round's status to the error feedback: a heal (the node took the run's theta
    before its pseudo-gradient step) leaves e as it was; an averaged round applies the "sent" rule."""
    c = _codec()
    ef = ErrorFeedback(c)
    ef.prepare(_randn(10))
    ef.settle("averaged", rejected=False, contributed=True)
    before = ef.buffer.clone()
    result = types.SimpleNamespace(status="resynced", rejected=[], round=3)
    stub = types.SimpleNamespace(_sync=lambda model, weight, stop: result, error_feedback=ef,
                                 swarm=types.SimpleNamespace(name="node-0"))
    stub._settle_feedback = types.MethodType(DiLoCoPeer._settle_feedback, stub)  # the real rule, shared with overlap
    assert DiLoCoPeer.sync(stub, object(), 4.0) is result
    assert torch.equal(ef.buffer, before)
    message, _ = ef.prepare(_randn(11))
    result.status = "averaged"
    DiLoCoPeer.sync(stub, object(), 4.0)
    assert torch.equal(ef.buffer, before + _flat(_randn(11)) - c.decode(message))


def test_state_round_trips_through_a_checkpoint_and_the_node_file(tmp_path):
    c = _codec()
    ef = ErrorFeedback(c, decay=0.9)
    ef.prepare(_randn(12))
    ef.settle("averaged", rejected=False, contributed=True)
    state = ef.state_dict()
    # a node's own file
    path = tmp_path / "node-0" / "codec_state.pt"
    save_codec_state(path, state, 5, "digest-a")
    round_, loaded = load_codec_state(path, "digest-a")
    restored = ErrorFeedback(c, decay=0.9)
    restored.load_state_dict(loaded)
    assert round_ == 5 and torch.equal(restored.buffer, ef.buffer)
    # both carry on identically
    d = _randn(13)
    assert restored.prepare(d)[0] == ef.prepare(d)[0]
    with pytest.raises(CheckpointError, match="digest-b"):
        load_codec_state(path, "digest-b")
    assert load_codec_state(tmp_path / "none.pt", "digest-a") is None
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(c, decay=1.0).load_state_dict(state)
    with pytest.raises(ValueError, match="chunk_elems"):
        ErrorFeedback(_codec(chunk_elems=512), decay=0.9).load_state_dict(state)


def test_checkpoint_outer_pt_holds_the_codec_state(tmp_path):
    from torch import nn

    from composer_diloco.outer.global_model import GlobalModel

    model = nn.Linear(4, 3)
    gm = GlobalModel(model)
    ef = build_codec(RunConfig.model_validate({"compression": "sparse-2bit"}), [p.shape for p in gm.params]).node
    ef.prepare([torch.ones(p.shape) for p in gm.params])
    ef.settle("averaged", rejected=False, contributed=True)
    tokenizer = types.SimpleNamespace(save_pretrained=lambda folder: None)
    model.save_pretrained = lambda folder: Path(folder).mkdir(parents=True, exist_ok=True)
    folder = save_checkpoint(tmp_path, 2, model, tokenizer, gm, "{}", codec_state=ef.state_dict())
    state = read_codec_state(folder)
    assert torch.equal(state["buffer"], ef.buffer)
    plain = save_checkpoint(tmp_path, 3, model, tokenizer, gm, "{}")
    assert read_codec_state(plain) is None


def test_default_config_is_untouched():
    config = RunConfig()
    assert config.compression == "none" and config.sparse_codec is None
    assert "sparse_codec" not in config.to_json()
    assert build_codec(config, [(3,)]).node is None and build_codec(config, [(3,)]).wire is None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_processes_average_to_bit_identical_means(tmp_path):
    """Three real processes, two rounds of error feedback + all-gather through `ExactAverager`: every peer ends each
    round with the same bytes, and they are the bytes of `weighted_mean` over the three messages in group order."""
    sys.path.insert(0, str(HERE))
    import sparse_peer

    results = run_peer_trio(HERE / "sparse_peer.py", tmp_path, timeout_s=100)
    codec = sparse_peer.codec()
    for r in range(sparse_peer.ROUNDS):
        per_peer = [res[r] for res in results]
        assert {p["failed_size"] for p in per_peer} == {0}
        assert len({p["mean_sha"] for p in per_peer}) == 1, f"round {r}: peers hold different means"
        order = per_peer[0]["order"]
        assert sorted(order) == [0, 1, 2] and all(p["order"] == order for p in per_peer)
        messages = [bytes.fromhex(results[i][r]["message"]) for i in order]
        expected = weighted_mean(codec, messages, [sparse_peer.WEIGHTS[i] for i in order])
        assert hashlib.sha256(expected.numpy().tobytes()).hexdigest() == per_peer[0]["mean_sha"]
        # each peer sends its message to the two others: 2 x (message + a few bytes of framing)
        for i, p in enumerate(per_peer):
            size = len(bytes.fromhex(p["message"]))
            assert 2 * size <= p["bytes_sent"] <= 2 * size + 64, (i, p["bytes_sent"], size)
            assert p["rule"] == "sent"
    # round 1's messages carry round 0's residual: a peer's round-1 message differs from a fresh encode of its delta
    fresh = codec.encode(sparse_peer.known_delta(1, 1))
    assert bytes.fromhex(results[1][1]["message"]) != fresh


def test_memory_plan_counts_the_error_feedback():
    """A node with the sparse codec holds two more theta-sized fp32 tensors in host RAM: e and its next value."""
    from composer_diloco.config import load_config
    from composer_diloco.policy import load_default_tokenizer, tiny_model_config
    from composer_diloco.policy.memory_plan import plan_for_run

    cfg = tiny_model_config(load_default_tokenizer(), 0)
    kw = dict(micro_batch=8, grad_accum=1, device="cuda:0", bf16=True, gradient_checkpointing=False, free=None)
    plain = plan_for_run(load_config(None, model="some/model"), cfg, **kw)
    sparse = plan_for_run(RunConfig.model_validate({"model": "some/model", "compression": "sparse-2bit"}), cfg, **kw)
    assert sparse.host - plain.host == 8 * plain.shape.params_trainable


@pytest.mark.parametrize("whole", [True, False])
def test_all_gather_does_not_wait_for_a_sender_whose_connection_closed(whole):
    """hivemind cancels a handler whose sender's connection closed. A message whose bytes all came still counts; a
    message cut half-way is missing; either way the gather ends at once instead of waiting out the averaging
    timeout."""
    import asyncio

    from hivemind.proto import averaging_pb2, runtime_pb2

    from composer_diloco.outer.averaging import SparseGatherRunner

    c = _codec()
    message = c.encode(_randn(14))
    sent = message if whole else message[:len(message) // 2]

    async def scenario():
        runner = SparseGatherRunner(p2p=types.SimpleNamespace(peer_id="me"), servicer_type=None, prefix=None,
                                    group_id=b"g", ordered_peer_ids=["me", "them"], codec=c, contributors={1: 2.0},
                                    message=None, bytes_sent=None, sender_timeout=30.0)

        async def stream():
            part = runtime_pb2.Tensor(buffer=sent, size=[len(message)], dtype="uint8")
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g", tensor_part=part)
            await asyncio.sleep(3600)  # no end of stream: the connection is gone

        async def handle():
            async for _ in runner.rpc_aggregate_part(stream(), types.SimpleNamespace(remote_id="them")):
                pass

        gather = asyncio.create_task(runner.run())
        handler = asyncio.create_task(handle())
        await asyncio.sleep(0.2)
        handler.cancel()
        return await asyncio.wait_for(gather, 5.0)

    mean, missing = asyncio.run(scenario())
    if whole:
        assert missing == [] and torch.equal(mean, weighted_mean(c, [message], [2.0]))
    else:
        assert missing == [1] and mean is None
