"""The outer optimizer chosen by the run config alone: its state's layout is fixed from round 0, it round-trips
through checkpoints and state sharing, and two real peers that average through hivemind end with the same bytes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from composer_diloco.checkpoint import CheckpointError, latest_checkpoint, restore_outer_state, save_checkpoint
from composer_diloco.config import ConfigError, load_config
from composer_diloco.outer.global_model import GlobalModel, make_factory, optimizer_factory

from tests_support import close_peers, end_peer_scenario, run_scenario_in_child

ADAM = """
rounds = 2
[outer]
optimizer = "adam"
lr = 0.01
kwargs = {{betas = [0.9, 0.95]}}
[network]
matchmaking_time_s = 1.0
averaging_timeout_s = 30.0
round_slack_s = 30.0
heartbeat_s = 1.0
heartbeat_ttl_s = 6.0
{extra}
"""


class Tiny(nn.Module):
    """A policy stand-in that `save_checkpoint` can save (no files: the test checks ``outer.pt``)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.randn(5, 3, generator=g))
        self.b = nn.Parameter(torch.randn(3, generator=g))

    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


class NoTokenizer:
    def save_pretrained(self, path: Path) -> None:
        pass


def adam_config(tmp_path: Path, extra: str = ""):
    path = tmp_path / "adam.toml"
    path.write_text(ADAM.format(extra=extra))
    return load_config(path)


def state_bytes(gm: GlobalModel) -> list[bytes]:
    return [t.detach().contiguous().numpy().tobytes() for t in gm.state()[1]]


def test_config_selects_the_optimizer_and_its_state_layout_is_fixed_from_round_0(tmp_path):
    config = adam_config(tmp_path)
    gm = GlobalModel(Tiny(), outer_optimizer=optimizer_factory(config.outer))
    assert isinstance(gm.optimizer, torch.optim.Adam) and gm.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    meta0, tensors0 = gm.state()
    assert [k[1] for k in meta0["keys"]] == ["exp_avg", "exp_avg_sq", "step"] * 2
    gm.outer_step([torch.ones(5, 3), torch.ones(3)])
    meta1, tensors1 = gm.state()
    assert meta1 == meta0 and [t.shape for t in tensors1] == [t.shape for t in tensors0]  # a joiner's layout


def test_materialised_state_steps_exactly_as_the_lazy_optimizer():
    factory = make_factory("nadam", lr=0.01)  # its lazy state is not all zeros (mu_product starts at 1)
    gm = GlobalModel(Tiny(), outer_optimizer=factory)
    params = [p.detach().clone().requires_grad_(True) for p in gm.params]
    lazy = factory(params)
    for step in range(3):
        delta = [torch.full_like(p, 0.1 * (step + 1)) for p in params]
        gm.outer_step([d.clone() for d in delta])
        for p, d in zip(params, delta):
            p.grad = d
        lazy.step()
    assert all(torch.equal(a, b) for a, b in zip(gm.params, params))


def test_state_sharing_round_trip_and_another_optimizer_is_refused(tmp_path):
    factory = optimizer_factory(adam_config(tmp_path).outer)
    a, b = GlobalModel(Tiny(0), outer_optimizer=factory), GlobalModel(Tiny(1), outer_optimizer=factory)
    a.outer_step([torch.ones(5, 3), torch.ones(3)])
    b.load_state(*a.state())
    assert state_bytes(a) == state_bytes(b)
    a.outer_step([torch.ones(5, 3), torch.ones(3)])
    b.outer_step([torch.ones(5, 3), torch.ones(3)])
    assert state_bytes(a) == state_bytes(b)  # exp_avg, exp_avg_sq and step came along
    sgd = GlobalModel(Tiny(0), lr=0.7, momentum=0.9)
    with pytest.raises(ValueError, match="another layout"):
        sgd.load_state(*a.state())


def test_checkpoint_round_trip_and_checkpoints_of_another_optimizer(tmp_path):
    config = adam_config(tmp_path)
    model = Tiny()
    gm = GlobalModel(model, outer_optimizer=optimizer_factory(config.outer))
    gm.outer_step([torch.ones(5, 3), torch.full((3,), -2.0)])
    save_checkpoint(tmp_path, 1, model, NoTokenizer(), gm, config.to_json())
    folder = latest_checkpoint(tmp_path)
    resumed = GlobalModel(model, outer_optimizer=optimizer_factory(config.outer))  # theta from the saved weights
    assert restore_outer_state(folder, resumed) == 1
    assert state_bytes(resumed) == state_bytes(gm)
    with pytest.raises(CheckpointError, match="its outer optimizer is torch.optim.adam.Adam, this run's is "
                                              "torch.optim.sgd.SGD") as e:
        restore_outer_state(folder, GlobalModel(model, lr=0.7, momentum=0.9))
    assert "\n" not in str(e.value)


def test_a_checkpoint_from_before_the_change_resumes_sgd_and_refuses_adam(tmp_path):
    model = Tiny()
    old = GlobalModel(model, lr=0.7, momentum=0.9)
    old.outer_step([torch.ones(5, 3), torch.ones(3)])
    model.load_state_dict({"a": old.params[0].detach(), "b": old.params[1].detach()})
    folder = tmp_path / "round-000001"
    folder.mkdir()
    buffers = [old.optimizer.state[p]["momentum_buffer"].clone() for p in old.params]
    torch.save({"round": 1, "names": old.names, "momentum": buffers, "global_sha256": old.sha256(), "config": "{}"},
               folder / "outer.pt")  # the layout outer.pt had before the outer optimizer was configurable
    resumed = GlobalModel(model, lr=0.7, momentum=0.9)
    assert restore_outer_state(folder, resumed) == 1
    assert state_bytes(resumed) == state_bytes(old)
    adam = GlobalModel(model, outer_optimizer=make_factory("adam", lr=0.01))
    with pytest.raises(CheckpointError, match="before the outer optimizer was configurable .* resumes only with "
                                              "outer.optimizer = 'sgd'"):
        restore_outer_state(folder, adam)


def test_bad_optimizer_names_and_arguments_are_one_line_config_errors(tmp_path):
    path = tmp_path / "bad.toml"
    for text, expected in [('optimizer = "adamm"\nlr = 0.1', "'adamm' is not a torch.optim.Optimizer"),
                           ('optimizer = "adam"', "lr must be set for optimizer 'adam'"),
                           ('optimizer = "adam"\nlr = 0.1\nmomentum = 0.9', "momentum and nesterov are SGD's"),
                           ('optimizer = "adam"\nlr = 0.1\nkwargs = {betaz = 1}', "unexpected keyword argument"),
                           ('optimizer = "lbfgs"\nlr = 0.1', "closure")]:
        path.write_text(f"[outer]\n{text}\n")
        with pytest.raises(ConfigError, match=expected) as e:
            load_config(path)
        assert "\n" not in str(e.value)
    path.write_text('[outer]\noptimizer = "torch.optim.AdamW"\nlr = 0.1\nkwargs = {weight_decay = 0.01}\n')
    assert optimizer_factory(load_config(path).outer)([torch.zeros(2, requires_grad=True)]).defaults["weight_decay"] \
        == 0.01


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_peers_average_with_adam_chosen_by_config_and_a_joiner_downloads_the_same_state(tmp_path):
    """Two nodes through the real DHT, barrier and `ExactAverager`, the outer optimizer Adam by config alone.

    The peers run in a child process: a process that held several hivemind averagers can abort at interpreter
    exit (torch's shared-memory manager, "Broken pipe"), which must not take pytest down with it.
    """
    r = run_scenario_in_child("test_outer_optimizer", "two_peers_scenario", tmp_path)
    assert "scenario passed" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])


def two_peers_scenario(tmp_path: Path) -> None:
    """The body of the test above, in its own process; prints "scenario passed" and leaves at once."""
    from composer_diloco.outer.peer import DiLoCoPeer
    from composer_diloco.outer.swarm import Swarm, start_dht, visible_multiaddr

    config = adam_config(tmp_path)
    weights = {"node-a": 1.0, "node-b": 3.0}
    dhts, peers = [], {}
    try:
        for name in [*weights, "node-c"]:
            dhts.append(start_dht(initial_peers=[visible_multiaddr(dhts[0])] if dhts else []))
            swarm = Swarm(dhts[-1], run_name=config.run_name, peer_name=name, role="node")
            peers[name] = DiLoCoPeer(Tiny(), config, swarm, holds_theta=name in weights)  # node-c: a skeleton
            if name in weights:
                swarm.set_round(0)
                swarm.start_heartbeat(config.network.heartbeat_s, config.network.heartbeat_ttl_s)
        reference = GlobalModel(Tiny(), outer_optimizer=optimizer_factory(config.outer))
        results: dict[str, list] = {name: [] for name in weights}

        def train_and_sync(name: str, r: int) -> None:
            model = Tiny()
            peers[name].global_model.load_into(model)
            with torch.no_grad():  # "inner steps": each node moves theta its own way
                model.a.add_(0.1 * (r + 1) * (1 if name == "node-a" else -2))
                model.b.mul_(1.0 + 0.05 * weights[name])
            results[name].append((peers[name].sync(model, weights[name]), model))

        for r in range(config.rounds):
            threads = [threading.Thread(target=train_and_sync, args=(n, r)) for n in weights]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            # the same round by hand: theta <- Adam(theta, sum_i w_i Delta_i / sum_i w_i)
            deltas = []
            for name, w in weights.items():
                local = Tiny()
                reference.load_into(local)
                with torch.no_grad():
                    local.a.add_(0.1 * (r + 1) * (1 if name == "node-a" else -2))
                    local.b.mul_(1.0 + 0.05 * w)
                deltas.append([w * (g - p.detach()) for g, p in zip(reference.params, local.parameters())])
            reference.outer_step([sum(d[i] for d in deltas) / sum(weights.values()) for i in range(2)])

        a, b = peers["node-a"], peers["node-b"]
        for r in range(config.rounds):
            ra, rb = results["node-a"][r][0], results["node-b"][r][0]
            assert (ra.status, rb.status, ra.peers, ra.weight_total) == ("averaged", "averaged", 2, 4.0), (ra, rb)
            assert ra.global_sha256 == rb.global_sha256
        assert state_bytes(a.global_model) == state_bytes(b.global_model)  # theta and Adam's state, bit for bit
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.global_model.params, reference.params))
        assert all(torch.equal(p.detach(), q) for p, q in zip(results["node-a"][-1][1].parameters(),
                                                              a.global_model.params))  # step 5: theta loaded
        # a late joiner downloads theta and the optimizer state (`state_transfer`): the same bytes. Before that, its
        # skeleton is not theta, and it refuses to serve it (a joiner once took a skeleton as round 0)
        c = peers["node-c"]
        c_id = c.swarm.dht.peer_id.to_base58()
        assert not a.transfer._run(a.transfer.fetch_manifest(c_id, 10.0)).serves
        assert c.load_state_from_peers(30.0) and c.round == config.rounds
        assert state_bytes(c.global_model) == state_bytes(a.global_model)
        assert c.last_download.bytes_moved == sum(len(b) for b in state_bytes(a.global_model))  # all of it differed
        served = a.transfer._run(a.transfer.fetch_manifest(c_id, 30.0))  # loaded, it serves theta
        assert served.serves and served.sha256 == a.global_model.sha256() and served.round == config.rounds
        # a checkpoint of that state resumes it exactly
        model = Tiny()
        save_checkpoint(tmp_path / "run", c.round, model, NoTokenizer(), c.global_model, config.to_json())
        resumed = GlobalModel(model, outer_optimizer=optimizer_factory(config.outer))
        assert restore_outer_state(latest_checkpoint(tmp_path / "run"), resumed) == config.rounds
        assert state_bytes(resumed) == state_bytes(a.global_model)
    finally:
        close_peers(peers.values(), dhts)
    end_peer_scenario()
