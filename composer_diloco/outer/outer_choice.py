"""Which outer optimizer a run gets, and whether its arguments hold, decided without torch.

The config (`composer_diloco.config.OuterOptimizer`) holds the ``[outer]`` section's shape; what its values mean
lives here, beside where the optimizer is built (`composer_diloco.outer.global_model.optimizer_factory`):

- the defaults by policy: the embedded default averages (SGD lr 1.0, momentum 0.0), a ``--model`` run whose
  ``[outer]`` chooses nothing gets `DELAYED_NESTEROV_DEFAULT` (why: BENCHMARKS.md, the summary row "Which outer
  optimizer for RL?" and section 1d), and SGD's unset values are DiLoCo's (`sgd_defaults`);
- the check at load time (`check_outer`): SGD's fields need none (pydantic bounds them), Delayed Nesterov's arguments
  are checked here without torch (`check_delayed_nesterov`: reading the default config of every ``--model`` run
  imports no torch), any other optimizer is built once (`global_model.check_factory`).
"""

from __future__ import annotations

import copy
from typing import Any

SGD_NAMES = ("sgd", "torch.optim.sgd")
OUTER_CHOICES = ("optimizer", "lr", "momentum", "nesterov", "kwargs")  # the [outer] fields that choose the optimizer
DELAYED_NESTEROV = "composer_diloco.outer.delayed_nesterov.DelayedNesterov"
# DiLoCo's lr 0.7 and Nesterov momentum 0.9, the momentum moved every 4 rounds (arXiv 2401.09135): BENCHMARKS.md 1d
DELAYED_NESTEROV_DEFAULT = {"optimizer": DELAYED_NESTEROV, "lr": 0.7, "kwargs": {"momentum": 0.9, "delay": 4}}
DILOCO_SGD = {"lr": 0.7, "momentum": 0.9, "nesterov": True}  # DiLoCo's outer SGD (arXiv 2311.08105)
EMBEDDED_SGD = {"lr": 1.0, "momentum": 0.0}  # parameter averaging: BENCHMARKS.md 1a and 1d


def is_sgd(optimizer: str) -> bool:
    """True for torch's SGD (the optimizer ``momentum`` and ``nesterov`` belong to), any case."""
    return str(optimizer).lower() in SGD_NAMES


def sgd_defaults(section: dict[str, Any]) -> dict[str, Any]:
    """An SGD ``[outer]`` section (a dict) with its unset ``lr`` / ``momentum`` / ``nesterov`` set to DiLoCo's."""
    return {**DILOCO_SGD, **{k: v for k, v in section.items() if v is not None}}


def policy_defaults(outer: dict[str, Any], *, has_model: bool) -> dict[str, Any]:
    """The ``[outer]`` section (a dict of what the user set) after the defaults of the run's policy: a ``--model``
    run that chose nothing (none of `OUTER_CHOICES`) gets `DELAYED_NESTEROV_DEFAULT`; an embedded-default run's unset
    SGD ``lr`` / ``momentum`` become 1.0 / 0.0. Anything set is kept."""
    given = {k: v for k, v in outer.items() if v is not None}
    if has_model:
        if any(given.get(k) not in (None, {}) for k in OUTER_CHOICES):
            return outer
        return {**given, **copy.deepcopy(DELAYED_NESTEROV_DEFAULT)}
    if not is_sgd(outer.get("optimizer", "sgd")):
        return outer
    return {**EMBEDDED_SGD, **given}


def check_delayed_nesterov(lr: float, momentum: float = 0.9, delay: int = 4, c: float = 1.0) -> None:
    """The argument check of `composer_diloco.outer.delayed_nesterov.DelayedNesterov` (its arguments are documented
    there), free of torch.

    Raises:
        ValueError: an argument out of its range, in one line naming it and what was expected.
    """
    if not lr > 0:
        raise ValueError(f"DelayedNesterov: lr={lr} (expected > 0)")
    if not 0 <= momentum < 1:
        raise ValueError(f"DelayedNesterov: momentum={momentum} (expected 0 <= momentum < 1)")
    if isinstance(delay, bool) or int(delay) != delay or delay < 1:
        raise ValueError(f"DelayedNesterov: delay={delay} (expected a whole number of rounds >= 1)")
    if not 0 <= c <= 1:
        raise ValueError(f"DelayedNesterov: c={c} (expected 0 <= c <= 1)")


def check_outer(outer: Any) -> None:
    """Judge a validated ``[outer]`` section (`composer_diloco.config.OuterOptimizer`) at load time: SGD without
    extra kwargs and Delayed Nesterov without torch, any other optimizer by building it once.

    Raises:
        ValueError: an argument the optimizer refuses, or an unknown optimizer (one line).
    """
    if outer.is_sgd and not outer.kwargs:
        return
    if outer.optimizer == DELAYED_NESTEROV:
        try:
            check_delayed_nesterov(outer.lr, **outer.kwargs)
        except TypeError as e:  # an argument it does not take
            raise ValueError(f"outer optimizer DelayedNesterov cannot be used: {e}") from None
        return
    from composer_diloco.outer.global_model import check_factory, optimizer_factory

    check_factory(optimizer_factory(outer))  # an unknown name or a refused argument: one line, at load time


__all__ = ["DELAYED_NESTEROV", "DELAYED_NESTEROV_DEFAULT", "OUTER_CHOICES", "SGD_NAMES", "check_delayed_nesterov",
           "check_outer", "is_sgd", "policy_defaults", "sgd_defaults"]
