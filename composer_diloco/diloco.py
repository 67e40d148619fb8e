"""One DiLoCo peer: pseudo-gradient -> weighted all-reduce through hivemind -> outer Nesterov step.

A node calls `DiLoCoPeer.sync(model, weight)` after its H inner steps; the coordinator calls
`sync(None, 0.0)` for every round, so it receives the same mean pseudo-gradient without moving it and applies the
same outer step: it always holds the canonical theta (DiLoCo, arXiv 2311.08105; OpenDiLoCo's layout on hivemind).

Failure behaviour of `sync`:
- the all-reduce fails (no group within ``averaging_timeout_s``, a peer lost mid-way beyond repair): no outer
  step is applied; the peer downloads the newest state from a live peer (``load_state_from_peers``, the
  coordinator first) if one is ahead, else applies its own pseudo-gradient alone (it is then the whole swarm);
- a NaN/Inf mean pseudo-gradient: the outer step is refused (ValueError from `GlobalModel.outer_step`), the
  round is marked failed and the peer resynchronises as above.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from composer_diloco.averaging import ExactAverager
from composer_diloco.compression import make_compression
from composer_diloco.config import RunConfig
from composer_diloco.lifecycle import keep_signal_handlers
from composer_diloco.outer import GlobalModel
from composer_diloco.swarm import Swarm

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """What one round's communication did.

    Attributes:
        round: the round that ended (theta now holds theta_{round+1}).
        peers: group size of the all-reduce, coordinator included (1 = averaged alone).
        weight_total: sum of the weights (samples) in the group.
        sync_seconds: wall seconds from ready to the new theta loaded (barrier wait included).
        wait_seconds: the part of ``sync_seconds`` spent waiting at the barrier for other peers.
        bytes_sent: payload bytes this peer sent in the all-reduce.
        global_sha256: SHA-256 of theta after the outer step (`GlobalModel.sha256`).
        status: "averaged", "alone", or "resynced" (state downloaded from a peer after a failure).
    """

    round: int
    peers: int
    weight_total: float
    sync_seconds: float
    wait_seconds: float
    bytes_sent: int
    global_sha256: str
    status: str


def round_group_bits(round_: int) -> str:
    """hivemind group-key bits for a round: peers of different rounds can never be matched together."""
    return format(round_, "032b")


class DiLoCoPeer:
    """Global model + outer optimizer + hivemind averager of one peer.

    Args:
        model: the policy (any device/dtype); defines the parameter layout.
        config: the run config (outer optimizer, network timeouts, compression).
        swarm: this peer's DHT records (its ``dht`` is used for the averager).
        start_round: the round this peer starts in (0, or the round of the state it loaded).
    """

    def __init__(self, model: nn.Module, config: RunConfig, swarm: Swarm, *, start_round: int = 0):
        self.config, self.swarm = config, swarm
        self.round = start_round
        self.global_model = GlobalModel(
            model, lr=config.outer.lr, momentum=config.outer.momentum, nesterov=config.outer.nesterov
        )
        self.delta = [torch.zeros_like(p, requires_grad=False) for p in self.global_model.params]
        self._lock = threading.Lock()  # guards theta while a peer downloads our state
        with keep_signal_handlers():
            self.averager = self._make_averager(swarm, config)
        self._update_priority()

    def _make_averager(self, swarm: Swarm, config: RunConfig) -> ExactAverager:
        net = config.network
        return ExactAverager(
            self.delta,
            swarm.dht,
            state_provider=self._state,
            prefix=f"{config.run_name}_diloco",
            start=True,
            min_group_size=2,
            min_matchmaking_time=net.matchmaking_time_s,
            request_timeout=min(5.0, net.matchmaking_time_s),
            allreduce_timeout=net.averaging_timeout_s,
            next_chunk_timeout=min(10.0, net.averaging_timeout_s / 3),
            compression=make_compression(config.compression),
            declare_state_period=5.0,
            shutdown_timeout=5.0,
        )

    # -- state sharing (late joiners, resync) -------------------------------------------------------
    def _state(self) -> tuple[dict, list[torch.Tensor]]:
        with self._lock:
            meta = {"round": self.round, "sha256": self.global_model.sha256(), "run": self.config.run_name}
            return meta, [t.clone() for t in self.global_model.state_tensors()]

    def _update_priority(self) -> None:
        # load_state_from_peers picks the highest priority: the newest round, the coordinator among equals.
        self.averager.state_sharing_priority = self.round + (0.5 if self.swarm.role == "coordinator" else 0.0)

    def load_state_from_peers(self, timeout_s: float) -> bool:
        """Adopt theta, outer momentum and round from the best live peer. Returns False if none answered."""
        loaded = self.averager.load_state_from_peers(timeout=timeout_s)
        if loaded is None:
            return False
        meta, tensors = loaded
        if not isinstance(meta, dict) or "round" not in meta:
            log.warning("peer state without a round: %r", meta)
            return False
        with self._lock:
            self.global_model.load_state_tensors(tensors)
            self.round = int(meta["round"])
        self._update_priority()
        log.info("%s loaded round %d state from a peer (sha256 %s)", self.swarm.name, self.round,
                 self.global_model.sha256()[:12])
        return True

    # -- one round ------------------------------------------------------------------------------------
    def sync(self, model: nn.Module | None, weight: float, stop: threading.Event | None = None) -> SyncResult | None:
        """End the current round: average pseudo-gradients, take the outer step, load theta into ``model``.

        Args:
            model: the locally trained policy (None on the coordinator: it contributes zeros).
            weight: samples this peer trained this round (0 on the coordinator).
            stop: set to abandon the barrier wait (shutdown); returns None then.
        Returns:
            A `SyncResult`, or None when stopped.
        """
        start, r, net = time.monotonic(), self.round, self.config.network
        with self.averager.get_tensors() as delta:
            if model is None:
                for d in delta:
                    d.zero_()
            else:
                self.global_model.pseudo_gradient(model, delta)
        if self.swarm.role == "node":
            self.swarm.announce_ready(r, weight)
        barrier = self.swarm.wait_for_round(r, slack_s=net.round_slack_s, matchmaking_s=net.matchmaking_time_s,
                                            stop=stop)
        if barrier is None:
            return None
        scheduled_time, ready_nodes = barrier
        waited = time.monotonic() - start
        others = [p for p in self.swarm.live_peers() if p.name != self.swarm.name and p.round <= r]
        others = [p for p in others if p.role == "coordinator" or p.name in ready_nodes]
        bytes_before = self.averager.bytes_sent.value

        status, peers, weight_total = "averaged", 1, weight
        if not others:
            status = "alone"  # nobody to average with: theta moves by our own pseudo-gradient
        else:
            self.averager.set_group_bits(round_group_bits(r))
            try:
                gathered = self.averager.step(
                    weight=float(weight),
                    gather={"name": self.swarm.name, "round": r, "weight": float(weight)},
                    scheduled_time=scheduled_time,
                    timeout=net.averaging_timeout_s,
                    allow_retries=False,
                )
            except Exception as e:
                log.warning("%s round %d: all-reduce failed: %r", self.swarm.name, r, e)
                gathered = None
            if gathered is None:
                return self._after_failure(model, r, start, waited, bytes_before)
            peers = len(gathered)
            weight_total = sum(float(g.get("weight", 0.0)) for g in gathered.values() if isinstance(g, dict))
            rounds = {g.get("round") for g in gathered.values() if isinstance(g, dict)}
            if rounds != {r}:
                log.error("%s round %d: group mixed rounds %s", self.swarm.name, r, rounds)
            if peers == 1 or weight_total <= 0:
                return self._after_failure(model, r, start, waited, bytes_before)

        with self.averager.get_tensors() as delta:
            mean = [d.clone() for d in delta]
        try:
            with self._lock:
                self.global_model.outer_step(mean)
                self.round = r + 1
        except ValueError as e:
            log.error("%s round %d: %s", self.swarm.name, r, e)
            return self._after_failure(model, r, start, waited, bytes_before)
        return self._finish(model, r, peers, weight_total, start, waited, bytes_before, status)

    def _after_failure(self, model, r, start, waited, bytes_before) -> SyncResult:
        if self.load_state_from_peers(timeout_s=self.config.network.averaging_timeout_s) and self.round > r:
            return self._finish(model, r, 0, 0.0, start, waited, bytes_before, "resynced")
        log.warning("%s round %d: no peer ahead of us; applying our own pseudo-gradient", self.swarm.name, r)
        with self.averager.get_tensors() as delta:
            own = [d.clone() for d in delta]
        with self._lock:
            self.global_model.outer_step(own)
            self.round = r + 1
        return self._finish(model, r, 1, 0.0, start, waited, bytes_before, "alone")

    def _finish(self, model, r, peers, weight_total, start, waited, bytes_before, status) -> SyncResult:
        if model is not None:
            self.global_model.load_into(model)
        self._update_priority()
        self.swarm.set_round(self.round)
        return SyncResult(
            round=r, peers=peers, weight_total=weight_total, sync_seconds=time.monotonic() - start,
            wait_seconds=waited, bytes_sent=int(self.averager.bytes_sent.value - bytes_before),
            global_sha256=self.global_model.sha256(), status=status,
        )

    def shutdown(self) -> None:
        """Stop the averager process (idempotent)."""
        try:
            self.averager.shutdown()
        except Exception as e:  # already stopped
            log.debug("averager shutdown: %r", e)
