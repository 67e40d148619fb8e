"""Send every peer's per-round metrics to an experiment tracker (a run config's ``[report]``, `ReportConfig`).

Each peer of a run (the coordinator and every node, each in its own process) is one run of the tracker, named after
the peer (``node-0``, ``coordinator``), grouped under the run's name in one project, so the tracker's dashboard
shows the nodes' curves side by side. Every line a peer appends to its ``metrics.jsonl`` (`MetricsWriter`) is
logged with the round as the step and the same names, nested objects flattened with ``/``
(``inner_phase_seconds/generation``); strings and lists (``status``, ``rejected``) stay in ``metrics.jsonl`` only.
The coordinator also logs ``peers_table``, a table of the peers of each round (`peers_table`), and, one round late
(the heartbeats carry it by then), whether the replicas agreed after the round before:
``replicas/previous_round_agree`` (1 or 0), ``..._thetas`` (distinct thetas), ``..._peers`` (`theta_agreement`).

Trackers: trackio (Hugging Face's local-first tracker, `trackio.init` / `trackio.log` / `trackio.finish`; its
dashboard is ``trackio show --project P``) and wandb (the same three calls; ``WANDB_MODE=offline`` works without an
account). Both keep one run per process, which is why TRL's own ``report_to`` is not used for them: its
``TrackioCallback`` would open a second run in the node's process and finish ours (`transformers.integrations`), and
log at steps of its own. What TRL logs each inner step reaches the peer's run instead through
`composer_diloco.inner.trl_logs.TrlLogsToTracker`, averaged per round as ``trl/<name>``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import math
import sys
from typing import Any

from composer_diloco.config import ConfigError, RunConfig
from composer_diloco.outer.peer_records import replica_thetas

log = logging.getLogger(__name__)

EXTRA = {"trackio": 'pip install -e ".[trackio]"', "wandb": "pip install wandb"}
"""How to install each tracker: the one line a missing package's error names."""

_INIT_KWARGS: dict[str, dict[str, Any]] = {"trackio": {"auto_log_cpu": False}, "wandb": {}}
"""Per tracker: no background CPU/RAM sampling in trackio (the run's store holds the rounds' metrics only)."""


def check_trackers(config: RunConfig) -> None:
    """Check that every tracker ``config.report.to`` names is installed (found, not imported: this runs before the
    heavy imports, the model and any network).

    Raises:
        ConfigError: one line naming the tracker and the command that installs it, when its package is missing.
    """
    for name in config.report.to:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"[report] to = [{name!r}], but the {name} package is not installed: {EXTRA[name]}")


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of one metrics line, nested keys joined with ``/``; bools as 0/1; strings, lists, None,
    non-finite numbers and the line's ``time`` left out (a tracker plots numbers and stamps its steps itself)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key == "time":
            continue  # the wall clock of the line: the tracker stamps each step itself (and trackio reserves "time")
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = value
    return out


PEERS_TABLE_COLUMNS = ["round", "peer", "role", "device", "phase", "peer_round", "inner_s", "sync_s", "samples"]
"""Columns of the coordinator's ``peers_table``: the peers of the round as their heartbeats told the coordinator."""


def peers_table(round_: int, peers: list[Any]) -> list[list[Any]]:
    """Rows of ``peers_table`` for round ``round_``: one per live peer (`composer_diloco.outer.swarm.PeerRecord`),
    in `PEERS_TABLE_COLUMNS`' order; values a heartbeat does not carry are None (a column keeps one type: wandb
    refuses a table that mixes them)."""
    rows = []
    for p in sorted(peers, key=lambda p: (p.role != "coordinator", p.name)):
        info = getattr(p, "info", None) or {}
        rows.append([round_, p.name, p.role, info.get("device"), info.get("phase"), p.round,
                     info.get("inner_seconds"), info.get("sync_seconds"), info.get("samples")])
    return rows


def theta_agreement(peers: list[Any], round_: int) -> tuple[int, int]:
    """How many live peers started ``round_`` and on how many different thetas (1: the replicas agreed after round
    ``round_ - 1``'s outer step), from their heartbeats (`composer_diloco.outer.peer_records.replica_thetas`, which
    `composer-coordinator status` shows too). Peers that carry no hash for it are not counted."""
    groups = replica_thetas(peers, round_)
    return sum(len(names) for names in groups.values()), len(groups)


class Reporter:
    """One peer's runs in the trackers of ``config.report`` (none: every call does nothing).

    Args:
        config: the run config (its ``report``, ``run_name``; the whole config is the tracker run's config).
        peer: this peer's name (the tracker run's name); role: ``"node"`` or ``"coordinator"``.
        extra: more of the run's config for the tracker (device, precision, model).

    Raises:
        ConfigError: a tracker's package is missing (`check_trackers`).
    """

    def __init__(self, config: RunConfig, *, peer: str, role: str, extra: dict[str, Any] | None = None):
        check_trackers(config)
        self.peer, self.role = peer, role
        self.project = config.report.project or config.run_name
        self._runs: dict[str, Any] = {}  # tracker name -> its module, once its run is open
        self.last_round: int | None = None  # the round of the last line logged (`TrlLogsToTracker` reads it)
        run_config = {**config.model_dump(mode="json"), "peer": peer, "role": role, **(extra or {})}
        for name in config.report.to:
            module = importlib.import_module(name)
            with _quiet():
                module.init(project=self.project, name=peer, group=config.run_name, config=run_config,
                            **_INIT_KWARGS[name])
            self._runs[name] = module
            log.info("reporting to %s: project %r, run %r", name, self.project, peer)

    @property
    def active(self) -> bool:
        """Whether any tracker is open."""
        return bool(self._runs)

    def log_round(self, record: dict[str, Any], peers: list[Any] | None = None) -> None:
        """Log one metrics line (`flatten`) at step ``record["round"]``; with ``peers`` (the coordinator's live
        peers at the round's end), also ``peers_table``. A tracker that fails is logged and dropped: the run goes
        on (its metrics.jsonl has every line)."""
        if not self._runs:
            return
        step = self.last_round = int(record["round"])
        values: dict[str, Any] = flatten(record)
        if peers is not None and step >= 1:  # the replicas' agreement on the theta round `step` started from
            count, thetas = theta_agreement(peers, step)
            if count:  # at this step: wandb takes no step that went back
                values.update({"replicas/previous_round_peers": count, "replicas/previous_round_thetas": thetas,
                               "replicas/previous_round_agree": int(thetas == 1)})
        for name, module in list(self._runs.items()):
            row = dict(values)
            try:
                if peers is not None:
                    row["peers_table"] = module.Table(columns=PEERS_TABLE_COLUMNS, data=peers_table(step, peers))
                module.log(row, step=step)
            except Exception as e:  # noqa: BLE001 (a tracker is a side channel: never the run's end)
                log.warning("reporting to %s failed, no more reports there: %s", name, e)
                self._runs.pop(name)

    def log_extra(self, values: dict[str, float], step: int) -> None:
        """Log more numbers at round ``step``, beside its metrics line (a step already logged: the trackers merge
        them): TRL's step metrics averaged over the round (`inner.trl_logs`), the run's fixed evaluation at its last
        round (`coordinator.simulate`)."""
        for name, module in list(self._runs.items()):
            try:
                module.log(dict(values), step=step)
            except Exception as e:  # noqa: BLE001
                log.warning("reporting to %s failed: %s", name, e)

    def finish(self) -> None:
        """Close every tracker's run (flushes what is buffered); idempotent."""
        for name, module in list(self._runs.items()):
            try:
                with _quiet():
                    module.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("closing the %s run failed: %s", name, e)
        self._runs = {}


def _quiet() -> contextlib.AbstractContextManager:
    """The trackers' own prints go to stderr: a coordinator's stdout carries its ``peer:`` line, which job scripts
    and `simulate` read."""
    return contextlib.redirect_stdout(sys.stderr)


__all__ = ["EXTRA", "PEERS_TABLE_COLUMNS", "Reporter", "check_trackers", "flatten", "peers_table",
           "theta_agreement"]
