"""The node life cycle: join the DHT, read the run config, fetch the global model, train round after round.

One round on a node, in order (`composer_diloco.diloco.DiLoCoRounds`; read it there):
    H x [rollouts against the env -> GRPO + loss channels -> AdamW step]   (TRL GRPOTrainer, `ComposerGRPOTrainer`)
    pseudo-gradient -> barrier -> all-reduce -> outer Nesterov step -> load theta into the policy  (`DiLoCoPeer`)
    one line in <run-dir>/<name>/metrics.jsonl                                           (`Node.round_ended`)

Joining checks the envs first (`Node.join`): each ``--env-url`` before the DHT starts (health, protocol, tools), one
reset per ``--env-url`` with the run's ``reset_kwargs`` before the model is built or downloaded (a node's own env
server: started in the background once the run config is read, used before the download). A bad env fails the node
with one line and exit code 1 in seconds, not after the model download.

A node started with ``--standby`` first waits as the node's warm standby (`nodes.standby`), then joins as above with
what it prepared (`Node.take_over`); one started with ``--with-standby`` is a standby that forks the node's first life
at once (which joins as above, its join counted from the command's start) and every later one.
"""

from __future__ import annotations

import gc
import itertools
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from composer_diloco.config import RunConfig, config_diff
from composer_diloco.diloco import DiLoCoRounds, InnerPhase
from composer_diloco.outer.peer import DiLoCoPeer, SyncResult
from composer_diloco.rollout.env_process import EnvServer, launch_env_server, wait_for_env
from composer_diloco.lifecycle import GracefulStop
from composer_diloco.metrics import MetricsWriter
from composer_diloco.report import Reporter
from composer_diloco.outer.identity import IDENTITY_FILE, load_or_create_identity
from composer_diloco.outer.known_peers import KNOWN_PEERS_FILE, read_known_peers, write_known_peers
from composer_diloco.rollout.mcp import detect_env_protocol
from composer_diloco.rollout.sessions import open_env_sessions
from composer_diloco.rollout.tasks import TaskSet, TaskShard
from composer_diloco.rollout.episodes import EnvSession
from composer_diloco.policy.load import policy_skeleton
from composer_diloco.outer.swarm import (
    NoPeerAnswered, Swarm, SwarmError, check_addresses, fetch_run_config, parse_multiaddr, start_dht,
)
from composer_diloco.inner.journal import PhaseJournal
from composer_diloco.inner.step import RoundStats
from composer_diloco.inner.trainer import ComposerGRPOTrainer, OnceTrainingBegins, RoundCallback, grpo_args
from composer_diloco.timing import JOIN_PHASES, PhaseClock, cuda_sync_for
from nodes.device import NodeBatch, Placement, warn_if_cpu_oversubscribed
from nodes.options import ROLLOUT_ENGINES, CheckedOptions, NodeOptions, resolve_rollout_engine
from nodes.folder_lock import HOLDER_FILE, NodeBusy, lock_node_folder, write_holder
from nodes.standby import ENV_SERVER_LOG, mark_training, save_run_config

log = logging.getLogger(__name__)

JOIN_REDIAL_S = (0.5, 1.0, 2.0, 4.0, 5.0)
"""Seconds before each new bootstrap attempt of a node whose ``--peer``s did not answer (`Node._start_dht`), the last
repeated: a node started beside its coordinator (a job script) gets in within a second of it listening, so a round
does not start without it (a 5 s wait once cost a node the run's first two rounds), and one waiting long for a
restarted coordinator starts a DHT process every 5 s, not more."""


class NodeError(RuntimeError):
    """The node cannot take part in the run (bad peer, unreachable env, no global model ...)."""


class TrainedOnNothing(NodeError):
    """The node finished a run in which no episode of any round produced a parsed tool call."""


@dataclass
class ToolCallTally:
    """Whether this node's episodes carried any signal: rounds played, and rounds with a parsed tool call.

    An episode without a parsed tool call ends at its first turn with reward 0: a round of only such episodes
    gives GRPO no advantage and the other channels no site, so the node averages a pseudo-gradient of nothing. The
    choice: a WARNING per such round, an error at the run's end. A real model may need a few rounds before it
    emits its first call in the env's format, so one empty round is not a failure; a whole run without one is a
    run that trained on nothing (a wrong chat template, tools the template does not render, the wrong ``--model``),
    and it must not exit 0 as if it had learned.

    Attributes:
        rounds: rounds this node played episodes in.
        rounds_with_call: those of them with at least one parsed tool call.
    """

    rounds: int = 0
    rounds_with_call: int = 0

    def add(self, stats: RoundStats, round_: int, peer_name: str) -> None:
        """Count one round's episodes; log a WARNING when the round had episodes and none with a tool call."""
        if stats.samples == 0:
            return
        self.rounds += 1
        if not stats.no_tool_call:
            self.rounds_with_call += 1
            return
        log.warning("%s round %d: NO TOOL CALL in any of the %d episodes: the policy's turns never parsed as a tool "
                    "call, so this round trains on nothing (check the chat template / tools / --model)",
                    peer_name, round_, stats.samples)

    def check(self) -> None:
        """At the run's end: refuse a run in which no round had a parsed tool call.

        Raises:
            TrainedOnNothing: one line; rounds were played and none had a parsed tool call.
        """
        if self.rounds > 0 and self.rounds_with_call == 0:
            raise TrainedOnNothing(
                f"trained on nothing: no episode of {self.rounds} round(s) produced a parsed tool call; the policy "
                "never called a tool: check the chat template / tools / --model")


class Node:
    """A running node (see module docstring). Build with `Node.join`, then `train`, then `close`.

    ``started``: when the command that started this life began (time.time() seconds), where that is not this process's
    start (a first life forked by its standby, ``--with-standby``): its join's ``imports`` count from there."""

    def __init__(self, options: NodeOptions, stop: GracefulStop, started: float | None = None):
        self.options, self.stop = options, stop
        self.env_servers: list[EnvServer] = []
        self.sessions: list[EnvSession] = []
        self.tasks: TaskSet | None = None
        self.task_shard: TaskShard | None = None
        self.dht = None
        self.swarm: Swarm | None = None
        self.peer: DiLoCoPeer | None = None
        self.trainer: ComposerGRPOTrainer | None = None
        self.rollout_engine = "batched"  # `resolve_rollout_engine`, at join
        self.config: RunConfig | None = None
        self.swarm_round = 0  # the newest round a live peer was in when this node joined
        self.own_dir = Path(options.run_dir) / options.name  # metrics, identity key, error feedback, lock
        # no live peer can hold the identity key: this start made it (`join`), or took the node's folder over from
        # its process, which has ended (`take_over`); hivemind's check that it is free is then skipped (`start_dht`)
        self._identity_free = False
        self.metrics = MetricsWriter(self.own_dir / "metrics.jsonl")
        self.tool_calls = ToolCallTally()
        self.memory_plan = None  # composer_diloco.policy.memory_plan.MemoryPlan, once `plan_memory` ran
        self.overlap = None  # composer_diloco.outer.overlap.OverlappedSync when the run's [outer] overlap is on
        self.clock = PhaseClock("trainer")  # the inner phase's parts (`INNER_PHASES`); remade on the device in train
        self.rounds: DiLoCoRounds | None = None  # the round loop (`composer_diloco.diloco`), made in train
        self._own_lock = None  # <run-dir>/<name>/node.lock once held (`_lock_own_dir`, or a standby's `take_over`)
        self.prepared = None  # nodes.standby.Prepared: what this process's standby built before it took over
        # where the join's seconds go (`JOIN_PHASES`), from the process's start, or from a standby's takeover
        self.join_clock = PhaseClock("join")
        self.joined_as = "process"  # or "standby, prepared" / "standby, unprepared" (`take_over`)
        self.join_seconds: dict[str, float] | None = None  # set at the first inner phase, written in the first line
        self._imports_s = _process_age_s() if started is None else max(0.0, time.time() - started)

    # -- joining ------------------------------------------------------------------------------------------
    def join(self) -> None:
        """Check the env servers, join the DHT, read the config, open the env sessions, download the global model.

        Env failures come first: each ``--env-url`` is checked before the DHT is started (``/health``, then its
        protocol from ``/schema`` and ``/mcp``: `composer_diloco.rollout.mcp.detect_env_protocol`), and one reset per
        URL with the run's ``reset_kwargs`` runs right after the config is read, before the model is built or
        downloaded (`composer_diloco.rollout.sessions.open_env_sessions`).

        The memory plan (`plan_memory`) runs as soon as the run config is known: before the DHT starts when
        ``--config`` names it, else right after the config is read from the DHT, before the averager, the env
        sessions, the model and the state download.

        Raises:
            SwarmError / NodeError / ConfigError / EnvServerError / PolicyLoadError / UnsupportedEnvServer /
            McpProtocolError / EnvProtocolError / DeviceMemoryError, each with a one-line message.
        """
        checked, protocols = self._check_before_network()  # 1. this node's choices and its --env-url servers
        own_server, intended = self._enter_run(checked)       # 2. DHT, run config, own env server, joining record
        opening = self._plan_and_open_sessions(checked, protocols)  # 3. memory plan, tasks, --env-url sessions
        model = self._build_peer(checked, own_server, opening)      # 4. model skeleton, own env's sessions, peer
        with self.join_clock.phase("state"):
            self._load_global_model(model, checked, intended)  # 5. theta from a peer, the swarm's round, heartbeat

    def _check_before_network(self) -> tuple[CheckedOptions, dict[str, str]]:
        """Join, phase 1: what is cheap to check, before any network: this node's own choices (device, dtype, batch,
        addresses, identity key), the memory plan of a ``--config`` it agreed to, and every ``--env-url`` (reachable,
        and an MCP tool server or a typed tool-call env). Returns the checked options and each URL's protocol."""
        o = self.options
        checked = o.check()  # the command line ran it too, before the heavy imports: milliseconds
        self.placement = Placement.resolve(o.device, o.dtype)
        self.rollout_engine = resolve_rollout_engine(o.rollout, bf16=self.placement.bf16)
        for peer_addr in o.peers:
            parse_multiaddr(peer_addr)
        check_addresses(o.listen, o.announce)
        load_or_create_identity(self.own_dir / IDENTITY_FILE, create=False)  # a bad key: one line, no network
        if checked.expected_config is not None:  # the config this node agreed to: refused before any network
            with self.join_clock.phase("plan"):
                self.plan_memory(checked.expected_config)
        protocols = {}
        for url in o.env_urls:
            wait_for_env(url, timeout_s=o.join_timeout_s)
            protocols[url] = detect_env_protocol(url).protocol
        return checked, protocols

    def _enter_run(self, checked: CheckedOptions) -> tuple[Any, int]:
        """Join, phase 2: take this node's folder and identity, start the DHT, read the run config (refused when it
        differs from ``--config``), spawn this node's own env server (its imports overlap what follows), and announce
        the round this node joins (`Swarm.announce_joining`). Returns the launched server (None with ``--env-url``) and
        that round."""
        o, expected, secret = self.options, checked.expected_config, checked.secret  # secret None: an open run
        self._lock_own_dir()  # from here on <run-dir>/<name> is this process's, its identity too
        self._identity_free = self._identity_free or not (self.own_dir / IDENTITY_FILE).exists()
        peer_id = load_or_create_identity(self.own_dir / IDENTITY_FILE)
        log.info("peer ID %s (its key: %s)", peer_id, self.own_dir / IDENTITY_FILE)
        with self.join_clock.phase("dht"):
            self.dht = self._start_dht(secret)
            self.stop.add_cleanup(self.dht.shutdown)  # hivemind's shutdown is idempotent
            self.config = config = fetch_run_config(self.dht, run_name=o.run_name, timeout_s=o.join_timeout_s)
        diff = config_diff(expected, config) if expected is not None else []
        if diff:
            raise NodeError(f"run {config.run_name!r} has another config than --config {str(o.expected_config)!r}: "
                            f"{', '.join(diff[:5])}{' ...' if len(diff) > 5 else ''} differ")
        log.info("joined run %r (config %s): %d rounds, H=%d", config.run_name, config.digest(), config.rounds,
                 config.inner_steps)
        save_run_config(self.own_dir, config)  # for a standby of this node (nodes.standby)
        if self.prepared is not None:
            self.prepared = self.prepared.for_config(config)
            if self.prepared is None:
                self.joined_as = "standby, prepared for another config"
        self.metrics.reporter = Reporter(config, peer=o.name, role="node",
                                         extra={"placement": self.placement.describe()})
        self.stop.add_cleanup(self.metrics.reporter.finish)
        # a node's own env server (no --env-url) is spawned now: its process's imports (~4 s on a 2-core machine)
        # overlap the memory plan, the task file and the model skeleton instead of following them; an error below
        # stops it (the stop's cleanup), and its own failure is raised where it is waited for
        own_server = None
        if not o.env_urls:
            if self.prepared is not None and self.prepared.env_server is not None:  # a standby launched it
                own_server = self.prepared.env_server
            else:
                own_server = launch_env_server(config.env.server_module, args=config.env.server_args,
                                               log_path=self.own_dir / ENV_SERVER_LOG)
            self.stop.add_cleanup(own_server.stop)
        self.swarm = Swarm(self.dht, run_name=config.run_name, peer_name=o.name, role="node", secret=secret,
                           initial_peers=o.peers)
        self.swarm.set_info(device=self.placement.name, precision=self.placement.dtype, phase="joining")  # status
        net = config.network
        # the barrier of the round this node joins waits for it from now on, not only from its first heartbeat
        intended = self.swarm.announce_joining(net.heartbeat_s, net.heartbeat_ttl_s, net.join_grace_s)
        log.info("joining at round %d", intended)
        return own_server, intended

    def _plan_and_open_sessions(self, checked: CheckedOptions, protocols: dict[str, str]) -> dict[str, Any]:
        """Join, phase 3: the memory plan (sets ``self.batch``), the task file, and the ``--env-url`` sessions: one
        reset per URL with the run's ``reset_kwargs`` (known only now) checks that each env gives task text and tools,
        so a bad env costs seconds, not the model download. Returns the session options (`open_env_sessions`'s
        keywords), for this node's own env server's sessions in phase 4."""
        o, config = self.options, self.config
        with self.join_clock.phase("plan"):
            self.plan_memory(config)  # sets self.batch: --batch-size, or the largest micro-batch the memory plan fits
        log.info("training on %s: %s", self.placement.describe(), self.batch.describe())
        self.tasks = TaskSet.load(config.tasks)  # a bad [tasks] dataset fails here, before any env or model
        self.task_shard = shard = checked.shard
        first_row = self.tasks.order(1, seed=config.seed, shard=shard, peer_name=o.name)[0] if self.tasks else 0
        if self.tasks is not None and shard is not None:
            log.info("tasks: shard %s of %d rows", shard, len(self.tasks))
        opening = dict(max_tool_calls=config.env.max_tool_calls, reset_kwargs=config.env.reset_kwargs,
                       per_url=o.env_sessions or config.env.sessions_per_url, tasks=self.tasks, check_row=first_row)
        if o.env_urls:  # round-robin over the URLs; each URL's protocol was detected in phase 1
            with self.join_clock.phase("env"):
                self.sessions = open_env_sessions(list(o.env_urls), self.batch.episodes_per_step,
                                                  protocols=protocols, **opening)
        return opening

    def _build_peer(self, checked: CheckedOptions, own_server: Any, opening: dict[str, Any]) -> nn.Module:
        """Join, phase 4: the policy's skeleton, this node's own env server's sessions (after the skeleton, before the
        download), and the `DiLoCoPeer` (serving no state before the download; with ``[outer] overlap`` its
        background sync). Returns the skeleton."""
        config = self.config
        if self.prepared is not None and self.prepared.skeleton is not None:  # a standby built it for this config
            (model, self.tokenizer), self.prepared.skeleton = self.prepared.skeleton, None
        else:
            with self.join_clock.phase("model"):
                model, self.tokenizer = policy_skeleton(config)
        # a full-fine-tuning --model: what this node loaded is the run's base, theta's round-0 value (checked against
        # the run's at the download, and at round 0 nothing else travels)
        base = _full_model_sha256(model) if config.model is not None and config.lora is None else None
        if own_server is not None:
            with self.join_clock.phase("env"):
                server = own_server.wait(config.env.connect_timeout_s)  # EnvServerError as `start_env_server` raises
                self.env_servers.append(server)
                self.sessions = open_env_sessions([server.url], self.batch.episodes_per_step, **opening)
        with self.join_clock.phase("averager"):
            self.peer = DiLoCoPeer(model, config, self.swarm, holds_theta=False, base_sha256=base)
            self.peer.chunk_bytes = checked.state_chunk_bytes
            self.stop.add_cleanup(self.peer.shutdown)
            if config.outer.overlap:  # `[outer] overlap`: sync in the background (composer_diloco.outer.overlap)
                from composer_diloco.outer.overlap import OverlappedSync

                self.overlap = OverlappedSync(self.peer, self.stop.event)
                self.stop.add_cleanup(self.overlap.close)  # runs before peer.shutdown (cleanups run last first)
        return model

    def _load_global_model(self, model: nn.Module, checked: CheckedOptions, intended: int) -> None:
        """Join, phase 5: the global model (a peer's manifest within ``--join-timeout``, then only the tensors this
        node does not hold, in chunks, within ``--join-deadline``), the swarm's round (building the model and loading
        the state take seconds: the swarm may have moved on), theta into the placed policy, the first heartbeat."""
        o, config = self.options, self.config
        if not self.peer.load_state_from_peers(timeout_s=o.join_timeout_s, deadline_s=checked.join_deadline_s):
            raise NodeError(f"no peer of run {config.run_name!r} sent the global model: "
                            f"{self.peer.last_download_error}")
        self.swarm_round = self.peer.join_at_round_boundary(
            join_grace_s=config.network.join_grace_s, timeout_s=o.join_timeout_s, stop=self.stop.event,
            intended=intended)
        self.peer.global_model.load_into(model)
        self._restore_codec_state()
        self.model = self.placement.place(model)
        sha = self.peer.global_model.sha256()
        self.swarm.set_round(self.peer.round, sha=sha)  # heartbeats say which theta this peer starts from
        self.swarm.start_heartbeat(config.network.heartbeat_s, config.network.heartbeat_ttl_s)
        log.info("global model of round %d loaded (sha256 %s) on %s", self.peer.round, sha[:12],
                 self.placement.describe())

    def _codec_state_path(self) -> Path:
        from composer_diloco.checkpoint import CODEC_STATE_FILE

        return self.own_dir / CODEC_STATE_FILE

    def _restore_codec_state(self) -> None:
        """A node restarting under the same name takes back its sparse codec's error feedback from its own folder
        (`composer_diloco.checkpoint.load_codec_state`); one of another config or layout is set aside with a warning
        (the node starts with none: only the unsent residual of its earlier life is lost)."""
        if self.peer.error_feedback is None:
            return
        from composer_diloco.checkpoint import CheckpointError, load_codec_state

        path = self._codec_state_path()
        try:
            saved = load_codec_state(path, self.config.digest())
            if saved is not None:
                self.peer.load_codec_state(saved[1])
                log.info("error feedback of round %d restored from %s", saved[0], path)
        except (CheckpointError, ValueError) as e:
            log.warning("error feedback not restored, starting from zero: %s", e)

    def _save_codec_state(self, round_: int) -> None:
        state = self.peer.codec_state()
        if state is None or (round_ + 1) % self.config.checkpoint_every:
            return
        from composer_diloco.checkpoint import save_codec_state

        try:
            save_codec_state(self._codec_state_path(), state, round_, self.config.digest())
        except OSError as e:
            log.warning("round %d: could not save the error feedback: %s", round_, e)

    def _lock_own_dir(self) -> None:
        """Hold ``<run-dir>/<name>/node.lock`` (`nodes.folder_lock`) for the node's life: a second node started with the
        same ``--run-dir`` and ``--name``, hence on the same identity key and metrics file, is refused before it
        touches either. A no-op when the command line (before its imports) or a standby's takeover took it already.

        Raises:
            NodeBusy: another process holds the lock (one line naming the folder).
        """
        if self._own_lock is None:
            self.hold_folder(lock_node_folder(self.own_dir, self.options.name, self.options.run_dir))

    def hold_folder(self, lock: Any) -> None:
        """Keep ``lock``, this node's folder lock taken by the caller (`nodes.folder_lock.lock_node_folder`), for
        the node's life: released at `close`; and say so in ``<run-dir>/<name>/node.pid``
        (`nodes.folder_lock.write_holder`: a failed write is a WARNING)."""
        self._own_lock = lock
        self.stop.add_cleanup(lock.release)
        try:  # which process is the node now (after a standby's takeover, one it forked)
            write_holder(self.own_dir)
        except OSError as e:
            log.warning("could not write %s: %s", self.own_dir / HOLDER_FILE, e)

    def take_over(self, lock: Any, prepared: Any | None) -> None:
        """Start as this node's standby did (`nodes.standby.Standby.wait`): ``lock`` is the node's folder lock it
        holds (released at `close`), ``prepared`` its `nodes.standby.Prepared` (None: nothing prepared), used by
        `join` when the run's published config is the one it was prepared for. The lock proves that the process
        which held this node's folder, hence its identity key, has ended: hivemind's check that the key is free (a
        temporary p2pd looking the peer ID up: 2-3 s of a takeover on a loaded machine) is skipped. (Its DHT and
        averager daemons may outlive it by up to the reaper's poll, `composer_diloco.reaper`, during which the check
        could even find the key taken.)"""
        self.hold_folder(lock)
        self._identity_free = True
        self.prepared = prepared
        self.join_clock, self._imports_s = PhaseClock("join"), None  # this life's join starts at the takeover
        self.joined_as = "standby, prepared" if prepared is not None else "standby, unprepared"
        if prepared is not None:
            self.stop.add_cleanup(prepared.close)

    def _start_dht(self, secret: bytes | None):
        """The node's DHT peer, bootstrapped from any of its ``--peer``s or of the peers its last life on the same
        ``--peer`` line saw (``<run-dir>/<name>/peers.json``, `_remember_peers`). While none answers (a coordinator
        restarting, a job script that started the nodes first) it re-dials after 0.5, 1, 2 and 4 s, then every 5 s
        (`JOIN_REDIAL_S`), for ``--join-timeout`` seconds, saying at WARNING what it waits for, then raises the last
        `SwarmError` ("no peer answered ...").
        A refused run secret looks the same from here, so it waits too before that one-line error.

        Its peer ID is the key in ``<run-dir>/<name>/identity.key`` (`composer_diloco.outer.identity`), so a node
        restarted with the same ``--run-dir`` and ``--name`` is the same peer to the others; hivemind refuses the key
        while a live peer reachable from the ``--peer``s holds it (`IdentityInUse`)."""
        o = self.options
        deadline = time.monotonic() + o.join_timeout_s
        # the peers this node saw in its last life on the same --peer line: a restart while that peer (the
        # coordinator) is down joins through them (`composer_diloco.outer.known_peers`)
        seen = [m for m in read_known_peers(self.own_dir / KNOWN_PEERS_FILE, started_on=o.peers) if m not in o.peers]
        if seen:
            log.info("also dialing the %d peer(s) this node saw in its last life (%s)", len(seen),
                     self.own_dir / KNOWN_PEERS_FILE)
        for attempt in itertools.count():
            try:
                return start_dht(initial_peers=[*o.peers, *seen], listen=o.listen, announce=o.announce or None,
                                 secret=secret, identity_path=str(self.own_dir / IDENTITY_FILE),
                                 identity_free=self._identity_free)
            except NoPeerAnswered:
                left = deadline - time.monotonic()
                if left < 1.0 or self.stop.event.is_set():
                    raise
                pause = JOIN_REDIAL_S[min(attempt, len(JOIN_REDIAL_S) - 1)]
                quick = 0 < attempt < len(JOIN_REDIAL_S) - 1  # said once, then at the steady pace only
                log.log(logging.DEBUG if quick else logging.WARNING,
                        "no peer answered at --peer %s%s: dialing again for %.0f more s (--join-timeout)",
                        " ".join(o.peers), f" nor at the {len(seen)} peer(s) of its last life" if seen else "", left)
                self.stop.event.wait(min(pause, left))

    def _remember_peers(self) -> None:
        """Keep the live peers' multiaddrs in ``<run-dir>/<name>/peers.json`` (`_start_dht` of a restart dials them);
        a failed write costs only that (a WARNING)."""
        maddrs = [p.maddr for p in self.swarm.live_peers() if p.maddr and p.name != self.options.name]
        try:
            write_known_peers(self.own_dir / KNOWN_PEERS_FILE, maddrs, started_on=self.options.peers)
        except OSError as e:
            log.warning("could not keep the peers seen in %s: %s", self.own_dir / KNOWN_PEERS_FILE, e)

    def plan_memory(self, config: RunConfig):
        """Compute this node's memory plan for ``config`` (`composer_diloco.policy.memory_plan`), pick the micro-batch
        (``self.batch``), log both, and refuse a plan that does not fit the device's free memory, or episodes longer
        than the model's context. Runs once per config (a second call with the same config returns the first plan).

        The model's sizes come from its config alone (the embedded default's, or ``config.json`` of ``--model``
        read from local files or the Hub cache): nothing is built or downloaded. A model whose config is not in
        local files is not planned (a WARNING) and trains with the run's micro-batch; loading it later fails or
        succeeds on its own.

        Without ``--batch-size`` (and ``--grad-accum``) the node picks the largest micro-batch that divides the run's
        episodes per step and fits, first without gradient checkpointing, then with it (turned on:
        ``self.batch.gradient_checkpointing``), and logs the choice and why (`choose_batch`); the episodes per step
        stay the run's. A user's ``--batch-size`` / ``--grad-accum`` is planned as given and refused when it does
        not fit.

        Also starts `PeakMemory` (its CPU baseline: the process before the policy is built), which each round's
        metrics line reads (`round_ended`).

        Returns:
            the `MemoryPlan`, or None when the model config could not be read.
        Raises:
            DeviceMemoryError: one line naming the need, the free memory and the options that would fit (a user's
                batch), or that micro-batch 1 with gradient checkpointing does not fit (a batch the node picks).
            ConfigError: the run's ``max_seq_len`` is longer than the model's positions (`check_context_length`).
            ValueError: ``$COMPOSER_DILOCO_DEVICE_MEMORY_BYTES`` is not a positive number.
            BatchError: ``--batch-size`` x ``--grad-accum`` is not a multiple of the run's G.
        """
        from composer_diloco.policy.context_length import check_context_length
        from composer_diloco.policy.memory_plan import (
            PeakMemory, check_plan, choose_batch, device_free_bytes,
        )

        o = self.options
        if getattr(self, "_planned_digest", None) == config.digest():
            return self.memory_plan
        self._planned_digest = config.digest()
        self.batch = NodeBatch.resolve(config, o.batch_size, o.grad_accum, o.gradient_checkpointing)
        model_config = _model_config(config)
        if model_config is None:
            log.warning("memory plan skipped: the config of model %r is not in local files", config.model)
            return None
        check_context_length(config.max_seq_len, model_config, config.model)
        self.memory_peak = PeakMemory(self.placement.device)  # before the policy is built: the CPU baseline
        free, source = device_free_bytes(self.placement.device)
        host_free = None if self.placement.use_cpu else device_free_bytes("cpu")[0]
        kw = dict(device=self.placement.name, bf16=self.placement.bf16, free=free, free_source=source,
                  host_free=host_free, inputs=self._plan_inputs(config))
        if NodeBatch.picks_itself(o.batch_size, o.grad_accum):
            choice = choose_batch(config, model_config, gradient_checkpointing=o.gradient_checkpointing, **kw)
            self.batch = NodeBatch(choice.micro_batch, choice.grad_accum, config.grpo.num_generations,
                                   choice.gradient_checkpointing)
            self.memory_plan = choice.plan
            log.info("%s: %s", o.name, choice.reason)
        else:
            self.memory_plan = check_plan(config, model_config, micro_batch=self.batch.micro_batch,
                                          grad_accum=self.batch.grad_accum,
                                          gradient_checkpointing=o.gradient_checkpointing, **kw)
        log.info("%s", self.memory_plan.describe())
        return self.memory_plan

    def _plan_inputs(self, config: RunConfig) -> Any:
        """The memory plan's inputs for ``config`` (`composer_diloco.policy.memory_plan.plan_inputs`): those this
        process's standby computed for the same config (a takeover's plan then reads only the free memory), else
        computed now."""
        from composer_diloco.policy.memory_plan import plan_inputs

        prepared = self.prepared
        if prepared is not None and prepared.plan_inputs is not None and prepared.config.digest() == config.digest():
            return prepared.plan_inputs
        return plan_inputs(config)

    # -- training -----------------------------------------------------------------------------------------
    def train(self) -> int:
        """Train until the run's last round; returns the number of rounds this node took part in.

        At the run's end the node stays up (its averager serving its state) while a live peer still finishes the last
        round, at most ``network.averaging_timeout_s`` + 5 s (`DiLoCoPeer.serve_until_settled`).

        Raises:
            TrainedOnNothing: the run ended and no episode of any of this node's rounds had a parsed tool call
                (`ToolCallTally`; the final model is kept first, as on a normal end).
        """
        config, peer = self.config, self.peer
        warn_if_cpu_oversubscribed(self.placement)  # now: nodes started together have all joined
        remaining = config.rounds - peer.round
        if remaining <= 0 or self.swarm_round >= config.rounds:
            log.info("the run is already over (round %d of %d)", max(peer.round, self.swarm_round), config.rounds)
            return 0
        self.join_clock.enter("trainer")
        out_dir = Path(tempfile.mkdtemp(prefix=f"trl-{self.options.name}-"))
        args = grpo_args(config, output_dir=out_dir, max_steps=remaining * config.inner_steps,
                         use_cpu=self.placement.use_cpu, bf16=self.placement.bf16,
                         micro_batch=self.batch.micro_batch, grad_accum=self.batch.grad_accum)
        # --gradient-checkpointing, or turned on by the memory plan's choice (`plan_memory`); TRL enables it on the
        # model (and input grads for a peft model)
        if self.batch.gradient_checkpointing:
            args.gradient_checkpointing = True
            args.gradient_checkpointing_kwargs = {"use_reentrant": False}
        self.clock = PhaseClock("trainer", sync=cuda_sync_for(self.placement.device))
        engine = self.rollout_engine
        log.info("rollouts: %s (--rollout %s)", ROLLOUT_ENGINES[engine], self.options.rollout)
        journal = PhaseJournal(self.own_dir, config.digest(), config.inner.journal_max_bytes, self.model,
                               config.inner.journal_max_stale_rounds)
        self.rounds = DiLoCoRounds(peer, self.stop.event, self, self.clock, overlap=self.overlap,
                                   catch_up=self.swarm.joined_late, journal=journal)
        self.trainer = ComposerGRPOTrainer(
            model=self.model, tokenizer=self.tokenizer, config=config, sessions=self.sessions,
            peer_name=self.options.name, args=args,
            callbacks=[RoundCallback(self.rounds), OnceTrainingBegins(self._first_inner_phase),
                       *self._tracker_callbacks()],
            tasks=self.tasks,
            task_shard=self.task_shard, clock=self.clock, rollout_engine=engine,
        )
        self.rounds.attach(self.trainer)
        first = peer.round
        # What the imports and the join built (torch, transformers, TRL, hivemind, the policy: ~0.5M objects at the
        # embedded default) lives as long as the process: out of the collector's full passes from here on. train()
        # opens with accelerate's free_memory(), a gc.collect() of the whole heap: 0.9-1.1 s, most of TRL's set-up and
        # of a standby's takeover (BENCHMARKS.md 3o), then ~0.02 s. A full pass before train() found no garbage to
        # free (a trainer built the same way in one process), and the young generations are collected first.
        gc.collect(1)
        gc.freeze()
        self.trainer.train()  # TRL's set-up (optimizer, accelerate, dataloader), then `_first_inner_phase`, then steps
        while peer.round < config.rounds and not self.stop.event.is_set():
            # a heal took this node back to an earlier round (`DiLoCoPeer._heal_split`): its inner steps ran out before
            # the run's last round. Train the rounds left; TRL reuses the optimizer, so AdamW's moments carry on.
            log.info("round %d: %d rounds left after going back to the run's theta: training on", peer.round,
                     config.rounds - peer.round)
            before = peer.round
            self.trainer.args.max_steps = (config.rounds - peer.round) * config.inner_steps
            self.trainer.train()
            if peer.round == before and not self.stop.event.is_set():
                raise NodeError(f"round {peer.round}: training on after a heal ended no round")
        if peer.round >= config.rounds and not self.stop.event.is_set():
            self.swarm.set_info(phase="done")  # `composer-coordinator status`
            # a peer still finishing the last round may need our state (`DiLoCoPeer.serve_until_settled`)
            peer.serve_until_settled(self.stop.event, config.network.averaging_timeout_s + 5.0)
            self._keep_final_model()
            self.tool_calls.check()
        return peer.round - first

    def _first_inner_phase(self) -> None:
        """TRL's ``train()`` has set up (`OnceTrainingBegins`): the join ends and the first inner phase starts, going on
        from the phase this node's last life was cut in when it journaled one (`composer_diloco.inner.journal`)."""
        self.join_clock.exit("trainer")
        self._joined()
        mark_training(self.own_dir)  # this node's standby prepares from now on, not beside the join (nodes.standby)
        self.rounds.start_inner_phase(self.model)
        self.rounds.resume(self.model)  # the phase its last life was cut in, if it journaled one
        if getattr(self, "memory_peak", None) is not None:  # round 0's peak: training, not the join's model load
            self.memory_peak.reset()

    def _joined(self) -> None:
        """The join ended (the first inner phase starts now): keep its parts (`JOIN_PHASES`, seconds) for the life's
        first metrics line, and log them."""
        parts = {k: round(v, 3) for k, v in self.join_clock.take().items() if v > 0}
        if self._imports_s is not None:
            parts = {"imports": round(self._imports_s, 3), **parts}
        self.join_seconds = parts
        order = {k: i for i, k in enumerate(JOIN_PHASES)}
        log.info("joined as %s in %.1f s: %s", self.joined_as, sum(parts.values()),
                 ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: order.get(kv[0], 99))))

    def _keep_final_model(self) -> None:
        """At the run's end with no coordinator alive to checkpoint theta, save it under this node's folder."""
        if any(p.role == "coordinator" for p in self.swarm.live_peers()):
            return
        from composer_diloco.checkpoint import save_checkpoint

        own_dir = self.own_dir
        folder = save_checkpoint(own_dir, self.peer.round, self.model, self.tokenizer, self.peer.global_model,
                                 self.config.to_json(), codec_state=self.peer.codec_state(),
                                 model_sha256=self.peer.base_sha256 if self.config.lora is None else None)
        log.warning("no coordinator is alive at the end of the run: saved the final global model to %s "
                    "(`composer-coordinator start --resume --run-dir %s` continues from it)", folder, own_dir)

    def _tracker_callbacks(self) -> list:
        """With ``[report]``: TRL's own step metrics, averaged per round, to the trackers (after `RoundCallback`,
        whose step ends the round)."""
        if self.metrics.reporter is None or not self.metrics.reporter.active:
            return []
        from composer_diloco.inner.trl_logs import TrlLogsToTracker

        return [TrlLogsToTracker(self.metrics.reporter)]

    # -- what a round tells the node (`composer_diloco.diloco.RoundHost`) ---------------------------------------
    def round_phase(self, phase: str) -> None:
        """The round entered ``"inner"`` or ``"sync"``: published in this node's DHT info (`composer-coordinator
        status`; a late joiner's first ``"inner"`` is stored at once, `Swarm.set_info`)."""
        self.swarm.set_info(phase=phase)

    def inner_phase_ended(self, phase: InnerPhase) -> None:
        """Before the round's sync: count its parsed tool calls (`ToolCallTally`) and warn of env failures."""
        stats = phase.stats
        self.tool_calls.add(stats, phase.round, self.options.name)
        if stats.episodes_env_error:
            log.warning("round %d: the env failed %d of the %d episodes (ended with reward 0, see the warnings above)",
                        phase.round, stats.episodes_env_error, stats.samples)

    def round_ended(self, result: SyncResult, phase: InnerPhase, fold: str | None = None) -> None:
        """One round's metrics line (`SyncResult.record` + `InnerPhase.record`, the memory it used, ``fold`` with
        ``[outer] overlap``) and its log line; the codec's state saved and the peers seen remembered first."""
        from composer_diloco.policy.memory_plan import round_memory

        self._save_codec_state(result.round)
        stats = phase.stats
        peak = getattr(self, "memory_peak", None)  # the peak since the previous line (a round's inner phase + sync)
        memory, warnings = round_memory(self.memory_plan, peak.take() if peak is not None else None, stats)
        for line in warnings:
            log.warning("%s round %d: %s", self.options.name, result.round, line)
        now = time.time()
        record = {**result.record(self.options.name, "node"), **phase.record(self.config.inner_steps),
                  "time": now, "inner_started": round(now - (time.monotonic() - phase.ended) - phase.seconds, 3),
                  **memory}
        if fold is not None:
            record["fold"] = fold
        if self.join_seconds is not None:  # this life's first line: where its join's seconds went
            record["join_seconds"], record["joined_as"], self.join_seconds = self.join_seconds, self.joined_as, None
        self.metrics.write(record)
        self.swarm.set_info(last_round=result.round, inner_seconds=record["inner_seconds"],  # status
                            sync_seconds=record["sync_seconds"], samples=record["samples"])
        self._remember_peers()
        log.info("round %d: reward %.3f, success %.2f, loss %+.4f, inner %.1f s, sync %.1f s, blocked %.1f s, "
                 "%d peers, %s%s", result.round, record["mean_reward"], record["success_rate"], record["loss_grpo"],
                 phase.seconds, result.sync_seconds, phase.blocked_seconds, result.peers, result.status,
                 f" ({fold})" if fold else "")
        if result.status == "alone":  # no other peer reached: say what it waits for, every round it lasts
            seen = sorted({p.name for p in self.swarm.live_peers() if p.name != self.options.name})
            log.warning("round %d: stepped alone: no other peer joined its all-reduce (live peers seen: %s); it keeps "
                        "re-dialing --peer %s and every peer it has seen, and averages again once one answers",
                        result.round, ", ".join(seen) or "none", " ".join(self.options.peers))

    # -- leaving ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop heartbeats, the averager, the DHT, env sessions and env servers (idempotent)."""
        if self.swarm is not None:
            self.swarm.close()
        for s in self.sessions:
            s.close()
        self.sessions = []
        self.stop.run_cleanups()


def _model_config(config: RunConfig):
    """The ``transformers`` config of the run's policy without building it: the embedded default's
    (`tiny_model_config`), or ``config.json`` of ``config.model`` from local files (a folder, or the Hub cache);
    None when it is not there."""
    from composer_diloco.policy import load_embedded_tokenizer, tiny_model_config

    if config.model is None:
        return tiny_model_config(load_embedded_tokenizer(config.env.server_module), config.warmstart.seed)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config.model, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None


def _full_model_sha256(model) -> str:
    """`composer_diloco.policy.lora.base_sha256` of a plain model: every parameter's fp32 bytes, the hash a
    full-fine-tuning run's coordinator publishes for the ``--model`` theta started from."""
    from composer_diloco.policy.lora import base_sha256

    return base_sha256(model)


__all__ = ["Node", "NodeBusy", "NodeError", "NodeOptions", "SwarmError", "ToolCallTally", "TrainedOnNothing"]


def process_started() -> float | None:
    """When this process started (time.time() seconds; psutil), None when unreadable."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # an unreadable /proc: the join's first part is left out, nothing else
        return None


def _process_age_s() -> float | None:
    """Seconds since this process started (a node's imports before its `Node` is made), None when unreadable."""
    started = process_started()
    return None if started is None else max(0.0, time.time() - started)
