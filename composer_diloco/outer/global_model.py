"""The global model and the outer optimizer of DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1).

Paper symbols: theta^(t-1) is `GlobalModel.params` at the start of round t; each worker i runs H inner steps to
theta_i^(t); the pseudo-gradient is Delta_i = theta^(t-1) - theta_i^(t); the outer gradient is the weighted mean
Delta = sum_i w_i Delta_i / sum_i w_i; OuterOpt is SGD with Nesterov momentum (lr 0.7, momentum 0.9).

Everything here runs on CPU in fp32 with `foreach=False`, so peers that start from the same bytes and receive the
same Delta end with the same bytes (see `averaging.py` for how the Delta bytes are made identical).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn


class GlobalModel:
    """The canonical parameters theta and the outer optimizer state, held by every peer.

    Args:
        model: the policy; its trainable parameters define the layout (order of ``model.parameters()``).
        lr: outer learning rate (paper: 0.7).
        momentum: outer Nesterov momentum (paper: 0.9).
        nesterov: Nesterov (True, paper) or heavy-ball momentum; ignored at ``momentum == 0`` (plain SGD: with
            lr 1 that is parameter averaging), which torch's SGD refuses to combine with ``nesterov=True``.

    Attributes:
        params: list of fp32 CPU tensors, one per trainable parameter of ``model``.
        momentum: list of fp32 CPU tensors, the outer optimizer's momentum buffers (zeros at the start).
    """

    def __init__(self, model: nn.Module, *, lr: float, momentum: float, nesterov: bool = True):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p.detach().to("cpu", torch.float32).clone() for _, p in named]
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.SGD(
            self.params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0, foreach=False
        )
        # Materialise the momentum buffers now (zeros == torch's lazy first-step init) so that the state a
        # late joiner downloads always has the same layout.
        for p in self.params:
            self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, requires_grad=False)
        self._state_dict_order = _state_dict_order(model, self.names)

    @property
    def momentum(self) -> list[torch.Tensor]:
        return [self.optimizer.state[p]["momentum_buffer"] for p in self.params]

    def numel(self) -> int:
        """Number of trainable elements (parameters of the pseudo-gradient)."""
        return sum(p.numel() for p in self.params)

    def pseudo_gradient(self, model: nn.Module, out: Sequence[torch.Tensor]) -> None:
        """Write Delta_i = theta - theta_i (fp32, CPU) into ``out`` (same layout as ``params``)."""
        local = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for o, g, p in zip(out, self.params, local, strict=True):
                o.copy_(g)
                o.sub_(p.detach().to("cpu", torch.float32))

    @torch.no_grad()
    def outer_step(self, delta: Sequence[torch.Tensor]) -> None:
        """theta <- OuterOpt(theta, Delta): one SGD-Nesterov step with ``delta`` as the gradient.

        Args:
            delta: fp32 CPU tensors, the averaged pseudo-gradient, same shapes as ``params``.
        Raises:
            ValueError: a tensor of ``delta`` holds NaN or Inf (theta is left untouched).
        """
        for name, d in zip(self.names, delta, strict=True):
            if not torch.isfinite(d).all():
                raise ValueError(f"pseudo-gradient of {name!r} holds NaN or Inf; outer step refused")
        for p, d in zip(self.params, delta, strict=True):
            p.grad = d.detach().clone()
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def load_into(self, model: nn.Module) -> None:
        """Copy theta into ``model``'s parameters (cast to each parameter's dtype and device)."""
        local = [p for p in model.parameters() if p.requires_grad]
        for p, g in zip(local, self.params, strict=True):
            p.copy_(g.to(device=p.device, dtype=p.dtype))

    def state_tensors(self) -> list[torch.Tensor]:
        """theta followed by the momentum buffers: what a joining peer downloads."""
        return [*self.params, *self.momentum]

    @torch.no_grad()
    def load_state_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Inverse of `state_tensors`. Raises ValueError if the count or a shape does not match."""
        n = len(self.params)
        if len(tensors) != 2 * n:
            raise ValueError(f"expected {2 * n} state tensors (params + momentum), got {len(tensors)}")
        for dst, src in zip([*self.params, *self.momentum], tensors, strict=True):
            if dst.shape != src.shape:
                raise ValueError(f"state tensor shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
            dst.copy_(src.to(torch.float32))

    def sha256(self) -> str:
        """SHA-256 (hex) of theta: fp32 little-endian bytes of each trainable tensor in ``state_dict`` order
        (a tied tensor counts once, at its first key)."""
        h = hashlib.sha256()
        for i in self._state_dict_order:
            h.update(self.params[i].detach().contiguous().numpy().tobytes())
        return h.hexdigest()


def _state_dict_order(model: nn.Module, names: list[str]) -> list[int]:
    index = {n: i for i, n in enumerate(names)}
    by_id = {id(p): index[n] for n, p in model.named_parameters() if n in index}
    order: list[int] = []
    for value in model.state_dict(keep_vars=True).values():
        i = by_id.get(id(value))
        if i is not None and i not in order:
            order.append(i)
    order += [i for i in range(len(names)) if i not in order]
    return order
