"""Delayed Nesterov: an outer optimizer whose momentum moves only every ``delay`` rounds.

Liu et al., "Asynchronous Local-SGD Training for Language Modeling" (arXiv 2401.09135), find that outer Nesterov
momentum applied to every (stale) pseudo-gradient is what hurts, and propose Delayed Nesterov: the pseudo-gradients
of ``delay`` outer steps are summed in a buffer, the momentum is updated once from their mean, and in between theta
moves by the plain (scaled) pseudo-gradient. Per parameter, with g_t the round's averaged pseudo-gradient::

    a <- a + g_t
    if t % delay == 0:   m <- momentum * m + a / delay;   theta <- theta - lr * (momentum * m + g_t);   a <- 0
    else:                                                 theta <- theta - lr * c * g_t

At ``momentum = 0`` and ``c = 1`` this is SGD (with lr 1: parameter averaging); at ``delay = 1`` and ``c = 1`` it is
torch's Nesterov SGD. This is our reading of the paper's algorithm, written for `GlobalModel`'s outer step: select it
with ``[outer] optimizer = "composer_diloco.outer.delayed_nesterov.DelayedNesterov"``, ``lr = ...`` and
``kwargs = {momentum = 0.5, delay = 4}``. Its state (the momentum and the sum, fp32 like theta, and the step count)
is checkpointed and shared with late joiners as any optimizer's is; every update is elementwise in a fixed order, so
peers that step on the same averaged pseudo-gradient hold the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from composer_diloco.outer.outer_choice import check_delayed_nesterov


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov momentum (arXiv 2401.09135) as a ``torch.optim.Optimizer`` (module docstring for the rule).

    Args:
        params: theta's tensors (fp32).
        lr: outer learning rate (> 0).
        momentum: the momentum's decay in [0, 1).
        delay: rounds between momentum updates (>= 1).
        c: scale of the plain step taken between them, in [0, 1].
    Raises:
        ValueError: an argument out of its range (one line naming it).
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.9, delay: int = 4,
                 c: float = 1.0):
        check_delayed_nesterov(lr, momentum, delay, c)
        super().__init__(params, dict(lr=lr, momentum=momentum, delay=int(delay), c=c))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        """One outer step with each parameter's ``.grad`` as its pseudo-gradient. Raises ValueError with a closure."""
        if closure is not None:
            raise ValueError("DelayedNesterov takes no closure")
        for group in self.param_groups:
            lr, momentum, delay, c = group["lr"], group["momentum"], group["delay"], group["c"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["accumulated"] = torch.zeros_like(p)
                g, m, a = p.grad, state["momentum_buffer"], state["accumulated"]
                state["step"] += 1
                a.add_(g)
                if int(state["step"].item()) % delay == 0:
                    m.mul_(momentum).add_(a, alpha=1.0 / delay)
                    p.add_(m, alpha=-lr * momentum)
                    p.add_(g, alpha=-lr)
                    a.zero_()
                else:
                    p.add_(g, alpha=-lr * c)
        return None


__all__ = ["DelayedNesterov"]
