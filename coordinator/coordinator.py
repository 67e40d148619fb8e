"""The coordinator life cycle: bootstrap the DHT, publish the config, hold the canonical model, checkpoint it.

Per round it joins the all-reduce with weight 0 (`DiLoCoPeer.sync(None, 0.0)`): it receives the nodes' mean
pseudo-gradient without moving it and applies the same outer step, so its theta is the run's canonical one.

Idle watch: while it serves, a thread (`IdleWatch`) looks at the live heartbeats once a second. Once no node has been
alive for ``idle_log_s`` seconds it logs what it waits for (the live peers, its round, when a node was last alive),
again every ``idle_log_s`` seconds; with ``max_idle_s`` set it ends the run after that many seconds without a node:
`Coordinator.serve` returns and ``idle_error`` holds the one-line reason (`composer-coordinator start` exits 1 with it).

Restarts: the nodes do not need the coordinator to go on averaging, so a coordinator that died comes back with
the same command (or ``--resume``) and the same ``--run-dir``. Its libp2p key lives in the run dir
(`composer_diloco.outer.identity`), so it comes back with the same peer ID, and with the same ``--listen`` the same
``peer:`` line: nodes started later on the line it printed first still reach it. It dials the nodes it last saw
(``peers.json``), downloads their state when it is newer than its newest checkpoint, and checkpoints from there. One
coordinator per run dir: a second is refused while the first holds the run dir's lock.

No success on nothing: a run whose rounds all ended without moving theta (``unchanged_error``) makes
``composer-coordinator start`` exit 1 with the reason, as a node that trained on nothing does.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from composer_diloco.config import ConfigError, RunConfig, config_diff
from composer_diloco.diloco import follow_rounds
from composer_diloco.outer.peer import DiLoCoPeer, SyncResult
from composer_diloco.lifecycle import GracefulStop
from composer_diloco.metrics import MetricsWriter
from composer_diloco.report import Reporter, check_trackers
from composer_diloco.outer.identity import IDENTITY_FILE, load_or_create_identity, try_lock
from composer_diloco.outer.known_peers import KNOWN_PEERS_FILE, read_known_peers, write_known_peers
from composer_diloco.outer.swarm import NoPeerAnswered, Swarm, publish_config, start_dht, visible_multiaddr
from composer_diloco.checkpoint import (
    CheckpointError, latest_checkpoint, read_outer_state, restore_outer_state, save_checkpoint,
)
from coordinator.status import round_facts

log = logging.getLogger(__name__)

PEER_NAME = "coordinator"


@dataclass
class CoordinatorOptions:
    """The `composer-coordinator start` options.

    Attributes:
        config: the validated run config.
        run_dir: checkpoints and ``coordinator/metrics.jsonl`` go here (the embedded default's warm start is
            cached per user: ``composer_diloco.policy.load.warmstart_cache_dir``).
        listen: multiaddr to listen on (default: 127.0.0.1, a free TCP port).
        announce: multiaddrs other machines should dial (for a public address behind NAT).
        resume: continue from the newest checkpoint in ``run_dir`` (theta, outer optimizer state, round), even with a
            changed config (e.g. more rounds); without it a run dir that holds checkpoints of the same config is
            continued, and one of another config is refused.
        secret: the run secret that closes the run, as read by `composer_diloco.outer.secret.load_secret` from
            ``--secret-file`` or ``$COMPOSER_DILOCO_SECRET`` (None: an open run). Never logged or written.
        max_idle_s: seconds without a live node (no node heartbeat) after which the run ends with an error; None =
            wait for nodes forever.
        idle_log_s: seconds without a live node before the coordinator logs what it waits for, and between two
            such lines.
    """

    config: RunConfig
    run_dir: Path
    listen: str | None = None
    announce: list[str] | None = None
    resume: bool = False
    secret: bytes | None = field(default=None, repr=False)  # never in a repr or a log line
    max_idle_s: float | None = None
    idle_log_s: float = 60.0


class IdleWatch:
    """Watches the swarm's heartbeats for live nodes while the coordinator serves (see module docstring).

    Args:
        swarm: the coordinator's swarm records (`Swarm.live_peers`).
        current_round: returns the round the coordinator is in.
        stop: set when ``max_idle_s`` passes without a live node (the serve loop's stop event).
        max_idle_s: seconds without a live node before giving up; None = never.
        idle_log_s: seconds without a live node before the first waiting line, and between two of them.
        poll_s: seconds between two looks at the heartbeats.
        on_nodes: called with the live nodes' multiaddrs whenever that set changes (the coordinator keeps
            ``peers.json`` current with it, so a restart dials the nodes alive when it died, not those of its last
            round); None: not called.

    Attributes:
        error: None, or the one-line reason once it gave up (``"no node alive for S s since round R: ..."``).

    A node counts as alive while its heartbeat has not expired, so a killed node is seen gone ``heartbeat_ttl_s``
    after its death at most. A failed DHT read counts as "no change" (logged at debug), never as an idle second.
    """

    def __init__(self, swarm: Swarm, current_round, stop: threading.Event, *, max_idle_s: float | None,
                 idle_log_s: float, poll_s: float = 1.0, on_nodes=None):
        self.swarm, self.current_round, self.stop, self.on_nodes = swarm, current_round, stop, on_nodes
        self._node_maddrs: set[str] = set()
        self.max_idle_s, self.idle_log_s, self.poll_s = max_idle_s, idle_log_s, poll_s
        self.error: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_alive = time.monotonic()
        self._last_seen = "no node was seen yet"

    def start(self) -> IdleWatch:
        """Start the watch thread (the idle clock starts now)."""
        self._last_alive = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="idle-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the watch thread (idempotent)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        next_log = self.idle_log_s
        while not self._done.wait(self.poll_s) and not self.stop.is_set():
            try:
                peers = self.swarm.live_peers()
            except Exception as e:  # the DHT is shutting down or slow: look again next time
                log.debug("idle watch: reading heartbeats failed: %r", e)
                continue
            now = time.monotonic()
            nodes = [p for p in peers if p.role == "node"]
            maddrs = {p.maddr for p in nodes if p.maddr}
            if self.on_nodes is not None and maddrs and maddrs != self._node_maddrs:
                self._node_maddrs = maddrs
                try:
                    self.on_nodes(sorted(maddrs))
                except OSError as e:  # a full disk must not end the watch
                    log.warning("could not record the live nodes: %s", e)
            if nodes:
                self._last_alive, next_log = now, self.idle_log_s
                self._last_seen = "last seen: " + ", ".join(f"{p.name} at round {p.round}" for p in nodes)
                continue
            idle_s = now - self._last_alive
            names = ", ".join(sorted(p.name for p in peers)) or "none"
            if self.max_idle_s is not None and idle_s >= self.max_idle_s:
                self.error = (f"no node alive for {self.max_idle_s:g} s since round {self.current_round()}: "
                              f"live peers {names}; {self._last_seen}; restart the nodes (`composer-node join "
                              f"--peer ...`) and this coordinator with --resume, or raise --max-idle")
                self.stop.set()
                return
            if idle_s >= next_log:
                log.warning("waiting for nodes at round %d: no node alive for %.0f s (live peers: %s; %s)%s",
                            self.current_round(), idle_s, names, self._last_seen,
                            "" if self.max_idle_s is None else f"; giving up after {self.max_idle_s:g} s")
                next_log += self.idle_log_s


class CoordinatorBusy(RuntimeError):
    """Another coordinator holds the run dir (`Coordinator._lock_run_dir`)."""


class Coordinator:
    """A running coordinator: `start`, then `serve` until the last round, then `close`."""

    def __init__(self, options: CoordinatorOptions, stop: GracefulStop):
        self.options, self.stop = options, stop
        self.config = options.config
        self.run_dir = Path(options.run_dir)
        self._new_identity = False  # the identity key was made by this start: nobody else can hold it
        self.metrics = MetricsWriter(self.run_dir / PEER_NAME / "metrics.jsonl")
        self.dht = None
        self.swarm: Swarm | None = None
        self.peer: DiLoCoPeer | None = None
        self.secret = options.secret  # the run secret (never logged or written); None = an open run
        self.idle_error: str | None = None  # set when the run ended for want of nodes (`IdleWatch`)
        self.unchanged_error: str | None = None  # set when the run's rounds left theta as it was (`serve`)

    @property
    def end_error(self) -> str | None:
        """Why a run that was not stopped by a signal did not succeed (``idle_error`` or ``unchanged_error``)."""
        return self.idle_error or self.unchanged_error

    def start(self) -> str:
        """Load (or warm-start) the policy, start the DHT, publish the config; returns the peer multiaddr."""
        from composer_diloco.policy import load_policy, load_run_policy
        from composer_diloco.policy.context_length import check_context_length

        config = self.config
        check_trackers(config)  # a [report] tracker that is not installed fails before the model and the network
        if config.tasks.path is not None:  # a [tasks] dataset that cannot serve the nodes fails before the model
            from composer_diloco.rollout.tasks import TaskSet

            TaskSet.load(config.tasks)
        checkpoint = self._continue_point()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        load_or_create_identity(self.run_dir / IDENTITY_FILE, create=False)  # a bad key fails before the model
        if checkpoint is None or config.lora is not None:  # LoRA: a checkpoint holds the adapters, not the base
            self.model, self.tokenizer = load_run_policy(config)
        else:
            self.model, self.tokenizer = load_policy(str(checkpoint), seed=0, warmstart_steps=0)
        check_context_length(config.max_seq_len, self.model.config, config.model)  # before any network
        if config.lora is not None:  # before any network: a [lora] that does not fit the model fails here
            from composer_diloco.policy.lora import apply_lora, load_adapters

            self.model = apply_lora(self.model, config.lora)
            if checkpoint is not None:
                load_adapters(self.model, checkpoint)
        self._lock_run_dir()  # from here on the run dir is this process's: its first write is the next line
        self._new_identity = not (self.run_dir / IDENTITY_FILE).exists()
        peer_id = load_or_create_identity(self.run_dir / IDENTITY_FILE)
        log.info("peer ID %s (its key: %s)", peer_id, self.run_dir / IDENTITY_FILE)
        (self.run_dir / "config.json").write_text(config.to_json())
        self.dht = self._start_dht(known_peers=self._known_peers() if checkpoint is not None else [])
        self.stop.add_cleanup(self.dht.shutdown)  # hivemind's shutdown is idempotent
        self.swarm = Swarm(self.dht, run_name=config.run_name, peer_name=PEER_NAME, role="coordinator",
                           secret=self.secret)
        self.peer = DiLoCoPeer(self.model, config, self.swarm, base_sha256=self._model_sha256(checkpoint))
        self.stop.add_cleanup(self.peer.shutdown)
        newer_live_state = False
        if checkpoint is not None:
            self._load_outer_state(checkpoint)
            gc.collect()  # the checkpoint's memory-mapped outer.pt is let go now, not at some later GC cycle
            newer_live_state = self._reload_from_live_nodes(checkpoint)
        publish_config(self.dht, config)
        self.metrics.reporter = Reporter(config, peer=PEER_NAME, role="coordinator")
        self.stop.add_cleanup(self.metrics.reporter.finish)
        self.swarm.set_info(device="cpu", precision="fp32", phase="sync")  # `composer-coordinator status`
        self.swarm.start_heartbeat(config.network.heartbeat_s, config.network.heartbeat_ttl_s)
        if checkpoint is None or newer_live_state:  # a resumed run's starting point is already a checkpoint
            self._save()
        return visible_multiaddr(self.dht)

    def _model_sha256(self, checkpoint: Path | None) -> str | None:
        """A full-fine-tuning ``--model`` run's base, the weights theta started from (every joiner that loaded the
        same ``--model`` holds it: `composer_diloco.outer.state_transfer` then moves only what differs): hashed now on
        a new run, read from the checkpoint on a resumed one (None when it predates the record). None for LoRA (the
        peer hashes its base itself) and for the embedded default (nodes start from a random skeleton)."""
        if self.config.lora is not None or self.config.model is None:
            return None
        if checkpoint is not None:
            return read_outer_state(checkpoint).get("model_sha256")
        from composer_diloco.policy.lora import base_sha256

        return base_sha256(self.model)

    def _save(self) -> Path:
        """Checkpoint theta, the outer state and the round (`save_checkpoint`), with the run's base of a
        full-fine-tuning ``--model`` run."""
        model_sha = self.peer.base_sha256 if self.config.lora is None else None
        return save_checkpoint(self.run_dir, self.peer.round, self.model, self.tokenizer, self.peer.global_model,
                               self.config.to_json(), model_sha256=model_sha)

    def _continue_point(self) -> Path | None:
        """The checkpoint to continue from, or None for a new run.

        Raises:
            CheckpointError: ``--resume`` and no checkpoint; or, without ``--resume``, the run dir holds a run
                of another config (the message names the differing fields).
        """
        folder = latest_checkpoint(self.run_dir)
        if self.options.resume:
            if folder is None:
                raise CheckpointError(f"--resume: no checkpoint in {str(self.run_dir / 'checkpoints')!r}")
            return folder
        if folder is None:
            return None
        state = read_outer_state(folder)
        theirs = RunConfig.from_json(state["config"])
        diff = config_diff(self.config, theirs)
        if diff:
            raise CheckpointError(
                f"--run-dir {str(self.run_dir)!r} holds run {theirs.run_name!r} (round {state['round']}) with another "
                f"config ({', '.join(diff[:5])} differ): pass --resume to continue it with this config, or pick a "
                "new --run-dir")
        log.info("continuing the run in %s from %s", self.run_dir, folder.name)
        return folder

    def _known_peers(self) -> list[str]:
        """Multiaddrs of the peers seen at the last round (``peers.json``), to rejoin a swarm that went on."""
        return read_known_peers(self.run_dir / KNOWN_PEERS_FILE)

    def _lock_run_dir(self) -> None:
        """Hold ``RUN_DIR/coordinator.lock`` (an OS file lock, released when this process ends, even on SIGKILL) for
        the coordinator's life: a second coordinator on the same run dir, hence on the same identity, is refused.

        Raises:
            CoordinatorBusy: another process holds the lock (one line naming the run dir).
        """
        lock = try_lock(self.run_dir / "coordinator.lock")
        if lock is None:
            raise CoordinatorBusy(f"--run-dir {str(self.run_dir)!r} is in use by another coordinator (its lock "
                                  f"{str(self.run_dir / 'coordinator.lock')!r} is held): stop it first, or pick "
                                  f"another --run-dir") from None
        self.stop.add_cleanup(lock.release)

    def _start_dht(self, known_peers: list[str]):
        identity = str(self.run_dir / IDENTITY_FILE)
        if known_peers:
            try:
                return start_dht(initial_peers=known_peers, listen=self.options.listen,
                                 announce=self.options.announce, secret=self.secret, identity_path=identity,
                                 identity_free=self._new_identity)
            except NoPeerAnswered as e:
                log.info("none of the %d peers of the last round answered (%s): starting alone", len(known_peers), e)
        return start_dht(initial_peers=[], listen=self.options.listen, announce=self.options.announce,
                         secret=self.secret, identity_path=identity, identity_free=self._new_identity)

    def _reload_from_live_nodes(self, checkpoint: Path) -> bool:
        """Adopt the state of a live node if it is ahead of the checkpoint just loaded (the swarm went on). Not asked
        when the checkpoint is the last round of the run that wrote it (a finished run resumed with more
        ``--rounds``): its nodes stopped there, none can be ahead, and the wait for one would be ~15 s of nothing."""
        if not self.swarm.live_peers() and not self._known_peers():
            return False
        try:
            written_for = RunConfig.from_json(read_outer_state(checkpoint)["config"]).rounds
        except (ConfigError, KeyError):  # a checkpoint written before a config field changed: ask the nodes
            written_for = None
        if written_for is not None and self.peer.round >= written_for:
            log.info("the checkpoint of round %d ended the run that wrote it (%d rounds): no node can be ahead of it",
                     self.peer.round, written_for)
            return False
        from_round = self.peer.round
        timeout_s = min(self.config.network.join_timeout_s, 15.0)  # to find a node's manifest; the bytes take longer
        if not self.peer.load_state_from_peers(timeout_s=timeout_s, min_round=from_round + 1):
            return False
        self.peer.global_model.load_into(self.model)
        self.swarm.set_round(self.peer.round, sha=self.peer.global_model.sha256())
        log.info("reloaded round %d from a live node (the newest checkpoint was round %d)", self.peer.round,
                 from_round)
        return True

    def _write_known_peers(self, maddrs: list[str] | None = None) -> None:
        """``peers.json``, what a restart dials: at a round's end the peers alive then (``maddrs`` None); between
        rounds (`IdleWatch`) ``maddrs``, the live nodes now, merged with what it held, so a node that joined since the
        last round is known to a restart and one whose heartbeat just expired is still dialed."""
        if maddrs is None:
            known = {p.maddr for p in self.swarm.live_peers() if p.maddr and p.name != PEER_NAME}
        else:
            known = set(maddrs) | set(self._known_peers())
        write_known_peers(self.run_dir / KNOWN_PEERS_FILE, known)

    def _load_outer_state(self, folder: Path) -> None:
        """Round and outer optimizer state from ``outer.pt``; theta came with the model. Raises CheckpointError."""
        lora_base = self.peer.base_sha256 if self.config.lora is not None else None  # a LoRA checkpoint's base
        self.peer.resume_at(restore_outer_state(folder, self.peer.global_model, lora_base))
        sha = self.peer.global_model.sha256()
        self.swarm.set_round(self.peer.round, sha=sha)  # a restarted coordinator's lineage starts at its checkpoint
        log.info("resumed from %s at round %d (sha256 %s)", folder, self.peer.round, sha[:12])

    def serve(self) -> int:
        """Take part in every round until the run's last; returns the rounds completed.

        Stops early on a signal, or when no node was alive for ``max_idle_s`` seconds: then ``idle_error`` holds
        the one-line reason (`IdleWatch`), and the stop event is set as a signal would. A run that reaches its last
        round with theta bit for bit what it was when this call began (no round moved the global model: every
        pseudo-gradient was zero, as when no episode of any node parsed a tool call) sets ``unchanged_error`` to the
        one-line reason: a success on nothing is not reported as one.
        """
        peer = self.peer
        first = peer.round
        first_sha = peer.global_model.sha256() if first < self.config.rounds else None
        watch = IdleWatch(self.swarm, lambda: peer.round, self.stop.event, max_idle_s=self.options.max_idle_s,
                          idle_log_s=self.options.idle_log_s, on_nodes=self._write_known_peers).start()
        try:
            self._serve_rounds()
        finally:
            watch.close()
            self.idle_error = watch.error
        if first_sha is not None and self.idle_error is None and peer.round >= self.config.rounds \
                and peer.global_model.sha256() == first_sha:
            self.unchanged_error = (
                f"the run ended at round {peer.round} with theta unchanged since round {first} (sha256 "
                f"{first_sha[:12]}): every node's pseudo-gradient was zero (no episode parsed a tool call: the nodes "
                f"say 'trained on nothing'; or every group's rewards were equal, so no advantage, and no SDPO site or "
                f"DPO pair); the checkpoints hold the starting theta")
            log.error("%s", self.unchanged_error)
        if self.idle_error is None:
            self.swarm.set_info(phase="done")  # `composer-coordinator status`
            self._linger()
        return peer.round - first

    def _serve_rounds(self) -> None:
        """The run's rounds, the coordinator's side (`composer_diloco.diloco.follow_rounds`), each recorded by
        `_round_ended`."""
        follow_rounds(self.peer, self.config.rounds, self.stop.event, self._round_ended)

    def _round_ended(self, result: SyncResult) -> None:
        """One round's metrics line and status, the peers seen, and a checkpoint every ``checkpoint_every`` rounds
        and at the run's last."""
        config, peer = self.config, self.peer
        live = self.swarm.live_peers()  # for the tracker's table and for `composer-coordinator status`
        self.metrics.write({**result.record(PEER_NAME, "coordinator"), "samples": 0,
                            "weight_total": result.weight_total, "time": time.time()}, peers=live)
        self.swarm.set_info(publish=True, **round_facts(result, live, self.swarm.info.get("group", [])))
        log.info("round %d done: %d peers, %.0f samples, sha256 %s", result.round, result.peers,
                 result.weight_total, result.global_sha256[:12])
        self._write_known_peers()
        if peer.round % config.checkpoint_every == 0 or peer.round == config.rounds:
            path = self._save()
            log.info("checkpoint %s", path)

    def _linger(self) -> None:
        """At the run's end: a node whose last all-reduce failed takes our state (`recovery.after_failed_round`),
        one whose theta is unsettled may take it (`recovery.settle_pick`): stay while a live node is behind or
        unsettled, at most ``network.averaging_timeout_s`` + 5 s (`DiLoCoPeer.serve_until_settled`)."""
        self.peer.serve_until_settled(self.stop.event, self.config.network.averaging_timeout_s + 5.0)

    def close(self) -> None:
        """Stop heartbeats, the averager and the DHT (idempotent)."""
        if self.swarm is not None:
            self.swarm.close()
        self.stop.run_cleanups()
