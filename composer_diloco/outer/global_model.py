"""The global model and the outer optimizer of DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1).

Paper symbols: theta^(t-1) is `GlobalModel.params` at the start of round t; each worker i runs H inner steps to
theta_i^(t); the pseudo-gradient is Delta_i = theta^(t-1) - theta_i^(t); the outer gradient is the weighted mean
Delta = sum_i w_i Delta_i / sum_i w_i; theta^(t) = OuterOpt(theta^(t-1), Delta).

OuterOpt is any ``torch.optim.Optimizer`` built over theta by a factory (torchft's ``DiLoCo(outer_optimizer=...)``
takes one the same way): DiLoCo's SGD with Nesterov momentum (lr 0.7, momentum 0.9) by default, or whatever the
run config's ``[outer]`` names (`optimizer_factory`). Its state travels as the optimizer's own ``state_dict``:
in checkpoints (`GlobalModel.checkpoint_state`) as is, and to joining peers (`GlobalModel.state`) as the
tensors of that state, flattened in a fixed order, plus a small meta structure. The state is materialised at
construction with the values the optimizer would create lazily at its first step, so a joiner downloads the same
layout at round 0 as at round 100, and the first step computes exactly what the lazy optimizer would.

Everything here runs on CPU in fp32 with ``foreach=False``, so peers that start from the same bytes and receive the
same Delta end with the same bytes (see `averaging.py` for how the Delta bytes are made identical).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over theta: ``factory(params) -> torch.optim.Optimizer``."""

# a checkpoint written before the outer optimizer was configurable holds SGD's buffers under this key
_LEGACY_SGD_BUFFERS = "momentum"


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class ``name`` stands for.

    Args:
        name: a ``torch.optim`` class name, any case (``"sgd"``, ``"adam"``, ``"AdamW"``, ``"nadam"``), or a dotted
            path to a ``torch.optim.Optimizer`` subclass (``"torch.optim.Adam"``, ``"my_pkg.optim.Lion"``).
    Raises:
        ValueError: no such optimizer (one line, listing the torch.optim names).
    """
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"outer optimizer {name!r} cannot be imported: {e}") from None
    else:
        cls = _torch_optimizers().get(name.lower())
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"outer optimizer {name!r} is not a torch.optim.Optimizer (expected one of "
                         f"{', '.join(sorted(_torch_optimizers()))}, or a dotted path module.Class)")
    return cls


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    return {n.lower(): c for n, c in vars(torch.optim).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}


def make_factory(name: str, **kwargs: Any) -> OptimizerFactory:
    """A factory of optimizer ``name`` with keyword arguments ``kwargs`` (lists become tuples, e.g. ``betas``).

    ``foreach=False`` is added when the optimizer takes it and ``kwargs`` does not set it: the single-tensor path,
    whose bytes do not depend on how tensors are grouped.

    Raises:
        ValueError: an unknown optimizer (`optimizer_class`).
    """
    cls = optimizer_class(name)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    if "foreach" in inspect.signature(cls).parameters:
        kwargs.setdefault("foreach", False)
    return functools.partial(cls, **kwargs)


def nesterov_sgd(*, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> OptimizerFactory:
    """DiLoCo's OuterOpt: ``torch.optim.SGD`` with Nesterov momentum (paper: lr 0.7, momentum 0.9).

    ``nesterov`` is dropped at ``momentum == 0`` (plain SGD: with lr 1 that is parameter averaging), which torch's
    SGD refuses to combine with ``nesterov=True``.
    """
    return make_factory("sgd", lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


class OuterSection(Protocol):
    """What `optimizer_factory` reads of a run config's ``[outer]`` section (`composer_diloco.config.OuterOptimizer`,
    named here by its fields only, so that this module and the config do not import each other)."""

    optimizer: str
    lr: float | None
    momentum: float | None
    nesterov: bool | None
    kwargs: dict[str, Any]

    @property
    def is_sgd(self) -> bool: ...


def optimizer_factory(outer: OuterSection) -> OptimizerFactory:
    """The outer optimizer a run config's ``[outer]`` section selects (SGD's ``momentum``/``nesterov`` included).

    Raises:
        ValueError: an unknown optimizer name.
    """
    if outer.is_sgd:  # the config's momentum / nesterov are SGD's
        return make_factory(outer.optimizer, lr=outer.lr, momentum=outer.momentum,
                            nesterov=bool(outer.nesterov) and outer.momentum > 0, **outer.kwargs)
    return make_factory(outer.optimizer, lr=outer.lr, **outer.kwargs)


def check_factory(factory: OptimizerFactory) -> None:
    """Build the optimizer over one scratch tensor and take one step, so that bad arguments fail at config time.

    Raises:
        ValueError: the optimizer refused its arguments or cannot step without a closure (one line).
    """
    try:
        _initial_state(factory, torch.zeros(2))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"outer optimizer {_describe(factory)} cannot be used: {e}") from None


def state_tensors_per_parameter(factory: OptimizerFactory) -> int:
    """How many tensors of a parameter's size ``factory``'s optimizer keeps per parameter (SGD without momentum 0,
    SGD with momentum 1, Adam 2, `composer_diloco.outer.delayed_nesterov.DelayedNesterov` 2), counted on the state
    it creates at its first step over a scratch tensor (`_initial_state`); scalars such as Adam's step do not count.

    Raises:
        TypeError / ValueError / RuntimeError: the optimizer refused its arguments (see `check_factory`).
    """
    probe = torch.zeros(17)
    state = _initial_state(factory, probe)
    return sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.numel() == probe.numel())


class GlobalModel:
    """The canonical parameters theta and the outer optimizer state, held by every peer.

    Args:
        model: the policy; its trainable parameters define the layout (order of ``model.parameters()``).
        outer_optimizer: builds OuterOpt over theta (`optimizer_factory`, `make_factory`, `nesterov_sgd`, or any
            ``params -> torch.optim.Optimizer``); None = ``nesterov_sgd(lr, momentum, nesterov)``.
        lr, momentum, nesterov: shorthand for ``outer_optimizer=nesterov_sgd(...)`` (defaults 0.7, 0.9, True);
            only with ``outer_optimizer=None``.
        share_storage: theta *is* ``model``'s trainable parameters where they are fp32 on CPU (no copy; the outer
            step moves the model): for a peer that never trains ``model`` (the coordinator), whose model only ever
            holds theta. False (a node): theta is a copy, the policy trains away from it.

    Attributes:
        params: list of fp32 CPU tensors, one per trainable parameter of ``model``.
        optimizer: the outer ``torch.optim.Optimizer`` over ``params``, its state materialised (module docstring).

    Raises:
        ValueError: both ``outer_optimizer`` and the SGD shorthand; an optimizer that cannot step without a closure.
    """

    def __init__(self, model: nn.Module, *, outer_optimizer: OptimizerFactory | None = None,
                 lr: float | None = None, momentum: float | None = None, nesterov: bool = True,
                 share_storage: bool = False):
        if outer_optimizer is not None and (lr is not None or momentum is not None):
            raise ValueError("GlobalModel: pass outer_optimizer or the SGD shorthand (lr, momentum), not both")
        if outer_optimizer is None:
            outer_optimizer = nesterov_sgd(lr=0.7 if lr is None else lr, momentum=0.9 if momentum is None else momentum,
                                           nesterov=nesterov)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p.detach() if share_storage and p.device.type == "cpu" and p.dtype == torch.float32
                       else p.detach().to("cpu", torch.float32).clone() for _, p in named]
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = outer_optimizer(self.params)
        # Materialise the state the optimizer would create at its first step (e.g. SGD's zero momentum buffers,
        # Adam's step 0 and zero moments), so that the state a late joiner downloads always has the same layout.
        uniform: dict[tuple, dict[str, Any] | None] = {}  # by (ndim, dtype): `_uniform_initial_state`'s finding
        for p in self.params:
            key = (p.dim(), p.dtype)
            if key not in uniform:
                uniform[key] = _uniform_initial_state(outer_optimizer, p)
            template = uniform[key]
            self.optimizer.state[p] = _initial_state(outer_optimizer, p) if template is None else \
                _state_like(template, p)
        self._keys = [sorted(self.optimizer.state[p]) for p in self.params]  # state keys per parameter, fixed
        self._state_dict_order = _state_dict_order(model, self.names)
        self.version = 0  # +1 at every change of theta or the optimizer state (`composer_diloco.outer.state_transfer`)

    @property
    def optimizer_name(self) -> str:
        """Qualified class name of the outer optimizer (``torch.optim.sgd.SGD``)."""
        cls = type(self.optimizer)
        return f"{cls.__module__}.{cls.__qualname__}"

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
        """theta <- OuterOpt(theta, Delta): one optimizer step with ``delta`` as the gradient.

        Args:
            delta: fp32 CPU tensors, the averaged pseudo-gradient, same shapes as ``params``. They are the step's
                ``.grad`` themselves, not a copy (a copy of theta's size at 0.5-8B is 2-32 GB of host memory): the
                caller owns them and must not read them as Delta afterwards (an optimizer may write its gradient;
                torch's SGD and Adam do not).
        Raises:
            ValueError: a tensor of ``delta`` holds NaN or Inf (theta and the optimizer state are left untouched).
        """
        for name, d in zip(self.names, delta, strict=True):
            if not torch.isfinite(d).all():
                raise ValueError(f"pseudo-gradient of {name!r} holds NaN or Inf; outer step refused")
        for p, d in zip(self.params, delta, strict=True):
            p.grad = d.detach()
        self.version += 1
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def load_into(self, model: nn.Module) -> None:
        """Copy theta into ``model``'s parameters (cast to each parameter's dtype and device)."""
        local = [p for p in model.parameters() if p.requires_grad]
        for p, g in zip(local, self.params, strict=True):
            if p.data_ptr() != g.data_ptr():  # not already theta (`share_storage`)
                p.copy_(g.to(device=p.device, dtype=p.dtype))

    # -- state sharing (hivemind's state download) ----------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a joining peer downloads: ``(meta, tensors)``.

        Returns:
            meta: ``{"optimizer": qualified class name, "keys": [[param index, state key, is_tensor], ...],
                "scalars": [non-tensor state values, in ``keys`` order]}``.
            tensors: theta (fp32, the shapes of ``params``) followed by the optimizer's state tensors in ``keys``
                order (each its own shape and dtype). Live tensors: clone them before they leave the lock.
        """
        keys, scalars, tensors = [], [], list(self.params)
        for i, p in enumerate(self.params):
            for key in self._keys[i]:
                value = self.optimizer.state[p][key]
                is_tensor = isinstance(value, torch.Tensor)
                keys.append([i, key, is_tensor])
                (tensors if is_tensor else scalars).append(value)
        return {"optimizer": self.optimizer_name, "keys": keys, "scalars": scalars}, tensors

    def num_state_tensors(self) -> int:
        """Number of tensors `state` returns (fixed from construction on)."""
        return len(self.state()[1])

    @torch.no_grad()
    def load_state(self, meta: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        """Inverse of `state`: adopt a peer's theta and optimizer state.

        Raises:
            ValueError: another optimizer, other state keys, or a tensor count or shape that does not match.
        """
        ours = self.check_state_meta(meta)
        n_state = sum(1 for _, _, is_tensor in ours["keys"] if is_tensor)
        if len(tensors) != len(self.params) + n_state:
            raise ValueError(f"expected {len(self.params) + n_state} state tensors (params + optimizer state), "
                             f"got {len(tensors)}")
        for dst, src in zip(self.params, tensors, strict=False):
            if dst.shape != src.shape:
                raise ValueError(f"state tensor shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
        state_tensors, scalars = iter(tensors[len(self.params):]), iter(meta.get("scalars", []))
        values = {(i, key): next(state_tensors) if is_tensor else next(scalars) for i, key, is_tensor in ours["keys"]}
        self._check_optimizer_state(values)
        self.version += 1
        for dst, src in zip(self.params, tensors, strict=False):
            if dst.data_ptr() != src.data_ptr():  # a download written into theta in place needs no copy
                dst.copy_(src.to(torch.float32))
        self._load_optimizer_state(values)

    def check_state_meta(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Check a peer's `state` meta against ours (optimizer class and state keys); returns our meta.

        Raises:
            ValueError: another optimizer or other state keys: no download of that peer's state can fit.
        """
        ours, _ = self.state()
        if meta.get("optimizer") != ours["optimizer"] or [list(k) for k in meta.get("keys", [])] != ours["keys"]:
            raise ValueError(f"the peer's outer optimizer state ({meta.get('optimizer')}) has another layout than "
                             f"this peer's ({ours['optimizer']})")
        return ours

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors of `state` (theta, then the optimizer's state tensors)."""
        return self.state()[1]

    # -- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """Entries of a checkpoint's ``outer.pt``: ``outer_optimizer`` (the optimizer's own ``state_dict``) and
        ``outer_optimizer_class`` (its qualified class name).

        The state dict's tensors are the live state, not a copy (one copy per state tensor of theta's size would be
        2-32 GB at 0.5-8B): write them (``torch.save``) before the next outer step.
        """
        return {"outer_optimizer": self.optimizer.state_dict(), "outer_optimizer_class": self.optimizer_name}

    @torch.no_grad()
    def load_checkpoint_state(self, outer_pt: Mapping[str, Any]) -> None:
        """Adopt the optimizer state of a checkpoint's ``outer.pt`` (see `checkpoint_state`); the hyperparameters
        (lr ...) stay this run's. A checkpoint written before the outer optimizer was configurable holds SGD
        momentum buffers instead: they resume an SGD outer optimizer.

        Raises:
            ValueError: the checkpoint's optimizer is another class than this run's, or it holds no optimizer state.
        """
        saved = outer_pt.get("outer_optimizer")
        if saved is None and _LEGACY_SGD_BUFFERS in outer_pt:
            if not isinstance(self.optimizer, torch.optim.SGD):
                raise ValueError(f"it was written before the outer optimizer was configurable and holds SGD momentum "
                                 f"buffers: it resumes only with outer.optimizer = 'sgd' (this run's is "
                                 f"{self.optimizer_name})")
            buffers = outer_pt[_LEGACY_SGD_BUFFERS]
            saved = {"state": {i: {"momentum_buffer": b} for i, b in enumerate(buffers)
                               if "momentum_buffer" in self._keys[i]}}
        elif saved is None:
            raise ValueError("it holds no outer optimizer state")
        elif outer_pt.get("outer_optimizer_class", self.optimizer_name) != self.optimizer_name:
            raise ValueError(f"its outer optimizer is {outer_pt['outer_optimizer_class']}, this run's is "
                             f"{self.optimizer_name} (the state of one cannot resume the other)")
        state = saved["state"]
        values = {(i, key): state[i][key] for i in range(len(self.params)) for key in self._keys[i]
                  if key in state.get(i, {})}
        fresh = sorted({key for i in range(len(self.params)) for key in self._keys[i] if (i, key) not in values})
        if fresh:  # e.g. SGD resumed with momentum > 0 from a run without momentum
            log.warning("the checkpoint holds no outer optimizer state %s: starting it fresh", ", ".join(fresh))
        self._load_optimizer_state(values)

    def _check_optimizer_state(self, values: Mapping[tuple[int, str], Any]) -> None:
        """Raise ValueError if a state tensor of ``values`` has another number of elements than ours."""
        for (i, key), value in values.items():
            current = self.optimizer.state[self.params[i]][key]
            if isinstance(current, torch.Tensor) and (
                    not isinstance(value, torch.Tensor) or value.numel() != current.numel()):
                raise ValueError(f"outer optimizer state {key!r} of {self.names[i]!r} does not match: "
                                 f"{tuple(getattr(value, 'shape', ()))} for {tuple(current.shape)}")

    def _load_optimizer_state(self, values: Mapping[tuple[int, str], Any]) -> None:
        """Copy ``{(param index, key): value}`` into the optimizer state (checked first: all or nothing)."""
        self._check_optimizer_state(values)
        self.version += 1
        for (i, key), value in values.items():
            state = self.optimizer.state[self.params[i]]
            if isinstance(state[key], torch.Tensor):
                if state[key].data_ptr() != value.data_ptr():  # written in place by a download: nothing to copy
                    state[key].copy_(value.reshape(state[key].shape).to(state[key].dtype))
            else:
                state[key] = copy.deepcopy(value)

    def sha256(self) -> str:
        """SHA-256 (hex) of theta: fp32 little-endian bytes of each trainable tensor in ``state_dict`` order
        (a tied tensor counts once, at its first key)."""
        h = hashlib.sha256()
        for i in self._state_dict_order:
            h.update(_bytes_view(self.params[i]))
        return h.hexdigest()

    def tensor_sha256(self) -> list[str]:
        """SHA-256 (hex) of each tensor of `state` (theta, then the optimizer's state tensors), in that order: what
        two peers compare to tell which tensors differ (`composer_diloco.outer.state_transfer`). Hashes every byte
        of the state once (about 1.6 GB/s a core with SHA-NI: 4.5 s for Qwen3-0.6B's 7.2 GB of fp32 theta and
        Delayed Nesterov buffers); the caller holds whatever lock keeps the state still."""
        return [hashlib.sha256(_bytes_view(t)).hexdigest() for t in self.state()[1]]


class _FirstValues(dict):
    """A parameter's optimizer state that keeps a copy of the first value stored under each key."""

    def __init__(self, initial: Mapping[str, Any]):
        super().__init__(initial)
        self.first = {k: _copy(v) for k, v in initial.items()}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.first:
            self.first[key] = _copy(value)
        super().__setitem__(key, value)


def _initial_state(factory: OptimizerFactory, param: torch.Tensor) -> dict[str, Any]:
    """The state ``factory``'s optimizer holds for ``param`` right after creating it lazily at its first step.

    One step with a zero gradient on a scratch copy of ``param`` records each state value as it is first stored,
    before the update changes it in place (SGD stores its buffer after the update: clone(0) = zeros, as at init).
    Raises TypeError/ValueError/RuntimeError from the optimizer (e.g. a step that needs a closure).
    """
    scratch = param.detach().clone().requires_grad_(True)
    optimizer = factory([scratch])
    recorder = _FirstValues(optimizer.state.get(scratch, {}))
    optimizer.state[scratch] = recorder
    scratch.grad = torch.zeros_like(scratch)
    with torch.no_grad():
        optimizer.step()
    return recorder.first


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a buffer hashlib reads without a copy (a non-contiguous tensor is copied)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _uniform_initial_state(factory: OptimizerFactory, like: torch.Tensor) -> dict[str, Any] | None:
    """The initial state (`_initial_state`) of parameters like ``like`` (its number of dimensions and dtype) when it
    does not depend on a parameter's values or sizes: each value a tensor of the parameter's shape filled with one
    constant (SGD's and Delayed Nesterov's buffers, Adam's moments: zeros), or a value that is the same for any
    parameter (Adam's step). Found on two small probes of other values and sizes; None when anything differs
    between them (then each parameter's state is computed exactly, by `_initial_state`).

    Why: `_initial_state` steps the optimizer over a scratch copy of each parameter, holding several copies of it at
    once: for an 8B model's 2.5 GB embedding about 15 GB of host memory for a moment, and seconds per parameter.

    Returns:
        ``{key: ("full", fill value, dtype) | ("same", value)}``, or None.
    """
    g = torch.Generator().manual_seed(0)
    probes = [torch.randn((2,) * like.dim(), generator=g).to(like.dtype),
              (torch.randn((3,) * like.dim(), generator=g) * 3 + 1).to(like.dtype)]
    states = [_initial_state(factory, probe) for probe in probes]
    if set(states[0]) != set(states[1]):
        return None
    template: dict[str, Any] = {}
    for key in states[0]:
        a, b = states[0][key], states[1][key]
        if isinstance(a, torch.Tensor) and a.dim() > 0:  # parameter-sized: one constant, in both probes
            if not (isinstance(b, torch.Tensor) and a.shape == probes[0].shape and b.shape == probes[1].shape and
                    a.dtype == b.dtype and a.numel() and bool((a == a.reshape(-1)[0]).all()) and
                    bool((b == a.reshape(-1)[0]).all())):
                return None
            template[key] = ("full", a.reshape(-1)[0].item(), a.dtype)
        elif isinstance(a, torch.Tensor):  # a scalar tensor (a step count): the same for any parameter
            if not (isinstance(b, torch.Tensor) and b.dim() == 0 and a.dtype == b.dtype and torch.equal(a, b)):
                return None
            template[key] = ("same", a)
        else:
            if type(a) is not type(b) or a != b:
                return None
            template[key] = ("same", a)
    return template


def _state_like(template: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """A parameter's initial state from `_uniform_initial_state`'s template."""
    return {key: torch.full_like(param, value[1], dtype=value[2]) if value[0] == "full" else _copy(value[1])
            for key, value in template.items()}


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _describe(factory: OptimizerFactory) -> str:
    if isinstance(factory, functools.partial):
        args = ", ".join(f"{k}={v!r}" for k, v in factory.keywords.items())
        return f"{getattr(factory.func, '__name__', factory.func)}({args})"
    return repr(factory)


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
