"""Which pseudo-gradients of a round's group are averaged: the same decision on every peer.

Every peer puts ``{"name", "weight", "norm"}`` in hivemind's gathered metadata of the all-reduce (``norm`` is
the L2 norm of its pseudo-gradient, NaN/Inf when it has non-finite entries). All peers of a group receive the
same gathered list, so each can decide on its own, with no extra message, which contributions to drop:

- a pseudo-gradient trained from another theta than the group's authority holds (``theta``: the hash of the theta
  the member's inner phase started from, as its heartbeat publishes it; the authority is the first member by
  `composer_diloco.outer.recovery.step_order` that reports one: the coordinator, else the lowest name). A member left
  on another theta by an earlier round (e.g. a settle after a partly failed all-reduce) would otherwise be averaged
  in, and step its own theta by the mean; dropped, it takes the authority's theta after the step
  (`composer_diloco.outer.recovery.after_theta_rejected`);
- a non-finite norm (NaN or Inf in the pseudo-gradient);
- a norm above ``max_norm_ratio`` times the round's median norm (the lower median of the contributing peers,
  so that in a group of two the larger norm is compared to the smaller one).

Dropped peers still take part in the all-reduce (as reducers, and sending zeros with weight 0), so the group
does not break and they receive the same average as everyone else. Peers with weight 0 (the coordinator)
contribute nothing and are never screened. Norms are self-reported: this catches faults (a diverged node, a
corrupted buffer), not a peer that lies on purpose (that needs a robust aggregator, e.g. CenteredClip).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from composer_diloco.outer.recovery import step_order


@dataclass(frozen=True)
class Rejection:
    """A dropped contribution: the peer's ``name`` and why (``reason``, one line); ``theta_authority``: for a peer
    that trained from another theta, the member whose theta the group holds (None for the norm rules)."""

    name: str
    reason: str
    theta_authority: str | None = None


def pseudo_gradient_norm(delta: Sequence[torch.Tensor]) -> float:
    """L2 norm of all tensors together (fp64 accumulation); NaN or Inf when any entry is non-finite."""
    total = torch.zeros((), dtype=torch.float64)
    for d in delta:
        total += d.detach().double().pow(2).sum()
    return float(total.sqrt())


def screen(gathered: Sequence[dict], max_norm_ratio: float | None) -> list[Rejection | None]:
    """Decide, for each peer of a group, whether its contribution is dropped.

    Args:
        gathered: one dict per peer, in group order, with ``name`` (str), ``weight`` (samples, float), ``norm``
            (float) and optionally ``role`` and ``theta`` (str hash; empty or absent: not compared); entries without
            ``norm`` are never dropped.
        max_norm_ratio: drop norms above this multiple of the median; None = only non-finite norms.
    Returns:
        A list parallel to ``gathered``: None (kept) or the `Rejection`.
    """
    authority = _theta_authority(gathered)
    stale = [authority is not None and _weight(g) > 0 and bool(_theta(g)) and _theta(g) != authority[1]
             for g in gathered]
    norms = [_norm(g) for g in gathered]
    contributing = [n for g, n, s in zip(gathered, norms, stale)
                    if _weight(g) > 0 and not s and n is not None and math.isfinite(n)]
    median = statistics.median_low(contributing) if contributing else None
    out: list[Rejection | None] = []
    for g, norm, s in zip(gathered, norms, stale):
        name = str(g.get("name", "?")) if isinstance(g, dict) else "?"
        if s:
            out.append(Rejection(name, f"trained from theta {_theta(g)[:12]}, but the group's authority "
                                       f"{authority[0]} holds {authority[1][:12]}", theta_authority=authority[0]))
        elif norm is None or _weight(g) <= 0:
            out.append(None)
        elif not math.isfinite(norm):
            out.append(Rejection(name, f"non-finite pseudo-gradient (norm {norm})"))
        elif max_norm_ratio is not None and median and norm > max_norm_ratio * median:
            out.append(Rejection(name, f"pseudo-gradient norm {norm:.4g} > {max_norm_ratio:g} x the round's "
                                       f"median {median:.4g}"))
        else:
            out.append(None)
    return out


def _theta(g: object) -> str:
    theta = g.get("theta") if isinstance(g, dict) else None
    return theta if isinstance(theta, str) else ""


def _theta_authority(gathered: Sequence[object]) -> tuple[str, str] | None:
    """``(name, theta)`` of the first member by `step_order` that reports a theta, or None."""
    reporting = [g for g in gathered if _theta(g)]
    if not reporting:
        return None
    first = min(reporting, key=lambda g: step_order(str(g.get("role", "")), str(g.get("name", ""))))
    return str(first.get("name", "?")), _theta(first)


def _norm(g: object) -> float | None:
    if not isinstance(g, dict) or g.get("norm") is None:
        return None
    try:
        return float(g["norm"])
    except (TypeError, ValueError):
        return float("nan")


def _weight(g: object) -> float:
    try:
        return float(g.get("weight", 0.0)) if isinstance(g, dict) else 0.0
    except (TypeError, ValueError):
        return 0.0


__all__ = ["Rejection", "pseudo_gradient_norm", "screen"]
