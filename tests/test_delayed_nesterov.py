"""Delayed Nesterov (arXiv 2401.09135), the outer optimizer for stale pseudo-gradients: its limits are the optimizers
it generalises, it moves the momentum only every ``delay`` rounds, and it rides `GlobalModel`'s state sharing."""

from __future__ import annotations

import pytest
import torch

from composer_diloco.config import ConfigError, RunConfig, load_config
from composer_diloco.outer.delayed_nesterov import DelayedNesterov
from composer_diloco.outer.global_model import GlobalModel, make_factory, optimizer_factory

from test_outer_optimizer import Tiny, state_bytes

NAME = "composer_diloco.outer.delayed_nesterov.DelayedNesterov"


def run(factory, grads: list[float]) -> torch.Tensor:
    p = torch.zeros(3, requires_grad=True)
    opt = factory([p])
    for g in grads:
        p.grad = torch.full((3,), g)
        opt.step()
    return p.detach()


GRADS = [0.5, -0.25, 1.0, 0.75, -0.5, 0.125, 0.25, 1.5]


def test_delay_1_is_nesterov_sgd_and_momentum_0_is_sgd():
    nesterov = make_factory("sgd", lr=0.7, momentum=0.9, nesterov=True)
    assert torch.allclose(run(make_factory(NAME, lr=0.7, momentum=0.9, delay=1), GRADS), run(nesterov, GRADS),
                          atol=1e-6)
    sgd = make_factory("sgd", lr=1.0)
    assert torch.equal(run(make_factory(NAME, lr=1.0, momentum=0.0, delay=4), GRADS), run(sgd, GRADS))


def test_momentum_moves_only_every_delay_rounds_with_the_mean_of_their_pseudo_gradients():
    p = torch.zeros(1, requires_grad=True)
    opt = DelayedNesterov([p], lr=1.0, momentum=0.5, delay=2, c=0.5)
    trace = []
    for g in (1.0, 3.0, 2.0):
        p.grad = torch.tensor([g])
        opt.step()
        trace.append((p.item(), opt.state[p]["momentum_buffer"].item()))
    # round 1: plain step c * g = 0.5, momentum untouched; round 2: m = mean(1, 3) = 2, step 0.5 * 2 + 3 = 4;
    # round 3: plain step again, 0.5 * 2 = 1
    assert trace == [(-0.5, 0.0), (-4.5, 2.0), (-5.5, 2.0)]


def test_config_selects_it_and_a_joiner_takes_its_state_bit_for_bit(tmp_path):
    config = RunConfig.model_validate({"outer": {"optimizer": NAME, "lr": 0.8,
                                                 "kwargs": {"momentum": 0.5, "delay": 4}}})
    factory = optimizer_factory(config.outer)
    a, b = GlobalModel(Tiny(0), outer_optimizer=factory), GlobalModel(Tiny(1), outer_optimizer=factory)
    assert [k[1] for k in a.state()[0]["keys"]][:3] == ["accumulated", "momentum_buffer", "step"]
    for _ in range(3):
        a.outer_step([torch.ones(5, 3), torch.ones(3)])
    b.load_state(*a.state())
    for step in range(3):  # across the delay-th round, where the momentum moves
        a.outer_step([torch.full((5, 3), 0.1 * step), torch.ones(3)])
        b.outer_step([torch.full((5, 3), 0.1 * step), torch.ones(3)])
        assert state_bytes(a) == state_bytes(b)


@pytest.mark.parametrize("kwargs, bad", [({"momentum": 1.0}, "momentum=1.0"), ({"delay": 0}, "delay=0"),
                                         ({"delay": 2.5}, "delay=2.5"), ({"c": 2.0}, "c=2.0"),
                                         ({"betas": [0.9, 0.9]}, "unexpected keyword argument 'betas'")])
def test_bad_arguments_are_one_line_config_errors(kwargs, bad, tmp_path):
    """Refused when the config is read, without building the optimizer (a --model config is read without torch);
    the optimizer itself refuses the same values."""
    path = tmp_path / "c.toml"
    path.write_text(f'[outer]\noptimizer = "{NAME}"\nlr = 0.8\nkwargs = {{{", ".join(f"{k} = {v}" for k, v in kwargs.items())}}}\n')
    with pytest.raises(ConfigError, match=bad) as e:
        load_config(path)
    assert "\n" not in str(e.value)
    with pytest.raises((TypeError, ValueError), match=bad):
        DelayedNesterov([torch.zeros(2)], lr=0.8, **kwargs)
