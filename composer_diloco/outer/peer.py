"""One DiLoCo peer: pseudo-gradient -> barrier -> weighted all-reduce through hivemind -> outer step -> theta.

A node calls `DiLoCoPeer.sync(model, weight)` after its H inner steps; the coordinator calls
`sync(None, 0.0)` for every round, so it receives the same mean pseudo-gradient without moving it and applies the
same outer step: it always holds the canonical theta (DiLoCo, arXiv 2311.08105; OpenDiLoCo's layout on hivemind).

`DiLoCoPeer.sync` is five steps, in order: the pseudo-gradient Delta_i = theta - theta_i; the barrier (wait for
the round's peers); the weighted all-reduce Delta = sum_i w_i Delta_i / sum_i w_i (`ExactAverager`, which also
screens the contributions and hands back its verdicts); the outer step theta <- OuterOpt(theta, Delta)
(`GlobalModel`); and loading theta into the policy. With ``[outer] overlap`` a node runs the same steps in two
halves instead: `DiLoCoPeer.hand_off` (the pseudo-gradient, in the trainer's thread) and `DiLoCoPeer.complete` (the
rest, in a background thread, theta never loaded into the policy); `composer_diloco.outer.overlap` folds theta in.

Failure behaviour: a step that leaves this peer without an average it can apply raises `RoundFailed`, handled in
one place, by `composer_diloco.outer.recovery.after_failed_round` (take the state of a peer past the round, or step
alone by a rule every peer applies alike); the module docstring of `composer_diloco.outer.recovery` lists each case.
Recovery decides, this peer acts: the rules there are functions of the heartbeats that return a decision, carried out
by the methods of the section "carrying out recovery's decisions" below. A peer
stopped at the barrier (shutdown) returns None. State sharing (`DiLoCoPeer.load_state_from_peers`, through
`composer_diloco.outer.state_transfer`) raises `ArchitectureMismatch` when a peer's model differs; every other download
failure returns False, its reason in `DiLoCoPeer.last_download_error`, and leaves theta as it was.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils.timed_storage import get_dht_time
from torch import nn

from composer_diloco import faults
from composer_diloco.config import RunConfig
from composer_diloco.lifecycle import keep_signal_handlers
from composer_diloco.outer import recovery
from composer_diloco.outer.averaging import Contribution, ExactAverager
from composer_diloco.outer.codec_contract import build_codec
from composer_diloco.outer.global_model import GlobalModel, optimizer_factory
from composer_diloco.outer.recovery import RoundFailed
from composer_diloco.outer.screening import pseudo_gradient_norm
from composer_diloco.outer.state_transfer import (
    DEFAULT_CHUNK_BYTES, DownloadReport, Manifest, StateTransfer, StateTransferError,
)
from composer_diloco.outer.swarm import PeerRecord, Swarm, all_reduce_began, first_divergence, joins_round

log = logging.getLogger(__name__)

SyncStatus = Literal["averaged", "alone", "resynced", "skipped", "unsettled"]
"""How a round ended for a peer: "averaged" (outer step on the group's mean), "alone" (on its own pseudo-gradient),
"resynced" (state downloaded from a peer after a failure), "skipped" (every contribution dropped: theta
unchanged) or "unsettled" (the all-reduce missed elements and no member with another theta sent it: this peer's
theta differs from theirs, `recovery.settle_pick`)."""


@dataclass
class SyncResult:
    """What one round's communication did.

    Attributes:
        round: the round whose outcome theta now holds (theta is theta_{round+1}): the round that ended, or,
            when the peer found the swarm further ahead and downloaded its state, the round before its new one.
        peers: group size of the all-reduce, coordinator included (1 = averaged alone, 0 = resynced).
        weight_total: sum of the weights (samples) of the averaged (not dropped) contributions.
        sync_seconds: wall seconds from ready to the new theta loaded (barrier wait included).
        wait_seconds: the part of ``sync_seconds`` spent waiting at the barrier for other peers.
        bytes_sent: payload bytes this peer sent in the all-reduce.
        global_sha256: SHA-256 of theta after the outer step (`GlobalModel.sha256`).
        status: a `SyncStatus` ("averaged", "alone", "resynced", "skipped" or "unsettled"; the string is what
            metrics record).
        rejected: names of the peers whose pseudo-gradient was dropped this round (`screening.screen`).
        rejected_reasons: name -> why its pseudo-gradient was dropped (one line each), for those of ``rejected``.
        members: names of the all-reduce group's peers, this one included ([] when no group formed).
        phase_seconds: ``sync_seconds`` by part, in the order they ran (`OUTER_PHASES`; a part that took no time is
            left out).
    """

    round: int
    peers: int
    weight_total: float
    sync_seconds: float
    wait_seconds: float
    bytes_sent: int
    global_sha256: str
    status: SyncStatus
    rejected: list[str] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    rejected_reasons: dict[str, str] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)

    def record(self, peer: str, role: str) -> dict:
        """The round's keys of a metrics line, the same for a node and the coordinator (each adds its own):
        ``round``, ``peer``, ``role``, ``peers``, ``sync_seconds`` and ``wait_seconds`` (seconds, 3 decimals),
        ``bytes_sent``, ``global_sha256``, ``status``, ``rejected``, ``members`` and ``outer_phase_seconds``
        (`OUTER_PHASES`)."""
        return {"round": self.round, "peer": peer, "role": role, "peers": self.peers,
                "sync_seconds": round(self.sync_seconds, 3), "wait_seconds": round(self.wait_seconds, 3),
                "bytes_sent": self.bytes_sent, "global_sha256": self.global_sha256, "status": self.status,
                "rejected": list(self.rejected), "members": list(self.members),
                "outer_phase_seconds": dict(self.phase_seconds)}


OUTER_PHASES = {
    "heal_check": "do the replicas of the run agree (`recovery.split_check`)",
    "pseudo_gradient": "Delta_i = theta - theta_i into the averager's buffers (and the codec's prepare_round)",
    "barrier": "announce ready and wait for the round's peers",
    "all_reduce": "hivemind's all-reduce of the pseudo-gradients",
    "outer_step": "theta <- OuterOpt(theta, Delta), waiting for state downloads in flight",
    "recovery": "a failed round: download the run's state from a peer (`DiLoCoPeer.load_state_from_peers`), or "
                "step alone; a split healed",
    "load": "theta into the policy",
    "publish": "theta's SHA-256 and the new round into the DHT",
}
"""The parts of a round's sync (`SyncResult.phase_seconds`, the metrics line's ``outer_phase_seconds``)."""


class ArchitectureMismatch(ValueError):
    """A peer's global model has other parameters (names or shapes) than this peer's model."""


@dataclass
class _RoundClock:
    """When this peer's sync of a round started, how long it waited at the barrier, bytes sent before it, and the
    seconds of each of its parts so far (`lap`)."""

    start: float
    bytes_before: int
    waited: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    last: float | None = None

    def lap(self, name: str) -> None:
        """Count the seconds since the previous lap (or the start) under ``name`` (`OUTER_PHASES`)."""
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - (self.start if self.last is None else self.last)
        self.last = now


@dataclass
class _Reduced:
    """What a round's all-reduce left this peer: the group, the verdicts it applied, the mean pseudo-gradient.

    Attributes:
        members: names of the group's peers (this one included).
        weight_total: summed weights (samples) of the averaged contributions.
        rejected: names of the members whose contribution the all-reduce dropped.
        missed: elements no reducer returned to this peer (zeros in Delta; `recovery.settle_pick`).
        reasons: name -> why its contribution was dropped, for those of ``rejected``.
        theta_authority: set when this peer's own contribution was dropped for training from another theta: the
            member whose theta the group holds (`screening.screen`).
        began: DHT time (seconds) this peer's all-reduce began: a member whose heartbeat entered the round later is a
            new life of it, which took no part (`recovery.settle_pick`).

    Delta itself (fp32 CPU, the layout of theta) stays where the all-reduce left it, in the averager's buffers; with
    ``weight_total`` 0 every contribution was dropped and there is none.
    """

    members: list[str]
    weight_total: float
    rejected: list[str]
    missed: int
    reasons: dict[str, str] = field(default_factory=dict)
    theta_authority: str | None = None
    began: float = float("inf")


@dataclass
class HandOff:
    """A round handed off by `DiLoCoPeer.hand_off`: its pseudo-gradient sits in the averager's buffers.

    Attributes:
        round: the round being synced (theta_round is what the pseudo-gradient was taken against).
        weight: samples the node trained on in that round.
        norm: L2 norm of the pseudo-gradient (or of what its codec says is averaged, `codec_contract.Prepared`).
        clock: when the hand-off happened (``sync_seconds`` counts from it) and the bytes sent before it.
    """

    round: int
    weight: float
    norm: float
    clock: _RoundClock


def _check_layout(theirs: list, ours: list) -> None:
    """Raise ArchitectureMismatch naming the first parameter whose name or shape differs."""
    theirs = [[str(n), list(shape)] for n, shape in theirs]
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            raise ArchitectureMismatch(
                f"model architecture differs from the run's: parameter {i} is {a[0]!r} {a[1]} in the run, "
                f"{b[0]!r} {b[1]} here (does --model / the installed version match the coordinator's?)")
    if len(theirs) != len(ours):
        raise ArchitectureMismatch(f"model architecture differs from the run's: {len(theirs)} parameter tensors in "
                                   f"the run, {len(ours)} here")


def _lora_base_sha256(model: nn.Module) -> str | None:
    """`composer_diloco.policy.lora.base_sha256` of a LoRA policy (a ``peft.PeftModel``); None for full fine-tuning."""
    from composer_diloco.policy.lora import base_sha256, is_lora

    return base_sha256(model) if is_lora(model) else None


def _check_base(theirs: str | None, ours: str | None, *, lora: bool) -> None:
    """Raise ArchitectureMismatch when the run's base model (its ``base_sha256``) is not the one this peer holds (one
    line naming both hashes). Nothing to check when either side does not know its base."""
    if theirs is None or ours is None or theirs == ours:
        return
    why = ("LoRA trains adapters over one shared base: load the run's --model / warm start" if lora else
           "every peer must load the run's --model, the same weights: theta started from them")
    raise ArchitectureMismatch(f"base model differs from the run's: base_sha256 {theirs} in the run, {ours} here "
                               f"({why})")


def _shared_zeros(shape: torch.Size) -> torch.Tensor:
    """An fp32 CPU tensor of zeros in shared memory (hivemind's averager shares its tensors with its process) whose
    pages are not touched until written: a peer that only serves or downloads state (a joiner before its first round,
    the coordinator while nodes load) does not hold theta's size in zeros (2.4 GB at 0.6B). ``share_memory_`` of
    ``torch.zeros`` would write every page twice."""
    numel = 1
    for n in shape:
        numel *= int(n)
    storage = torch.UntypedStorage._new_shared(max(numel, 1) * 4)
    return torch.empty(0, dtype=torch.float32).set_(storage, 0, tuple(shape))


def round_group_bits(round_: int) -> str:
    """hivemind group-key bits for a round: peers of different rounds can never be matched together."""
    return format(round_, "032b")


class DiLoCoPeer:
    """Global model + outer optimizer + hivemind averager of one peer.

    Args:
        model: the policy (any device/dtype); defines the parameter layout.
        config: the run config (outer optimizer ``[outer]``, network timeouts, compression).
        swarm: this peer's DHT records (its ``dht`` is used for the averager and the state transfer).
        start_round: the round this peer starts in (0, or the round of the state it loaded).
        holds_theta: False when ``model``'s weights are not the run's theta yet (a joining node's skeleton): the peer
            then serves no state (its manifest says so, lowest priority) until `load_state_from_peers` loaded theta,
            so that another joiner can never download a skeleton as the run's round-0 theta.
        base_sha256: the run's base model hash with full fine-tuning (`composer_diloco.policy.lora.base_sha256` of
            the ``--model`` weights theta started from), None when not known or not held (the embedded default's
            nodes start from a random skeleton). A LoRA peer's is computed from ``model`` (its frozen base).

    Attributes:
        transfer: this peer's `StateTransfer` (serves its state, downloads others').
        last_download: the `DownloadReport` of the last completed download (None before one).
        last_download_error: why the last download failed ("" when it did not).
        chunk_bytes: bytes per chunk this peer asks for in its downloads (a node's ``--state-chunk-size``).
        allreduce_timeout_s: seconds an all-reduce of this peer's pseudo-gradient may take, and a wait for others'
            (`NetworkConfig.allreduce_timeout_s`: grows with its bytes).
    """

    def __init__(self, model: nn.Module, config: RunConfig, swarm: Swarm, *, start_round: int = 0,
                 holds_theta: bool = True, base_sha256: str | None = None):
        self.config, self.swarm = config, swarm
        self.round = start_round
        self.holds_theta = holds_theta
        self.diverged_seen: set[tuple[str, int]] = set()  # (peer, round) already reported diverged (`_heal_split`)
        self._partnered_round = start_round - 1  # the last round whose barrier found partners (`_barrier`)
        self._lock = threading.Lock()  # guards theta and the outer state: writers, and every chunk a peer downloads
        self.last_download: DownloadReport | None = None
        self.last_download_error = ""
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        self._peer_names: dict[str, str] = {}  # base58 peer ID -> name, from heartbeats (`_download_candidates`)
        self.delta = [_shared_zeros(p.shape) for p in model.parameters() if p.requires_grad]
        # an all-reduce's (and a wait for one's) time limit grows with the pseudo-gradient's bytes
        self.allreduce_timeout_s = config.network.allreduce_timeout_s(sum(d.numel() * d.element_size()
                                                                          for d in self.delta))
        self._delta_written = False  # only zeros in it yet: the coordinator need not write them (`_pseudo_gradient`)
        # the run's codec (composer_diloco.outer.codec_contract): its wire half goes to the averager, its node half
        # (error feedback, for the sparse codecs) stays here, kept across resyncs, never shared
        self.codec = build_codec(config, [d.shape for d in self.delta])
        self.error_feedback = self.codec.node
        self._gather_extra: dict = {}  # the codec's entries of this round's gathered metadata (`_pseudo_gradient`)
        # hivemind forks its averager process here: before theta and the outer optimizer state exist, so that the
        # child does not keep copy-on-write pages of them (twice their memory, and a slow first outer step, on big
        # models)
        with keep_signal_handlers():
            self.averager = self._make_averager(swarm, config)
        self._lora_base = _lora_base_sha256(model)
        self.base_sha256 = self._lora_base or base_sha256
        # the coordinator never trains its model: theta can be its weights (one copy of theta less)
        self.global_model = GlobalModel(model, outer_optimizer=optimizer_factory(config.outer),
                                        share_storage=swarm.role == "coordinator")
        self.transfer = self._make_transfer(swarm)
        self._update_priority()

    def _make_averager(self, swarm: Swarm, config: RunConfig) -> ExactAverager:
        from composer_diloco.outer.auth import MembersOnlyAverager, averaging_prefix

        net = config.network
        # a closed run's averager has its own prefix and serves only peers that hold the run secret (auth.py)
        averager_type = ExactAverager if swarm.secret is None else MembersOnlyAverager
        return averager_type(
            self.delta,
            swarm.dht,
            prefix=averaging_prefix(config.run_name, swarm.secret),
            start=True,
            min_group_size=2,
            min_matchmaking_time=net.matchmaking_time_s,
            # below the matchmaking window, as hivemind's Matchmaking asks: two peers that request each other at once
            # wait on each other's lock until this timeout breaks the tie; at the window's length it took the whole
            # window, and the round's group did not form
            request_timeout=min(5.0, net.matchmaking_time_s / 2),
            allreduce_timeout=self.allreduce_timeout_s,
            next_chunk_timeout=min(10.0, net.averaging_timeout_s / 3),
            compression=self.codec.compression,
            max_norm_ratio=config.outer.max_norm_ratio,
            codec=self.codec.wire,
            declare_state_period=5.0,
            shutdown_timeout=5.0,
        )

    def _make_transfer(self, swarm: Swarm) -> StateTransfer:
        """This peer's state server and downloader, after hivemind forked the averager (its thread stays here)."""
        from composer_diloco.outer.auth import RunMembers

        prefix = self.averager.prefix
        members = None if swarm.secret is None else RunMembers(swarm.dht, prefix)
        return StateTransfer(swarm.dht, prefix, self.global_model, self._lock, self._describe, members=members,
                             name=swarm.name)

    # -- state sharing (late joiners, resync) -------------------------------------------------------
    def _describe(self) -> dict:
        """What a manifest says of this peer besides its tensors (`StateTransfer`; called under ``_lock``)."""
        return {"run": self.config.run_name, "round": self.round, "serves": self.holds_theta,
                "base_sha256": self.base_sha256, "layout": self.layout()}

    def _update_priority(self) -> None:
        # downloaders ask the highest priority first: the newest round, the coordinator among equals; a peer without
        # theta yet last (it would send nothing)
        self.averager.state_sharing_priority = -1.0 if not self.holds_theta else \
            self.round + (0.5 if self.swarm.role == "coordinator" else 0.0)

    @property
    def theta_lock(self) -> threading.Lock:
        """The lock that guards theta and the outer optimizer state: every writer holds it, and so does every chunk a
        peer downloads. Hold it to read or rebase against theta while a background round may step it
        (`composer_diloco.outer.overlap`)."""
        return self._lock

    def load_theta_into(self, model: nn.Module) -> None:
        """theta into ``model`` (any device/dtype), under `theta_lock` (a background round given up on may still
        step theta)."""
        with self._lock:
            self.global_model.load_into(model)

    def resume_at(self, round_: int) -> None:
        """Take ``round_`` as this peer's round after theta and the outer state were restored from a checkpoint
        (`composer_diloco.checkpoint.restore_outer_state`): the round its manifest and state-sharing priority say."""
        with self._lock:
            self.round = round_
        self._update_priority()

    def layout(self) -> list[list]:
        """``[[name, shape], ...]`` of the global params: what two peers of one run must share."""
        return [[n, list(p.shape)] for n, p in zip(self.global_model.names, self.global_model.params)]

    def load_state_from_peers(self, timeout_s: float, *, min_round: int | None = None,
                              peers: list[PeerRecord] | None = None, deadline_s: float | None = None,
                              chunk_bytes: int | None = None) -> bool:
        """Adopt theta, the outer optimizer state and round from the best live peer, or from ``peer``
        (`composer_diloco.outer.state_transfer`: only the tensors that differ from this peer's own travel, in chunks,
        resumed from another peer holding the same state when one fails).

        Args:
            timeout_s: seconds to find a peer that sends its manifest (its keepalives count while it hashes).
            min_round: ignore (do not load) a state older than this round.
            peers: download from these peers only, asked in this order (None: every serving peer, the newest round
                first, the coordinator first among equals).
            deadline_s: seconds for the whole download (None: ``timeout_s`` plus the bytes to move at
                ``network.state_min_rate_mb_s``).
            chunk_bytes: bytes per chunk (None: ``self.chunk_bytes``).
        Returns:
            True once the state is loaded (theta's sha256 checked); False when no peer sent a state of ``min_round``
            or later in time, or the download failed (``last_download_error`` says why). A failed download leaves
            theta as it was: a peer that holds theta downloads into new buffers and loads them all at once.
        Raises:
            ArchitectureMismatch: the peer's parameters differ from this model's (names the first difference), its
                outer optimizer state has another layout, or its base model has another ``base_sha256``.
        """
        net = self.config.network
        with self._lock:
            _, local = self.global_model.state()

        def local_sha256() -> list[str]:
            with self._lock:
                return self.global_model.tensor_sha256()

        try:
            manifest, tensors, report = self.transfer.download(
                lambda: self._download_candidates(peers), local=local, local_sha256=local_sha256,
                check=self._check_manifest,
                min_round=min_round, start_timeout_s=timeout_s, chunk_timeout_s=net.state_chunk_timeout_s,
                min_rate_bytes_s=net.state_min_rate_mb_s * 1e6, deadline_s=deadline_s,
                chunk_bytes=chunk_bytes or self.chunk_bytes, in_place=not self.holds_theta)
        except StateTransferError as e:
            self.last_download_error = str(e)
            log.warning("%s: %s", self.swarm.name, e)
            return False
        with self._lock:
            try:
                self.global_model.load_state(manifest.outer, tensors)
            except ValueError as e:
                raise ArchitectureMismatch(f"the run's global model state does not fit this peer's: {e}") from None
            sha = self.global_model.sha256()
            if sha != manifest.sha256:  # every tensor's hash was checked: this would be a bug, not a bad link
                raise RuntimeError(f"theta loaded from a peer hashes to {sha[:12]}, its manifest said "
                                   f"{manifest.sha256[:12]}")
            self.round = manifest.round
            self.holds_theta = True  # a joiner's skeleton is theta now: it may send it
        self._update_priority()
        self.last_download, self.last_download_error = report, ""
        log.info("%s loaded round %d state from a peer (sha256 %s): %s", self.swarm.name, self.round, sha[:12],
                 report.describe())
        return True

    def _check_manifest(self, manifest: Manifest) -> None:
        """Refuse a peer's state that can never fit this peer: another layout, base model or outer optimizer.

        Raises:
            ArchitectureMismatch: one line naming the first difference.
        """
        _check_layout(manifest.layout, self.layout())
        _check_base(manifest.base_sha256, self.base_sha256, lora=self._lora_base is not None)
        try:
            self.global_model.check_state_meta(manifest.outer)
        except ValueError as e:
            raise ArchitectureMismatch(f"the run's global model state does not fit this peer's: {e}") from None

    def _download_candidates(self, peers: list[PeerRecord] | None) -> list[tuple[str, str]]:
        """``[(peer id, name), ...]`` to ask for the state, best first: ``peers`` in their order, or the peers whose
        averagers declared themselves serving under ``{prefix}.all_averagers`` by priority (newest round, the
        coordinator first among equals; ties in random order), this peer left out."""
        # names by peer ID, for the log: kept from earlier reads (a read right after a peer died can come back
        # without some records)
        self._peer_names.update({p.peer_id: p.name for p in self.swarm.live_peers() if p.peer_id})
        names = self._peer_names
        if peers is not None:
            return [(p.peer_id, p.name) for p in peers if p.peer_id]
        from hivemind.p2p import PeerID

        found = self.swarm.dht.get(f"{self.averager.prefix}.all_averagers", latest=True)
        mine = self.swarm.dht.peer_id.to_base58()
        priority = {}
        for key, item in (found.value.items() if found is not None and isinstance(found.value, dict) else []):
            value = getattr(item, "value", None)
            if isinstance(key, bytes) and isinstance(value, (int, float)) and value >= 0:
                priority[PeerID(key).to_base58()] = float(value)
        order = sorted((p for p in priority if p != mine), key=lambda p: (-priority[p], random.random()))
        return [(p, names.get(p, p[:16])) for p in order]

    # -- one round ------------------------------------------------------------------------------------
    def sync(self, model: nn.Module | None, weight: float, stop: threading.Event | None = None) -> SyncResult | None:
        """End the current round: average pseudo-gradients, take the outer step, load theta into ``model``.

        Args:
            model: the locally trained policy (None on the coordinator: it contributes zeros).
            weight: samples this peer trained this round (0 on the coordinator).
            stop: set to abandon the barrier wait (shutdown); returns None then.
        Returns:
            A `SyncResult`, or None when stopped. A failed round is not an error: it ends "resynced" or "alone"
            (`_recover`; the failure cases are in `composer_diloco.outer.recovery`'s docstring).
        Raises:
            ArchitectureMismatch: a peer whose state this peer must take has another model.
        """
        result = self._sync(model, weight, stop)
        if model is not None:
            self._settle_feedback(result, weight)
        return result

    def _settle_feedback(self, result: SyncResult | None, weight: float) -> None:
        """A node's codec state: fold the round's outcome into it (`codec_contract.NodeState.settle`)."""
        if result is not None and self.error_feedback is not None:
            rule = self.error_feedback.settle(result.status, rejected=self.swarm.name in result.rejected,
                                              contributed=weight > 0)
            log.debug("%s round %d: error feedback %s", self.swarm.name, result.round, rule)

    # -- one round, in two halves (overlapped sync, `composer_diloco.outer.overlap`) -----------------------------
    def hand_off(self, model: nn.Module, weight: float) -> HandOff:
        """The first half of a round on a node, in the caller's thread: write Delta_i = theta - theta_i of ``model``
        into the averager's buffers (a copy: the policy may train on at once) and start the round's clock.

        Args:
            model: the locally trained policy at the end of its inner phase (read only).
            weight: samples it trained on this round.
        Returns:
            The `HandOff` that `complete` takes, in any thread, before the next `hand_off` or `sync`.
        """
        r = self.round
        clock = _RoundClock(start=time.monotonic(), bytes_before=self.averager.bytes_sent.value)
        norm = self._pseudo_gradient(model, r, weight)
        clock.lap("pseudo_gradient")
        return HandOff(round=r, weight=float(weight), norm=norm, clock=clock)

    def handed_off_weights(self) -> list[torch.Tensor]:
        """theta - Delta_i, read from the averager's buffers after `hand_off` and before `complete`: the node's local
        weights x_t at the hand-off (fp32 CPU tensors in theta's layout, equal to x_t up to fp32 rounding), rebuilt
        without reading the policy, so a background thread can make the overlapped mode's anchor
        (`composer_diloco.outer.overlap`) while the policy trains on. Only valid before the round's all-reduce,
        which overwrites the buffers with the mean."""
        with self._lock, self.averager.get_tensors() as delta:
            return [torch.sub(g, d) for g, d in zip(self.global_model.params, delta, strict=True)]

    def complete(self, handoff: HandOff, stop: threading.Event | None = None) -> SyncResult | None:
        """The second half of a handed-off round: heal check, barrier, all-reduce, outer step, as `sync` does, but
        theta is never loaded into a policy (the caller folds it in: `composer_diloco.outer.overlap`). Safe to run in
        a background thread while the policy trains: it reads and writes only the averager's buffers, theta, the
        outer optimizer state and this peer's DHT records.

        Returns:
            The round's `SyncResult` (a failed round ends "resynced" or "alone", as in `sync`), or None when stopped.
        Raises:
            ArchitectureMismatch: a peer whose state this peer must take has another model.
        """
        r, clock = handoff.round, handoff.clock
        result = self._heal_split(None, r, clock)
        clock.lap("heal_check")
        if result is None:
            result = self._reduce_and_step(None, r, handoff.weight, handoff.norm, clock, stop)
        self._settle_feedback(result, handoff.weight)
        return result

    def _sync(self, model: nn.Module | None, weight: float, stop: threading.Event | None) -> SyncResult | None:
        r = self.round
        clock = _RoundClock(start=time.monotonic(), bytes_before=self.averager.bytes_sent.value)
        healed = self._heal_split(model, r, clock)  # 0. replicas that disagree take the run's theta
        if healed is not None:
            return healed
        clock.lap("heal_check")
        norm = self._pseudo_gradient(model, r, weight)                        # 1. Delta_i = theta - theta_i
        clock.lap("pseudo_gradient")
        return self._reduce_and_step(model, r, weight, norm, clock, stop)

    def _reduce_and_step(self, model: nn.Module | None, r: int, weight: float, norm: float, clock: _RoundClock,
                         stop: threading.Event | None) -> SyncResult | None:
        """Steps 2 to 5 of round ``r`` (the pseudo-gradient is in the averager's buffers); ``model`` None: theta is
        not loaded into any policy."""
        try:
            barrier = self._barrier(r, weight, stop, clock)                   # 2. wait for the round's peers
            if barrier is None:
                return None  # stopped
            scheduled_time, partners = barrier
            clock.lap("barrier")
            if not partners:  # we are the whole swarm: theta moves by our own pseudo-gradient
                return self._step_alone(model, r, clock)
            reduced = self._all_reduce(r, weight, norm, scheduled_time,       # 3. Delta = sum_i w_i Delta_i / sum w
                                       group_size=len(partners) + 1, partners=partners)
            clock.lap("all_reduce")
            status = self._outer_step(r, reduced)                             # 4. theta <- OuterOpt(theta, Delta)
            if status == "averaged":  # whose phases reached theta: a member's next life reads it (its journal)
                self._record_averaged(r, [m for m in reduced.members if m not in reduced.rejected])
            clock.lap("outer_step")
        except RoundFailed as failure:
            log.warning("%s round %d: %s", self.swarm.name, r, failure.reason)
            return self._recover(model, r, clock)
        result = self._finish(model, clock, peers=len(reduced.members),        # 5. load theta into the policy
                              weight_total=reduced.weight_total, status=status, rejected=reduced.rejected,
                              reasons=reduced.reasons, members=reduced.members)
        if status == "averaged" and len(reduced.members) < len(partners) + 1 and \
                self._join_authority_after_split(r, reduced.members):  # matchmaking split the round
            return self._finish(model, clock, peers=0, status="resynced")
        if reduced.theta_authority is not None and self._take_group_authoritys_theta(r, reduced.theta_authority):
            return self._finish(model, clock, peers=0, status="resynced")  # we had trained from another theta
        return result

    def _pseudo_gradient(self, model: nn.Module | None, r: int, weight: float = 0.0) -> float:
        """Write Delta_i into the averager's buffers (zeros on the coordinator); returns its L2 norm (NaN/Inf
        when it has non-finite entries). With a codec that keeps node state (`codec_contract.NodeState`), a contributing
        node hands Delta_i to it: the codec may rewrite the buffers (error feedback), hand a message to the averager,
        and add entries to the round's gathered metadata; the norm is then what the codec says is averaged."""
        self._gather_extra = {}
        with self.averager.get_tensors() as delta:
            if model is None:
                if not self._delta_written:  # still the untouched shared zeros (`_shared_zeros`): keep them unmapped
                    return 0.0
                for d in delta:
                    d.zero_()
            else:
                self.global_model.pseudo_gradient(model, delta)
                faults.point("pseudo_gradient", r, tensors=delta)
            self._delta_written = True
            if self.error_feedback is None or model is None or weight <= 0:
                return pseudo_gradient_norm(delta)
            prepared = self.error_feedback.prepare_round(delta)
        if prepared.message is not None:
            self.averager.set_message(r, prepared.message)
        self._gather_extra = prepared.gather
        return prepared.norm

    def codec_state(self) -> dict | None:
        """This node's codec state for a checkpoint (`composer_diloco.checkpoint.save_checkpoint`'s ``codec_state``):
        its codec's `codec_contract.NodeState.state_dict` (error feedback), or None for a codec without one."""
        return None if self.error_feedback is None else self.error_feedback.state_dict()

    def load_codec_state(self, state: dict | None) -> None:
        """Adopt a `codec_state` (from `composer_diloco.checkpoint.read_codec_state`); None leaves it as it is.

        Raises:
            ValueError: a state of another codec or layout, or a state given to a run whose codec keeps none.
        """
        if state is None:
            return
        if self.error_feedback is None:
            raise ValueError(f"codec state of {state.get('codec')!r} given to a run with compression "
                             f"{self.config.compression!r}")
        self.error_feedback.load_state_dict(state)

    def _barrier(self, r: int, weight: float, stop: threading.Event | None,
                 clock: _RoundClock) -> tuple[float, list[str]] | None:
        """Announce this peer ready and wait for the round's peers (`Swarm.wait_for_round`).

        Returns:
            ``(scheduled_time, partners)``: the DHT time the all-reduce starts at and the names of the peers of
            round ``r`` to average with (the live coordinator, and the nodes that announced ready for round ``r`` and
            have not moved past it); empty partners = this peer is
            the whole swarm (believed after up to ``network.heartbeat_ttl_s`` of looking again when the previous round
            had partners). None when ``stop`` was set.
        Raises:
            RoundFailed: nobody to average with, and the swarm already finished round ``r`` without this peer.
        """
        net = self.config.network
        faults.point("barrier_entered", r)
        self.swarm.announce_ready(r, weight)  # the coordinator too: the nodes wait for it (`Swarm.wait_for_round`)
        barrier = self.swarm.wait_for_round(r, slack_s=net.round_slack_s, matchmaking_s=net.matchmaking_time_s,
                                            stop=stop)
        if barrier is None:
            return None
        scheduled_time, ready_nodes = barrier
        clock.waited = time.monotonic() - clock.start

        def partners() -> list[str]:
            # the coordinator by its heartbeat; a node by its ready record for round r, which is fresher evidence
            # than a heartbeat (one that lapsed under load hid a ready node, and its peers then averaged without
            # the one that could not see it), unless its heartbeat says it already moved past round r
            live = self.swarm.live_peers()
            past = {p.name for p in live if p.round > r}
            coordinators = {p.name for p in live if p.role == "coordinator" and p.round <= r}
            return sorted((coordinators | {n for n in ready_nodes if n not in past}) - {self.swarm.name})

        others = partners()
        # nobody, right after a round with partners: a DHT read comes back empty, or without a peer whose heartbeat
        # store outlasted its TTL, while a link is down or just back (seen around a partition's heal); stepping alone
        # then forks theta for a round. Look again for one heartbeat TTL before believing it (once: a peer that stays
        # alone does not pay it every round)
        deadline = time.monotonic() + net.heartbeat_ttl_s
        while not others and self._partnered_round == r - 1 and time.monotonic() < deadline and \
                not (stop is not None and stop.is_set()):
            time.sleep(0.25)
            others = partners()
        if not others and any(p.round > r for p in self.swarm.live_peers()):
            raise RoundFailed(f"the swarm finished round {r} without this peer")
        if others:
            self._partnered_round = r
        return scheduled_time, others

    def _all_reduce(self, r: int, weight: float, norm: float, scheduled_time: float,
                    group_size: int | None = None, partners: list[str] | None = None) -> _Reduced:
        """Average the pseudo-gradients of round ``r``'s group, weighted by samples; screening is applied (and
        its verdicts returned) by the averager, the same on every member.

        ``group_size``: the peers the barrier found (this one included): the group closes as soon as it holds that
        many (`ExactAverager.set_target_group_size`) instead of waiting out ``network.matchmaking_time_s``; a group
        that never gets that big forms at the end of the window with whoever came, as before. ``partners``: their
        names; a step still looking for a group once none of them is left in round ``r`` is given up (`_await_step`).

        Raises:
            RoundFailed: no group formed (or a group of one), the all-reduce failed, or the group held no weight.
        """
        self._delta_written = True  # the all-reduce leaves its mean in the buffers
        self.averager.set_group_bits(round_group_bits(r))
        self.averager.set_target_group_size(group_size if group_size and group_size >= 2 else None)
        began = get_dht_time()
        # a joiner reading this takes the next round (`joins_round`): this group can no longer take a member
        self.swarm.set_info(publish=True, averaging_round=r)
        try:
            control = self.averager.step(
                weight=float(weight),
                gather={"name": self.swarm.name, "role": self.swarm.role, "round": r, "weight": float(weight),
                        "norm": norm, "theta": self.swarm.sha, **self._gather_extra},
                scheduled_time=scheduled_time,
                timeout=self.allreduce_timeout_s,
                allow_retries=False,
                wait=False,
            )
            gathered: dict[object, Contribution] | None = self._await_step(control, r, partners or [])
        except Exception as e:
            raise RoundFailed(f"all-reduce failed: {e!r}") from e
        if not gathered or len(gathered) == 1:
            raise RoundFailed("no all-reduce group formed")
        members = list(gathered.values())
        group = [c.metadata if isinstance(c.metadata, dict) else {} for c in members]
        if self.error_feedback is not None:  # what the codec sent of ours may depend on the group (shared-blocks)
            self.error_feedback.observe(group, {i for i, c in enumerate(members) if c.rejection is not None})
        if {g.get("round") for g in group} != {r}:
            log.error("%s round %d: group mixed rounds %s", self.swarm.name, r, {g.get("round") for g in group})
        for c in members:
            if c.rejection is not None:
                log.warning("%s round %d: dropped the pseudo-gradient of %s: %s", self.swarm.name, r,
                            c.rejection.name, c.rejection.reason)
        rejected = [c.rejection.name for c in members if c.rejection is not None]
        weight_total = sum(float(g.get("weight", 0.0)) for g, c in zip(group, members) if c.rejection is None)
        if weight_total <= 0 and not rejected:
            raise RoundFailed("the all-reduce group holds no weight")
        mine = next((c.rejection for c in members if c.rejection is not None and c.rejection.name == self.swarm.name),
                    None)
        return _Reduced(members=[str(g.get("name")) for g in group], weight_total=weight_total, rejected=rejected,
                        missed=int(self.averager.failed_size.value),
                        reasons={c.rejection.name: c.rejection.reason for c in members if c.rejection is not None},
                        theta_authority=mine.theta_authority if mine is not None else None, began=began)

    def _await_step(self, control: StepControl, r: int, partners: list[str], poll_s: float = 0.25) -> Any:
        """The all-reduce step's result (`ExactAverager.step`, hivemind's ``StepControl``), or its cancellation
        once it is still looking for a group (hivemind's ``AveragingStage.LOOKING_FOR_GROUP``) for 1 s after no
        partner of the barrier is left in round ``r`` (their heartbeats say a later round, or expired:
        `Swarm.still_in_round`): their group closed without this peer (`set_target_group_size`), and hivemind would
        search out the step's whole timeout (``allreduce_timeout_s``, 45 s at the default: seen under churn,
        `bench/churn.py`). The caller then recovers as after any failed all-reduce (`_recover`). A step that found
        its group is never cancelled.

        Raises:
            concurrent.futures.CancelledError: it was given up; else whatever the step raises (no group within its
                timeout, a failed all-reduce).
        """
        given_up_at: float | None = None
        while True:
            try:  # returns the moment the step ends (a sleep first cost every all-reduce up to ``poll_s``)
                return control.result(timeout=poll_s)
            except TimeoutError:
                if control.done():  # the step's own TimeoutError (no group in time), not the wait's
                    raise
            if not partners or control.stage != AveragingStage.LOOKING_FOR_GROUP:
                given_up_at = None
                continue
            try:
                left = self.swarm.still_in_round(r, partners)
            except Exception as e:  # a failed read decides nothing
                log.debug("%s round %d: reading heartbeats failed: %r", self.swarm.name, r, e)
                continue
            if left:
                given_up_at = None
            elif given_up_at is None:
                given_up_at = time.monotonic()
            elif time.monotonic() - given_up_at >= 1.0 and control.cancel():
                log.warning("%s round %d: %s finished the round without this peer's group: no longer looking for "
                            "one", self.swarm.name, r, ", ".join(partners))

    def _outer_step(self, r: int, reduced: _Reduced) -> SyncStatus:
        """theta <- OuterOpt(theta, Delta) and advance to round ``r + 1``; a Delta that missed elements is settled
        with the group (`_settle`). Every contribution dropped: theta unchanged ("skipped").

        Raises:
            RoundFailed: Delta holds NaN/Inf (the outer step refused it; theta and round unchanged).
        """
        if reduced.weight_total <= 0:
            log.warning("%s round %d: no contribution left after screening: theta unchanged", self.swarm.name, r)
            with self._lock:
                self.round = r + 1
            return "skipped"
        try:
            # Delta is the step's gradient where the all-reduce left it, in the averager's buffers: no copy of theta's
            # size (the next round's pseudo-gradient overwrites them). Lock order as in `handed_off_weights`
            # downloads of our state in flight end first (at most network.state_hold_s): theta moves under them
            with self.transfer.hold_writes(self.config.network.state_hold_s), self._lock, \
                    self.averager.get_tensors() as delta:
                self.global_model.outer_step(delta)
                self.round = r + 1
        except ValueError as e:
            raise RoundFailed(str(e)) from e
        if reduced.missed:
            return self._settle(set(reduced.members), r, reduced.missed, began=reduced.began)
        return "averaged"

    def _finish(self, model: nn.Module | None, clock: _RoundClock, *, peers: int, status: SyncStatus,
                weight_total: float = 0.0, rejected: list[str] | None = None, reasons: dict[str, str] | None = None,
                members: list[str] | None = None) -> SyncResult:
        """Step 5: load theta into ``model``, publish the new round and theta's hash, and report the round."""
        clock.lap("recovery")  # what ran since the last part counted: a failed round's way back, or nothing
        if model is not None:
            self.global_model.load_into(model)
        clock.lap("load")
        self._update_priority()
        sha = self.global_model.sha256()
        self.swarm.set_round(self.round, sha=sha)
        clock.lap("publish")
        return SyncResult(
            round=self.round - 1, peers=peers, weight_total=weight_total, sync_seconds=time.monotonic() - clock.start,
            wait_seconds=clock.waited, bytes_sent=int(self.averager.bytes_sent.value - clock.bytes_before),
            global_sha256=sha, status=status, rejected=list(rejected or []),
            phase_seconds={k: round(v, 4) for k, v in clock.phases.items() if v >= 5e-5},
            rejected_reasons=dict(reasons or {}), members=list(members or []),
        )

    # -- carrying out recovery's decisions (`composer_diloco.outer.recovery` decides) ------------------------------
    def _others(self) -> list[PeerRecord]:
        """The live peers' heartbeats, this peer's left out."""
        return [p for p in self.swarm.live_peers() if p.name != self.swarm.name]

    def _recover(self, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult:
        """Round ``r`` ended without an average for this peer: poll `recovery.after_failed_round` every 0.25 s and
        carry it out, at most ``allreduce_timeout_s`` (the others may be in a long all-reduce); then step alone.

        Returns:
            The round's `SyncResult`: "resynced" (a peer's state was loaded, ``peers`` 0), else as `_step_alone`.
        Raises:
            ArchitectureMismatch: from `load_state_from_peers`.
        """
        me, timeout_s = self.swarm.name, self.allreduce_timeout_s
        deadline = time.monotonic() + timeout_s
        # unsettled while waiting for a state, so that a member settling its own theta does not wait for us
        self.swarm.set_round(r, sha=self.swarm.sha, settled=False)
        while time.monotonic() < deadline:
            decision = recovery.after_failed_round(self.swarm.role, me, r, self._others(),
                                                   late=time.monotonic() > deadline - timeout_s / 3)
            if isinstance(decision, recovery.StepAlone):
                break
            if isinstance(decision, recovery.Resync) and self._load_from_first(decision):
                return self._finish(model, clock, peers=0, status="resynced")
            time.sleep(0.25)
        log.warning("%s round %d: no peer ahead of us; applying our own pseudo-gradient", me, r)
        return self._step_alone(model, r, clock)

    def _step_alone(self, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult:
        """Apply this peer's own pseudo-gradient (what the averager's buffers hold) and end round ``r``.

        Returns:
            A `SyncResult` with ``peers`` 1 and status "alone", or "skipped" when that pseudo-gradient is non-finite
            (theta unchanged; the round ends all the same).
        """
        status: SyncStatus = "alone"
        with self._lock, self.averager.get_tensors() as own:  # the buffers are the step's gradient (no copy)
            try:
                self.global_model.outer_step(own)
            except ValueError as e:  # our own pseudo-gradient is non-finite: keep theta
                log.error("%s round %d: %s; theta unchanged", self.swarm.name, r, e)
                status = "skipped"
            self.round = r + 1
        if status == "alone":
            self._record_averaged(r, [self.swarm.name])
        return self._finish(model, clock, peers=1, status=status)

    def _record_averaged(self, r: int, members: list[str]) -> None:
        """`Swarm.record_averaged` of round ``r``'s ``members``. A failed store is a DEBUG line: every member (the
        coordinator among them) stores the same record, and only where all of them failed would a member's next life
        find none and re-send a phase that reached theta."""
        try:
            self.swarm.record_averaged(r, members)
        except Exception as e:
            log.debug("%s round %d: recording the round's members failed: %r", self.swarm.name, r, e)

    def _heal_split(self, model: nn.Module | None, r: int, clock: _RoundClock) -> SyncResult | None:
        """Before round ``r``'s sync: carry out `recovery.split_check` (take the authority's state if this peer's
        theta left the run's lineage; as the authority, log each peer found diverged once per peer and round).

        Returns:
            None when nothing was healed (the sync goes on; also when the authority did not answer: tried again at
            the next sync), else the round's `SyncResult` with status "resynced".
        Raises:
            ArchitectureMismatch: from `load_state_from_peers`.
        """
        me = self.swarm.name
        decision = recovery.split_check(self.swarm.role, me, self.swarm.history, self._others())
        if isinstance(decision, recovery.Proceed):
            for name, at, theirs, ours in decision.diverged:  # we are the authority: they take our theta
                if (name, at) not in self.diverged_seen:
                    self.diverged_seen.add((name, at))
                    log.warning("%s round %d: replicas disagree: %s's theta at round %d is %s, ours was %s (a "
                                "partition, or peers that stepped alone); it takes our state at its next sync", me, r,
                                name, at, theirs[:12], ours[:12])
            return None
        if not self._load_from_first(decision):
            return None
        return self._finish(model, clock, peers=0, status="resynced")

    def _take_group_authoritys_theta(self, r: int, authority: str) -> bool:
        """Right after round ``r``'s outer step, when the group dropped this peer's pseudo-gradient because it trained
        from another theta than ``authority`` held: carry out `recovery.after_theta_rejected` (`_await_resync`).

        Returns:
            True when the authority's state was loaded (the caller ends the round "resynced"); False otherwise
            (`_heal_split` checks again at the next sync).
        Raises:
            ArchitectureMismatch: from `load_state_from_peers`.
        """
        me, ours = self.swarm.name, self.global_model.sha256()
        log.warning("%s round %d: this peer trained from another theta than %s, the group's authority: its "
                    "pseudo-gradient was dropped; taking %s's theta of round %d", me, r, authority, authority, r + 1)
        decision = self._await_decision(lambda: recovery.after_theta_rejected(r, authority, ours, self._others()))
        if isinstance(decision, recovery.Wait):
            log.warning("%s round %d: %s did not publish its theta of round %d in %.0f s: checking again at the "
                        "next sync", me, r, authority, r + 1, self.allreduce_timeout_s)
        return isinstance(decision, recovery.Resync) and self._load_from_first(decision)

    def _await_decision(self, decide: Callable[[], recovery.Decision]) -> recovery.Decision:
        """Poll a recovery rule every 0.25 s until it says `Proceed` or `Resync`, at most ``allreduce_timeout_s``.

        Returns:
            that decision, or the last `Wait` when the deadline passed first.
        """
        deadline = time.monotonic() + self.allreduce_timeout_s
        while True:
            decision = decide()
            if not isinstance(decision, recovery.Wait) or time.monotonic() >= deadline:
                return decision
            time.sleep(0.25)

    def _join_authority_after_split(self, r: int, members: list[str]) -> bool:
        """Right after round ``r``'s outer step in a group smaller than the barrier's peers: carry out
        `recovery.after_group_split` (`_await_decision`). This peer's own theta of round ``r + 1`` is already
        published (settled), so an authority that found no group at all takes it (`_recover`) instead of stepping
        alone, and then holds the same theta.

        Returns:
            True when the authority's state was loaded (the caller ends the round "resynced"); False when nothing was
            to heal, or the authority did not answer in time (`_heal_split` tries again at the next sync).
        Raises:
            ArchitectureMismatch: from `load_state_from_peers`.
        """
        me, ours = self.swarm.name, self.global_model.sha256()
        decision = self._await_decision(
            lambda: recovery.after_group_split(self.swarm.role, me, r, members, ours, self._others()))
        if isinstance(decision, recovery.Resync):
            log.warning("%s round %d: matchmaking split the round: this peer averaged with %s only, and %s (the run's "
                        "authority) with others, so their thetas differ; taking its state (the pseudo-gradients of "
                        "this peer's group are dropped for this round)", me, r, ", ".join(sorted(members)),
                        decision.candidates[0].name)
            return self._load_from_first(decision)
        if isinstance(decision, recovery.Wait):
            log.warning("%s round %d: averaged in a group of %d, and %s did not publish its theta in %.0f s: checking "
                        "again at the next sync", me, r, len(members), decision.waiting_for or "the authority",
                        self.allreduce_timeout_s)
        return False

    def _settle(self, members: set[str], r: int, missed: int, began: float = float("inf")) -> SyncStatus:
        """After an all-reduce of round ``r`` that missed ``missed`` elements: publish theta as unsettled, poll
        `recovery.settle_pick` every 0.1 s (its wait ends after ``allreduce_timeout_s``) and take the pick's theta.
        ``began``: DHT time the all-reduce began (a member's life that entered round ``r`` later is not waited for).

        Returns:
            "averaged" (this peer's theta was kept or already equal), "resynced" (the pick's state was downloaded), or
            "unsettled" (members hold another theta and none of them sent it: this peer keeps its own, which differs;
            logged as an ERROR. Before a later round `_heal_split` brings it back; after the run's last it stays).
        Raises:
            ArchitectureMismatch: from `load_state_from_peers`.
        """
        me, ours = self.swarm.name, self.global_model.sha256()
        log.warning("%s round %d: the all-reduce returned no average for %d elements (a peer was lost mid-way): "
                    "settling theta with the group", me, r, missed)
        self._update_priority()
        self.swarm.set_round(r + 1, sha=ours, settled=False)
        deadline = time.monotonic() + self.allreduce_timeout_s
        while True:
            decision = recovery.settle_pick(self.swarm.role, me, members, r, ours, self.swarm.live_peers(),
                                            timed_out=time.monotonic() > deadline, began=began)
            if isinstance(decision, recovery.Resync):
                break
            time.sleep(0.1)
        if self._load_from_first(decision):
            return "resynced"
        if decision.candidates:  # members hold another theta and none of them sent it (gone): ours stays different
            log.error("%s round %d: replicas disagree: none of %s sent its theta (gone?), so this peer keeps its own "
                      "(sha256 %s), in which %d elements missed the group's average; the round is recorded as "
                      "\"unsettled\"", me, r, ", ".join(f"{p.name} (sha256 {p.sha[:12]})" for p in decision.candidates),
                      ours[:12], missed)
            return "unsettled"
        return "averaged"

    def _load_from_first(self, decision: recovery.Resync) -> bool:
        """Load the state of the first of ``decision.candidates`` that sends one, in their order, in one download:
        a candidate that just died (its heartbeat outlives it) refuses the connection and the next is asked at once,
        instead of after a whole ``averaging_timeout_s`` of asking the dead one again; one alive but slow (hashing)
        is waited for as before. False if none did. A candidate whose published hashes differ from ours at a common
        round is another lineage (a split): that is logged, and once its state is loaded our history restarts from
        it. Raises ArchitectureMismatch (`load_state_from_peers`)."""
        picks = list(decision.candidates)
        if not picks:
            return False
        diverged = {p.name: first_divergence(self.swarm.history, recovery.lineage(p)) for p in picks}
        log.warning("%s: taking the theta of %s", self.swarm.name, ", else ".join(
            f"{p.name} (round {p.round}, sha256 {p.sha[:12]})" for p in picks))
        if not self.load_state_from_peers(self.config.network.averaging_timeout_s, min_round=decision.min_round,
                                          peers=picks):
            log.warning("%s: %s did not send its state", self.swarm.name, " nor ".join(p.name for p in picks))
            return False
        source = next((p for p in picks if p.name == self.last_download.sources[0]), None)  # whose state it is
        at = diverged.get(source.name) if source is not None else None
        if at is not None:
            log.error("%s: split detected: %s's theta at round %d was %s, this peer's %s (the run was partitioned, or "
                      "peers stepped alone): replicas must not disagree", self.swarm.name, source.name, at,
                      recovery.lineage(source)[at][:12], self.swarm.history[at][:12])
            self.swarm.history.clear()  # the rounds trained since the split are not the run's
        return True

    # -- joining and leaving --------------------------------------------------------------------------------------
    def join_at_round_boundary(self, *, join_grace_s: float, timeout_s: float, stop: threading.Event,
                               intended: int | None = None) -> int:
        """Bring a joining peer to the round the swarm is in, right before its first inner phase.

        First the newest state of any live peer past ours (a joiner whose set-up outlasted a round). Then, if that
        round has been underway for more than ``join_grace_s`` seconds (`swarm.joins_round`), wait for the swarm to
        finish it (`recovery.round_over`) and take the next round's state, so that a late joiner never holds the
        others up for long. Had the others already passed the barrier when it arrives anyway, `sync` takes their
        state (`_recover`). A peer that announced at the start of its set-up which round it joins
        (`Swarm.announce_joining`, by the same rule) joins that round however long its set-up took (the others wait
        for it at that round's barrier), unless a peer already began that round's all-reduce: the group is closed,
        and the peer would train the round only to find no group, while the others waited for it at the next round's
        barrier. A late joiner (``swarm.joined_late``: the swarm was past its first round) is not waited for while it
        sets up: it also takes the next round boundary when another node announced round r ready.

        Args:
            join_grace_s: seconds a round may have been underway for this peer to still join it.
            timeout_s: seconds to wait for a peer's state per download.
            stop: set to give up waiting (shutdown).
            intended: the round `Swarm.announce_joining` returned (None: decide by the round's age now).
        Returns:
            The newest round a live peer was in: ``>= config.rounds`` means the run ended while this peer joined.
        Raises:
            ArchitectureMismatch: from `load_state_from_peers`.
        """
        newest = max((p.round for p in self._others()), default=self.round)
        if newest >= self.config.rounds:
            return newest  # the others are leaving: nothing to join
        if newest > self.round:
            log.info("%s: the swarm is at round %d, past our round %d: downloading its state", self.swarm.name,
                     newest, self.round)
            self.load_state_from_peers(timeout_s, min_round=newest)
        r, others = self.round, self._others()
        began = all_reduce_began(others, r)
        # a late joiner (`Swarm.announce_joining`) is waited for only from its first inner phase on: once a node of
        # round r is ready, r's barrier may close without it (`Swarm.wait_for_round`)
        ready = [] if began or not self.swarm.joined_late else sorted(
            n for n, v in self.swarm.ready_peers(r).items() if n != self.swarm.name and v.get("role") == "node")
        if r == intended and not began and not ready:
            return newest  # the barrier of round r waits for us: we said so when our set-up began
        if r != intended and not ready and joins_round(others, r, join_grace_s, get_dht_time()):
            return newest  # the others wait for us at the barrier
        if began:  # our set-up outlasted the round: its group closed, it can take no member
            log.info("round %d's all-reduce began while this node set up: joining at the next round boundary", r)
        elif ready:  # the barrier does not wait for a late joiner's set-up: the round may close any moment
            log.info("round %d: %s ready while this node set up: joining at the next round boundary", r,
                     ", ".join(ready))
        else:
            log.info("round %d has been underway for more than %.0f s: joining at the next round boundary", r,
                     join_grace_s)
        while not stop.is_set() and not recovery.round_over(r, self._others()):
            time.sleep(0.5)
        deadline = time.monotonic() + self.config.network.averaging_timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            if self.load_state_from_peers(timeout_s, min_round=r + 1):
                break
            time.sleep(0.5)
        return max(newest, self.round)

    def serve_until_settled(self, stop: threading.Event, timeout_s: float) -> list[str]:
        """At the run's end, keep this peer up, its state served, while a live peer may still need it
        (`recovery.waiting_at_run_end`), at most ``timeout_s`` seconds or until ``stop`` is set.

        A peer that exited at once could leave a peer still finishing the last round with no state to take: it would
        keep an incomplete theta (`_settle`) or step alone (`_recover`), and the run would end with two thetas. Its
        own all-reduce returns only once its parts are out (`composer_diloco.outer.averaging`), but a peer that missed
        a part for another reason (a third peer lost mid-way) still takes a member's state after it.

        Returns:
            The names of the peers still waited for when it stopped (logged as a WARNING), empty when none was left.
        """
        def waiting() -> list[str]:
            try:
                return recovery.waiting_at_run_end(self.swarm.name, self.config.rounds, self.swarm.live_peers())
            except Exception as e:  # the DHT is shutting down
                log.debug("%s: reading heartbeats failed at the run's end: %r", self.swarm.name, e)
                return []

        deadline = time.monotonic() + timeout_s
        left = waiting()
        while left and not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.2)
            left = waiting()
        if left and not stop.is_set():
            log.warning("%s at the run's end: %s had not finished round %d when this peer stopped waiting (%.0f s)",
                        self.swarm.name, ", ".join(left), self.config.rounds - 1, timeout_s)
        return left

    def shutdown(self) -> None:
        """Stop serving state and the averager process (idempotent)."""
        self.transfer.close()
        try:
            self.averager.shutdown()
        except Exception as e:  # already stopped
            log.debug("averager shutdown: %r", e)
