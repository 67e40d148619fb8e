"""The outer step against a hand computation of DiLoCo's weighted mean and Nesterov update."""

import torch
from torch import nn

from composer_diloco.outer.global_model import GlobalModel


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
        self.b = nn.Parameter(torch.tensor([[0.25, 4.0]]))


def hand_nesterov(theta, grads, lr, mu):
    """theta_{t+1} = theta_t - lr * (g_t + mu * v_t), v_t = mu * v_{t-1} + g_t (PyTorch SGD, dampening 0)."""
    v = torch.zeros_like(theta)
    for g in grads:
        v = mu * v + g
        theta = theta - lr * (g + mu * v)
    return theta


def test_weighted_mean_then_two_nesterov_steps():
    model = Tiny()
    gm = GlobalModel(model, lr=0.7, momentum=0.9)
    # three peers' pseudo-gradients with weights 0 (coordinator), 1 and 3, for two rounds
    weights = [0.0, 1.0, 3.0]
    rounds = [
        [torch.tensor([9.0, 9.0, 9.0, 9.0, 9.0]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]),
         torch.tensor([-1.0, 0.0, 1.0, 2.0, 3.0])],
        [torch.zeros(5), torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5]), torch.tensor([2.0, -2.0, 0.0, 1.0, 1.0])],
    ]
    means = [sum(w * d for w, d in zip(weights, deltas)) / sum(weights) for deltas in rounds]
    assert torch.allclose(means[0], torch.tensor([-0.5, 0.5, 1.5, 2.5, 3.5]))
    for mean in means:
        gm.outer_step([mean[:3], mean[3:].reshape(1, 2)])
    theta0 = torch.tensor([1.0, -2.0, 0.5, 0.25, 4.0])
    expected = hand_nesterov(theta0, means, 0.7, 0.9)
    got = torch.cat([gm.params[0], gm.params[1].flatten()])
    assert torch.allclose(got, expected, atol=1e-6), (got, expected)
    gm.load_into(model)
    assert torch.equal(model.a.detach(), gm.params[0].detach())


def test_lr_one_without_momentum_is_parameter_averaging():
    """The embedded default's outer step (lr 1, momentum 0, nesterov left on): theta <- theta - mean(theta - theta_i),
    i.e. the mean of the nodes' models; torch's SGD alone would refuse nesterov without momentum."""
    model = Tiny()
    gm = GlobalModel(model, lr=1.0, momentum=0.0, nesterov=True)
    theta = torch.tensor([1.0, -2.0, 0.5, 0.25, 4.0])
    locals_ = [theta + torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5]), theta + torch.tensor([-3.0, 2.0, 1.0, 0.0, 0.5])]
    mean_delta = sum(theta - local for local in locals_) / 2
    gm.outer_step([mean_delta[:3], mean_delta[3:].reshape(1, 2)])
    averaged = sum(locals_) / 2
    assert torch.allclose(torch.cat([gm.params[0], gm.params[1].flatten()]), averaged, atol=1e-6)
    gm.outer_step([mean_delta[:3], mean_delta[3:].reshape(1, 2)])  # no momentum carries over into round 2
    assert torch.allclose(torch.cat([gm.params[0], gm.params[1].flatten()]), averaged - mean_delta, atol=1e-6)


def test_pseudo_gradient_is_global_minus_local():
    model = Tiny()
    gm = GlobalModel(model, lr=0.7, momentum=0.9)
    with torch.no_grad():
        model.a.add_(1.0)
    out = [torch.empty(3), torch.empty(1, 2)]
    gm.pseudo_gradient(model, out)
    assert torch.equal(out[0], torch.full((3,), -1.0)) and torch.equal(out[1], torch.zeros(1, 2))


def test_nan_pseudo_gradient_refused_and_theta_kept():
    gm = GlobalModel(Tiny(), lr=0.7, momentum=0.9)
    before = gm.sha256()
    bad = [torch.tensor([1.0, float("nan"), 0.0]), torch.zeros(1, 2)]
    try:
        gm.outer_step(bad)
    except ValueError as e:
        assert "'a'" in str(e)
    else:
        raise AssertionError("NaN pseudo-gradient was applied")
    assert gm.sha256() == before


def test_state_roundtrip_and_sha():
    a, b = GlobalModel(Tiny(), lr=0.7, momentum=0.9), GlobalModel(Tiny(), lr=0.7, momentum=0.9)
    a.outer_step([torch.ones(3), torch.ones(1, 2)])
    assert a.sha256() != b.sha256()
    b.load_state(*a.state())
    assert a.sha256() == b.sha256()
    a.outer_step([torch.ones(3), torch.ones(1, 2)])
    b.outer_step([torch.ones(3), torch.ones(1, 2)])
    assert a.sha256() == b.sha256()  # the momentum came along too


def test_default_outer_step_is_the_same_torch_sgd_bit_for_bit():
    """The default path is the one the README's numbers were made with: torch's SGD, foreach=False, its momentum
    buffers materialised as zeros before the first step (signed zeros included)."""
    for lr, mu in [(0.7, 0.9), (1.0, 0.0)]:
        gm = GlobalModel(Tiny(), lr=lr, momentum=mu)
        params = [p.detach().clone().requires_grad_(True) for p in gm.params]
        sgd = torch.optim.SGD(params, lr=lr, momentum=mu, nesterov=mu > 0, foreach=False)
        for p in params:
            sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
        g = torch.Generator().manual_seed(0)
        for step in range(4):
            delta = [torch.randn(p.shape, generator=g) for p in params]
            delta[0][0] = -0.0 if step % 2 else 0.0
            gm.outer_step([d.clone() for d in delta])
            for p, d in zip(params, delta):
                p.grad = d
            sgd.step()
            assert [p.detach().numpy().tobytes() for p in params] == [p.detach().numpy().tobytes() for p in gm.params]
