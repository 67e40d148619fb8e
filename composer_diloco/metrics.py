"""Per-round metrics: one JSON line per round in ``<run-dir>/<peer-name>/metrics.jsonl``, and the table of a run.

Fields every peer writes: ``round``, ``peers``, ``sync_seconds`` and its parts ``outer_phase_seconds``
(`composer_diloco.outer.peer.OUTER_PHASES`), ``bytes_sent``, ``global_sha256``, ``status``,
``peer``, ``role``; nodes add ``samples``, ``mean_reward``, ``success_rate``, ``episodes_without_tool_call``,
``episodes_env_error``, ``loss_grpo``, ``inner_seconds`` and its parts ``inner_phase_seconds``
(`composer_diloco.timing.INNER_PHASES`), ``generated_tokens``, ``generated_tokens_per_s``, ``memory_peak_bytes`` / ``memory_planned_bytes`` /
``episode_tokens_max`` (`composer_diloco.policy.memory_plan.round_memory`) and each loss channel's keys
(`composer_diloco.channels.base.LossChannel.round_record`: ``loss_sdpo``, ``sdpo_sites``, ``sdpo_skipped``, ``loss_dpo``, ``dpo_pairs``, ``pair_stats`` for the built-in SDPO
and DPO channels).

The round table has a loss column and a count column per registered channel (`table_columns`): a run directory
written before a channel existed shows 0 there.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Column = tuple[str, str, str]
"""``(record key, title, format)`` of one table column."""


def table_columns() -> tuple[Column, ...]:
    """The round table's columns: round, peers, reward, success, the GRPO loss, every registered channel's loss,
    every channel's count, then inner seconds, the slowest node's generation seconds, the nodes' generated tokens
    per second (summed), sync seconds, bytes, and the memory peak against the plan (``(key, title, format)`` each)."""
    from composer_diloco.channels.base import registered_channels

    channels = [c.metrics for c in registered_channels()]
    return (
        ("round", "round", "{}"),
        ("peers", "peers", "{}"),
        ("mean_reward", "mean reward", "{:.3f}"),
        ("success_rate", "success", "{:.2f}"),
        ("loss_grpo", "GRPO loss", "{:+.4f}"),
        *((m.loss_key, m.loss_title, m.loss_format) for m in channels),
        *((m.count_key, m.count_title, "{}") for m in channels),
        ("inner_seconds", "inner s", "{:.1f}"),
        ("generation_seconds", "gen s", "{:.1f}"),
        ("generated_tokens_per_s", "tok/s", "{:.0f}"),
        ("sync_seconds", "sync s", "{:.1f}"),
        ("bytes_sent", "bytes sent", "{:,}"),
        ("memory", "peak/plan GB", "{}"),
    )


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (created with its folder), flushed and fsynced per line; and,
    once ``reporter`` is set (`composer_diloco.report.Reporter`, from the run config's ``[report]``), logs the same
    line to the run's trackers."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.reporter = None

    def write(self, record: dict[str, Any], peers: list | None = None) -> None:
        """Append ``record`` as one JSON line (keys sorted), flushed and fsynced; then report it (with ``peers``,
        the live peers' heartbeats, for the coordinator's table of them: `Reporter.log_round`).

        Raises:
            OSError: the file cannot be written; TypeError: a value is not JSON-serializable.
        """
        line = json.dumps(record, sort_keys=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.reporter is not None:
            self.reporter.log_round(record, peers)


def thetas_by_round(metrics: dict[str, list[dict[str, Any]]]) -> dict[int, set[str | None]]:
    """For each round any peer recorded, every theta hash (``global_sha256``) recorded for it by any peer, superseded
    records included (a peer healed from a split appends a second record of the round: both count here, unlike
    `round_table`'s ``sha_agree``, which keeps each peer's last). ``metrics``: `read_metrics`'s mapping."""
    out: dict[int, set[str | None]] = {}
    for records in metrics.values():
        for r in records:
            out.setdefault(int(r["round"]), set()).add(r.get("global_sha256"))
    return out


def replicas_agree(metrics: dict[str, list[dict[str, Any]]]) -> bool:
    """The benches' strict agreement: at least one round was recorded, and every record of each round, by every peer,
    names the same theta (`thetas_by_round`: a split that healed a round later still counts as a disagreement)."""
    by_round = thetas_by_round(metrics)
    return bool(by_round) and all(len(shas) == 1 for shas in by_round.values())


def read_metrics(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """All peers' records of a run: ``{peer_name: [record, ...]}`` (peers without a metrics file are absent)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(Path(run_dir).glob("*/metrics.jsonl")):
        records = []
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
        out[path.parent.name] = records
    return out


def round_table(metrics: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per round over the nodes (the coordinator counts in ``peers`` and ``bytes_sent``): mean reward
    and success rate weighted by samples, mean losses, summed channel counts (sites, pairs, ...), the slowest
    node's inner, generation and sync seconds, the nodes' generated tokens per second (summed: the run's rollout
    throughput), and the bytes all peers sent; ``samples``, ``episodes_without_tool_call`` and
    ``episodes_env_error`` (summed over the nodes) are in every row but not in the table.

    ``sha_agree`` compares each peer's last record of the round: a peer whose theta left the run's lineage and was
    healed (`composer_diloco.outer.recovery.split_check`, a later "resynced" record of the same round) counts with
    the theta it ended the round on. ``healed`` lists those peers (their pseudo-gradients of the round were dropped);
    it is not a column."""
    from composer_diloco.channels.base import registered_channels

    channels = [c.metrics for c in registered_channels()]
    by_round: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for name, records in metrics.items():
        for r in records:
            by_round[int(r["round"])][name].append(r)
    rows = []
    for rnd in sorted(by_round):
        named = by_round[rnd]  # a peer's records of this round in file order: a heal appends one
        recs = [r for records in named.values() for r in records]
        last = {name: records[-1] for name, records in named.items()}
        nodes = [r for r in recs if r.get("role") == "node"]
        samples = sum(r.get("samples", 0) for r in nodes) or 1
        row = {
            "round": rnd,
            "peers": max((r.get("peers", 0) for r in recs), default=0),
            "mean_reward": sum(r.get("mean_reward", 0.0) * r.get("samples", 0) for r in nodes) / samples,
            "success_rate": sum(r.get("success_rate", 0.0) * r.get("samples", 0) for r in nodes) / samples,
            "loss_grpo": _mean(r.get("loss_grpo", 0.0) for r in nodes),
            "inner_seconds": max((r.get("inner_seconds", 0.0) for r in nodes), default=0.0),
            "generation_seconds": max((r.get("inner_phase_seconds", {}).get("generation", 0.0) for r in nodes),
                                      default=0.0),
            "generated_tokens_per_s": sum(r.get("generated_tokens_per_s", 0.0) for r in nodes),
            # the nodes' sync: the coordinator's also holds its wait for the nodes' inner phase
            "sync_seconds": max((r.get("sync_seconds", 0.0) for r in nodes), default=0.0),
            "bytes_sent": sum(int(r.get("bytes_sent", 0)) for r in recs),
            "sha_agree": len({r.get("global_sha256") for r in last.values()}) == 1,
            "healed": sorted(name for name, r in last.items()
                             if any(e.get("global_sha256") != r.get("global_sha256") for e in named[name])),
            # not columns (the table's format is fixed): `no_tool_call_rounds` reads them
            "samples": sum(int(r.get("samples", 0)) for r in nodes),
            "episodes_without_tool_call": sum(int(r.get("episodes_without_tool_call", 0)) for r in nodes),
            "episodes_env_error": sum(int(r.get("episodes_env_error", 0)) for r in nodes),
            "memory": _memory_cell(nodes),
        }
        for m in channels:
            row[m.loss_key] = _mean(r.get(m.loss_key, 0.0) for r in nodes)
            row[m.count_key] = sum(int(r.get(m.count_key, 0)) for r in nodes)
        rows.append(row)
    return rows


def no_tool_call_rounds(rows: list[dict[str, Any]]) -> list[int]:
    """The rounds of `round_table` rows whose nodes played episodes and not one with a parsed tool call (a run
    directory written before ``episodes_without_tool_call`` existed has none)."""
    return [row["round"] for row in rows
            if row.get("samples", 0) > 0 and row.get("episodes_without_tool_call", 0) == row["samples"]]


def _memory_cell(nodes: list[dict[str, Any]]) -> str:
    """``peak/plan`` in GB of the node whose measured peak came closest to (or passed) its memory plan, e.g.
    ``0.41/0.52``; ``-`` when no node recorded both (a run directory written before the fields existed)."""
    pairs = [(r["memory_peak_bytes"], r["memory_planned_bytes"]) for r in nodes
             if r.get("memory_peak_bytes") is not None and r.get("memory_planned_bytes")]
    if not pairs:
        return "-"
    peak, plan = max(pairs, key=lambda p: p[0] / p[1])
    return f"{peak / 1e9:.2f}/{plan / 1e9:.2f}"


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of `round_table` as fixed-width text (one header line, one line per round)."""
    columns = table_columns()
    header = [title for _, title, _ in columns] + ["sha256 agree"]
    body = [[fmt.format(row[key]) for key, _, fmt in columns] + ["yes" if row["sha_agree"] else "NO"]
            for row in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in [header, *body]]
    return "\n".join(lines)
