"""`composer-coordinator plot`: PNG figures of a run, per round, from every ``<run-dir>/*/metrics.jsonl``.

Four files, each with the round on the x axis:

- ``reward.png``: mean reward and success rate (fraction of episodes with reward >= 1) of each node, and their
  mean over the nodes weighted by samples (as in the run's table, `composer_diloco.metrics.round_table`);
- ``losses.png``: ``loss_grpo`` and each registered loss channel's loss (``loss_sdpo``, ``loss_dpo``, ...; each
  node's mean over its inner steps), one panel per loss, and their mean over the nodes;
- ``bytes.png``: payload bytes each peer (coordinator and nodes) sent in the round's all-reduce, in MB (10^6 bytes);
- ``sync.png``: each peer's ``sync_seconds`` (ready to new theta loaded) and ``wait_seconds`` (the part of it
  spent waiting at the barrier), in seconds.

Drawn with matplotlib's Agg canvas (no display, no pyplot state). A peer that wrote a round twice (a resumed
run) is drawn with the last record of that round; a round a peer did not record leaves a gap in its line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from composer_diloco.metrics import read_metrics

Records = dict[str, list[dict[str, Any]]]
"""``{peer_name: [record, ...]}``, each peer's records sorted by round, one per round."""

FILE_NAMES = ("reward.png", "losses.png", "bytes.png", "sync.png")
_DPI = 100
_MEAN_STYLE = {"color": "black", "linewidth": 2.2, "marker": "o", "markersize": 4, "label": "mean of nodes"}


class PlotError(ValueError):
    """The run directory cannot be plotted (missing, no metrics files, unreadable records, bad output folder)."""


def load_run(run_dir: Path) -> Records:
    """Every peer's per-round records of ``run_dir``, checked: each record has an integer ``round``.

    Returns ``{peer_name: [record, ...]}`` sorted by round, the last record kept where a round repeats.

    Raises:
        PlotError: ``run_dir`` is not a directory, holds no ``*/metrics.jsonl``, a line is not JSON, the files
            hold no record, or a record has no integer ``round``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise PlotError(f"run directory {str(run_dir)!r} {what} (expected a run's folder holding "
                        "<peer>/metrics.jsonl files)")
    try:
        raw = read_metrics(run_dir)
    except json.JSONDecodeError as e:
        raise PlotError(f"run directory {str(run_dir)!r}: a metrics.jsonl line is not JSON ({e})") from e
    except OSError as e:
        raise PlotError(f"run directory {str(run_dir)!r}: cannot read its metrics ({e})") from e
    if not raw:
        raise PlotError(f"run directory {str(run_dir)!r} holds no metrics (expected <peer>/metrics.jsonl files, "
                        "one per coordinator and node)")
    out: Records = {}
    for peer, records in raw.items():
        by_round: dict[int, dict[str, Any]] = {}
        for i, record in enumerate(records, start=1):
            rnd = record.get("round") if isinstance(record, dict) else None
            if not isinstance(rnd, int) or isinstance(rnd, bool):
                raise PlotError(f"{str(run_dir / peer / 'metrics.jsonl')!r}: record {i} has no integer 'round'")
            by_round[rnd] = record
        if by_round:
            out[peer] = [by_round[r] for r in sorted(by_round)]
    if not out:
        raise PlotError(f"run directory {str(run_dir)!r}: its metrics.jsonl files hold no records")
    return out


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw the run's figures (see the module docstring) into ``out_dir`` (default ``run_dir/plots``).

    Everything is read and checked before ``out_dir`` is created, so a bad run directory writes nothing.

    Returns:
        The written PNG paths, in the order of `FILE_NAMES`.

    Raises:
        PlotError: see `load_run`, or ``out_dir`` exists and is not a directory.
    """
    run_dir = Path(run_dir)
    metrics = load_run(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    if out_dir.exists() and not out_dir.is_dir():
        raise PlotError(f"--out {str(out_dir)!r} exists and is not a directory")
    figures = [
        ("reward.png", reward_figure(metrics)),
        ("losses.png", losses_figure(metrics)),
        ("bytes.png", bytes_figure(metrics)),
        ("sync.png", sync_figure(metrics)),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures:
        path = out_dir / name
        FigureCanvasAgg(fig).print_png(str(path))
        paths.append(path)
    return paths


def reward_figure(metrics: Records) -> Figure:
    """Two panels: mean reward per episode (reward units of the environment) and success rate (fraction of
    episodes with reward >= 1, 0..1), per node and their samples-weighted mean, against the round."""
    fig, axes = _figure(2, "Reward per round")
    for ax, key, label in zip(axes, ("mean_reward", "success_rate"), ("mean reward", "success rate")):
        _per_peer(ax, metrics, key, nodes_only=True)
        _mean_line(ax, metrics, key, weighted=True)
        ax.set_ylabel(label)
    axes[1].set_ylim(-0.05, 1.05)
    _finish(axes)
    return fig


def losses_figure(metrics: Records) -> Figure:
    """One panel per loss: ``loss_grpo``, then each registered channel's (`composer_diloco.channels.base`;
    ``loss_sdpo``, ``loss_dpo`` built in), in nats, each node's mean over its inner steps of the round, per node
    and their unweighted mean over the nodes, against the round."""
    from composer_diloco.channels.base import registered_channels

    panels = [("loss_grpo", "GRPO loss")] + [(c.metrics.loss_key, c.metrics.plot_label) for c in registered_channels()]
    fig, axes = _figure(len(panels), "Inner-loop losses per round (each node's mean over its inner steps)")
    for ax, (key, label) in zip(axes, panels):
        _per_peer(ax, metrics, key, nodes_only=True)
        _mean_line(ax, metrics, key, weighted=False)
        ax.set_ylabel(label)
    _finish(axes)
    return fig


def bytes_figure(metrics: Records) -> Figure:
    """One panel: payload bytes each peer sent in the round's all-reduce, in MB (10^6 bytes), against the round."""
    fig, axes = _figure(1, "All-reduce bytes sent per round")
    _per_peer(axes[0], metrics, "bytes_sent", nodes_only=False, scale=1e-6)
    axes[0].set_ylabel("MB sent (10^6 bytes)")
    _finish(axes)
    return fig


def sync_figure(metrics: Records) -> Figure:
    """Two panels: each peer's ``sync_seconds`` (ready to new theta loaded, barrier wait included) and
    ``wait_seconds`` (the barrier wait alone), in seconds, against the round."""
    fig, axes = _figure(2, "Outer sync per round")
    for ax, key, label in zip(axes, ("sync_seconds", "wait_seconds"), ("sync s", "barrier wait s")):
        _per_peer(ax, metrics, key, nodes_only=False)
        ax.set_ylabel(label)
    _finish(axes)
    return fig


# -- drawing helpers ----------------------------------------------------------------------------------------
def _figure(panels: int, title: str) -> tuple[Figure, Sequence[Any]]:
    fig = Figure(figsize=(8, 2.6 * panels + 0.8), dpi=_DPI, layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title)
    return fig, list(axes)


def _finish(axes: Sequence[Any]) -> None:
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    axes[-1].set_xlabel("round")


def _is_node(records: list[dict[str, Any]]) -> bool:
    return any(r.get("role") == "node" for r in records)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _series(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    # a round the peer did not record breaks its line (a NaN point) instead of being bridged
    xs: list[float] = []
    ys: list[float] = []
    for r in records:
        y = _number(r.get(key))
        if y is None:
            continue
        if xs and r["round"] > xs[-1] + 1:
            xs.append(xs[-1] + 1)
            ys.append(math.nan)
        xs.append(r["round"])
        ys.append(y * scale)
    return xs, ys


def _per_peer(ax: Any, metrics: Records, key: str, nodes_only: bool, scale: float = 1.0) -> None:
    # one colour per peer, the same in every figure: peers in name order, the coordinator in grey
    for i, (peer, records) in enumerate(sorted(metrics.items())):
        node = _is_node(records)
        if nodes_only and not node:
            continue
        xs, ys = _series(records, key, scale)
        if not xs:
            continue
        style: dict[str, Any] = {"color": f"C{i % 10}", "marker": ".", "linewidth": 1.0, "alpha": 0.8}
        if not node:
            style.update(color="grey", linestyle="--")
        ax.plot(xs, ys, label=peer, **style)


def _mean_line(ax: Any, metrics: Records, key: str, weighted: bool) -> None:
    """The mean of ``key`` over the nodes that have it, per round (weighted by ``samples`` where asked; plain
    where a round's nodes have no samples). Not drawn for a single node: its own line is the mean."""
    nodes = [records for records in metrics.values() if _is_node(records)]
    if len(nodes) < 2:
        return
    by_round: dict[int, list[tuple[float, float]]] = {}
    for records in nodes:
        for r in records:
            y = _number(r.get(key))
            if y is not None:
                w = (_number(r.get("samples")) or 0.0) if weighted else 1.0
                by_round.setdefault(r["round"], []).append((w, y))
    xs: list[float] = []
    ys: list[float] = []
    for rnd in sorted(by_round):
        pairs = by_round[rnd]
        weight = sum(w for w, _ in pairs)
        if xs and rnd > xs[-1] + 1:
            xs.append(xs[-1] + 1)
            ys.append(math.nan)
        xs.append(rnd)
        ys.append(sum(w * y for w, y in pairs) / weight if weight > 0 else sum(y for _, y in pairs) / len(pairs))
    if xs:
        ax.plot(xs, ys, **_MEAN_STYLE)
