"""The run's records in the hivemind DHT: the config, heartbeats of live peers, and the per-round barrier.

Keys (all but the first under the run name, so two runs can share a DHT):
    ``composer_diloco.runs`` / run   the run config as canonical JSON (published by the coordinator)
    ``{run}.peers`` / peer      ``{"role", "round", "since", "sha", "settled", "lineage", "maddr", "t"}``: who
                                is alive, the round it trains toward and since when (DHT time), theta's SHA-256
                                at the start of that round and whether it is final, the hashes of its last
                                `LINEAGE_ROUNDS` rounds (to tell two replicas that parted), where to dial it; and
                                ``"info"``, what the peer tells a reader of the swarm (`Swarm.set_info`: device,
                                phase, last round's seconds; `coordinator.status` shows them)
    ``{run}.ready.{r}`` / peer  ``{"t", "weight"}``: the peer finished its inner phase of round r (the coordinator: it
                                reached round r's barrier)

Why a barrier: hivemind's matchmaking only groups peers that look for a group at about the same time, and each
round is a separate group (its group key carries the round number, see `peer.py`). Peers announce that they
are ready, wait until every live node and the coordinator are ready (or ``round_slack_s`` after the first node),
and then all start matchmaking for the same ``scheduled_time``, so one round forms one group.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from functools import partial
from typing import Any

import hivemind
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from composer_diloco.config import ConfigError, RunConfig
from composer_diloco.lifecycle import keep_signal_handlers
from composer_diloco.outer.address_form import LISTEN_EXAMPLE, PEER_EXAMPLE
from composer_diloco.outer.peer_records import (  # noqa: F401 (re-exported: what a heartbeat says)
    PeerRecord, all_reduce_began, first_divergence, joins_round, replica_thetas, setting_up_late, superseded,
)

log = logging.getLogger(__name__)

_RECORD_TTL_S = 3600.0
_MAX_PENDING_BEATS = 4  # heartbeat stores in flight at once (each still waiting on a slow replica)
LINEAGE_ROUNDS = 64  # rounds of theta hashes each heartbeat carries (~2 KB): a peer cut off for fewer rounds than
# this is told it split when it meets the run again; one further behind is only brought forward (`recovery.after_failed_round`)
_LINEAGE_HEX = 16  # hex digits of each (64 bits: two different thetas never match by chance)
RUNS_KEY = "composer_diloco.runs"


class SwarmError(RuntimeError):
    """The DHT could not be joined, or the run's records are missing or inconsistent."""


class NoPeerAnswered(SwarmError):
    """None of the initial peers answered the bootstrap (or all refused the run secret)."""


class IdentityInUse(SwarmError):
    """The identity file's peer ID is held by a live peer reachable from the initial peers."""


def parse_multiaddr(text: str) -> Multiaddr:
    """Parse ``--peer`` with hivemind's multiaddr, once its form passed `address_form.check_address_form` (the command
    lines check it before the heavy imports). Raises SwarmError naming the value when it does not parse."""
    try:
        return Multiaddr(text)
    except Exception as e:  # the multiaddr package raises several unrelated types
        raise SwarmError(f"--peer {text!r} is not a multiaddr (expected e.g. {PEER_EXAMPLE}): {e}") from None


def check_addresses(listen: str | None, announce: list[str]) -> None:
    """Parse ``--listen`` and every ``--announce`` with hivemind's multiaddr, once their form passed
    `address_form.check_listen_and_announce` (the command lines check it before the heavy imports). Raises SwarmError
    naming the first value that does not parse (e.g. ``/ip4/0.0.0.0/tcpp/4000``)."""
    for text, option in [(listen, "--listen"), *((a, "--announce") for a in announce)]:
        if text is None:
            continue
        try:
            Multiaddr(text)
        except Exception:
            raise SwarmError(f"{option} {text!r} is not a multiaddr (expected e.g. {LISTEN_EXAMPLE})") from None


def start_dht(*, initial_peers: list[str], listen: str | None = None, announce: list[str] | None = None,
              secret: bytes | None = None, identity_path: str | None = None,
              identity_free: bool = False, client_mode: bool = False) -> hivemind.DHT:
    """Start a hivemind DHT peer (its own p2pd daemon). ``listen`` defaults to 127.0.0.1 on a free port.

    ``secret`` closes the run: every DHT RPC is signed and checked with it, bound to the connection's peer IDs
    (`composer_diloco.outer.auth.ClosedDHT`). ``identity_path``: the private key file that fixes the peer ID
    (`composer_diloco.outer.identity`); None: a new peer ID every start. ``identity_free``: the caller knows that no
    live peer holds the key (this start made it, or took it over from the process that held it, which has ended), so
    hivemind's check that it is free is skipped: a temporary p2pd that bootstraps from the initial peers and looks the
    peer ID up, 0.5 s on an idle machine, 2-3 s on a loaded one. ``client_mode``: a read-only client (hivemind's ``client_mode``): it serves no DHT
    request, stores no one's records and enters no peer's routing table (`coordinator.status`).

    Raises:
        SwarmError: the daemon did not start, no initial peer answered (or all refused our run secret), or the
            identity is in use by a peer reachable from the initial peers.
    """
    kwargs: dict[str, Any] = {"host_maddrs": [listen or "/ip4/127.0.0.1/tcp/0"]}
    if announce:
        kwargs["announce_maddrs"] = announce
    if client_mode:
        kwargs["client_mode"] = True
    if identity_path is not None:
        kwargs["identity_path"] = identity_path
        if identity_free:
            kwargs["check_if_identity_free"] = False
    dht_type: type[hivemind.DHT] = hivemind.DHT
    if secret is not None:
        from composer_diloco.outer.auth import ClosedDHT

        dht_type, kwargs["secret"] = ClosedDHT, secret
    try:
        with keep_signal_handlers():
            return dht_type(initial_peers=initial_peers or None, start=True, **kwargs)
    except Exception as e:
        if identity_path is not None and "already taken" in str(e):
            raise IdentityInUse(f"the identity in {identity_path!r} is in use by a live peer of this swarm (another "
                                f"process started with it): stop that process, or give this one its own key "
                                f"(another --run-dir for a coordinator, another --name for a node)") \
                from None
        if initial_peers and "bootstrap" in str(e):
            hint = ("It also refuses a wrong run secret: check --secret-file / COMPOSER_DILOCO_SECRET" if secret
                    else "A closed run also refuses peers without its secret: --secret-file or COMPOSER_DILOCO_SECRET")
            raise NoPeerAnswered(f"no peer answered at --peer {' '.join(initial_peers)} (is the coordinator running "
                             f"and reachable from here? {hint})") from None
        where = f"peers {initial_peers}" if initial_peers else f"address {kwargs['host_maddrs'][0]}"
        raise SwarmError(f"could not start a DHT peer with {where}: {type(e).__name__}: {e}") from None


def visible_multiaddr(dht: hivemind.DHT) -> str:
    """The first address other peers can dial, with its /p2p/ part: what `composer-node --peer` takes."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    if not addrs:
        raise SwarmError("the DHT peer has no visible address")
    return addrs[0]


def publish_config(dht: hivemind.DHT, config: RunConfig, attempts: int = 5, retry_s: float = 1.0) -> None:
    """Store the run config (canonical JSON) in the DHT registry of runs, for nodes to read.

    hivemind's ``store`` is False when none of the nodes it chose took the record: right after a restart, its routing
    table may still name peers that died with the last life (seen in CI: a coordinator restarted beside live nodes
    exited on one such store). It is tried ``attempts`` times, ``retry_s`` seconds apart.

    Raises:
        SwarmError: the DHT refused the record every time.
    """
    for attempt in range(attempts):
        if dht.store(RUNS_KEY, config.to_json(), get_dht_time() + _RECORD_TTL_S, subkey=config.run_name):
            return
        if attempt + 1 < attempts:
            time.sleep(retry_s)
    raise SwarmError(f"could not store the config of run {config.run_name!r} in the DHT ({attempts} tries, "
                     f"{retry_s:.0f} s apart)")


def fetch_run_config(dht: hivemind.DHT, *, run_name: str | None, timeout_s: float) -> RunConfig:
    """Read and validate a run config from the DHT, retrying for ``timeout_s`` seconds.

    Args:
        run_name: which run; None = the only run on this DHT.
    Raises:
        SwarmError: no run (or not the named one) appeared within ``timeout_s``, or several runs and no name.
        ConfigError: the published config does not validate.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = dht.get(RUNS_KEY, latest=True)
        runs = {}
        if found is not None and isinstance(found.value, dict):
            runs = {str(k): v.value for k, v in found.value.items() if isinstance(getattr(v, "value", None), str)}
        if run_name is None and len(runs) > 1:
            raise SwarmError(f"this DHT holds several runs {sorted(runs)}: pass --run-name")
        chosen = runs.get(run_name) if run_name is not None else next(iter(runs.values()), None)
        if chosen is not None:
            return RunConfig.from_json(chosen)
        if time.monotonic() > deadline:
            what = f"run {run_name!r}" if run_name else "any run"
            raise SwarmError(f"no config of {what} appeared in the DHT within {timeout_s:.0f} s "
                             "(is the coordinator at --peer running?)")
        time.sleep(0.5)


class Swarm:
    """This peer's records in the DHT: heartbeats and the round barrier.

    Args:
        dht: a started DHT.
        run_name: the run's key prefix.
        peer_name: this peer's unique name (``coordinator`` or ``node-<...>``).
        role: ``"coordinator"`` or ``"node"``.
        secret: the run secret of a closed run (None = open); `DiLoCoPeer` derives its averager from it.
    """

    def __init__(self, dht: hivemind.DHT, *, run_name: str, peer_name: str, role: str, secret: bytes | None = None,
                 initial_peers: list[str] | None = None):
        self.dht, self.run, self.name, self.role = dht, run_name, peer_name, role
        self.secret = secret
        self.initial_peers = list(initial_peers or [])
        # peer name -> its last heartbeat a read returned (`_unexpired`; the multiaddrs `_redial_loop` dials)
        self._last_read: dict[str, PeerRecord] = {}
        self.round = 0
        self.round_since = get_dht_time()
        self.sha = ""
        self.settled = True
        self.history: dict[int, str] = {}  # round -> SHA-256 of theta at its start, for the settled rounds seen here
        self.info: dict[str, Any] = {}  # what every heartbeat tells readers of the swarm (`set_info`)
        self._maddr = ""
        self._ttl_s: float | None = None
        self._period_s: float | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._redial: threading.Thread | None = None
        self._joining: threading.Thread | None = None
        self._joined = threading.Event()  # set when the heartbeat starts: the joining record is no longer renewed
        self.joined_late = False  # `announce_joining` saw other nodes training: this node catches up (`DiLoCoRounds`)

    # -- joiners --------------------------------------------------------------------------------------------
    def announce_joining(self, period_s: float, ttl_s: float, join_grace_s: float) -> int:
        """Tell the round barrier that this node is setting up to join, before its first heartbeat.

        A node's heartbeat starts only once its model is built and theta downloaded (seconds on a CPU, minutes for
        a large model); until then `wait_for_round` could not know of it, and nodes launched together missed the
        run's first round whenever one finished setting up an inner phase before another (three CI failures: the
        others passed round 0's barrier before the late one's first heartbeat). Like torchft's Lighthouse, which
        waits its ``join_timeout`` for replicas that asked to join, the barrier now waits for a joiner that said so.

        The round this node means to join is decided here, once, by `joins_round`: the swarm's newest round if it
        has been underway for at most ``join_grace_s`` seconds, else the next one. A record ``{run}.joining`` (subkey = this peer's name: round, multiaddr, time) is renewed every
        ``period_s`` seconds with a ``ttl_s`` expiry until `start_heartbeat`, so a joiner that dies is waited for
        at most ``ttl_s`` (or less: its dial fails, `_ping_the_late`).

        It also sets ``joined_late``: another node's heartbeat says it trains a round past the run's first (it trains
        while this node sets up), so this node's first inner phase ends when the others are ready
        (`composer_diloco.diloco.DiLoCoRounds`). The run's first round is never caught up: every node that joins it
        trains its H steps (nodes launched together, of which the quickest may beat before the slowest announces).
        A late joiner says so in its ``info`` (``joined_late``, in this record and its heartbeats) until its first
        inner phase begins (`set_info` with ``phase="inner"``, stored at once): the barrier does not wait for its set-up (`wait_for_round`), which
        under churn held every other node for a standby's takeover, 7-10 s a kill on a 2-core box, to gain one
        inner step of the joiner's (BENCHMARKS 3m).

        Returns:
            The round this node means to join (the barrier of that round waits for it from its first inner phase on,
            and, when it is not ``joined_late``, from now on).
        """
        peers = [p for p in self.live_peers() if p.name != self.name]
        self.joined_late = any(p.role == "node" and p.round > 0 for p in peers)
        if self.joined_late:
            self.info["joined_late"] = True
        newest = max((p.round for p in peers), default=0)
        intended = newest if joins_round(peers, newest, join_grace_s, get_dht_time()) else newest + 1
        try:
            maddr = visible_multiaddr(self.dht)
        except SwarmError:
            maddr = ""

        def store() -> Any:
            value = {"round": intended, "maddr": maddr, "t": get_dht_time(), "info": dict(self.info)}
            return self.dht.store(f"{self.run}.joining", value, get_dht_time() + ttl_s, subkey=self.name,
                                  return_future=True)

        def renew() -> None:
            while not self._joined.is_set() and not self._stop.wait(period_s):
                if not self._joined.is_set():
                    try:
                        store()
                    except Exception as e:  # a missed renewal is harmless; the next one retries
                        log.debug("joining record failed: %r", e)

        try:
            store().result(timeout=ttl_s)
        except Exception as e:
            log.debug("joining record failed: %r", e)
        self._joining = threading.Thread(target=renew, name=f"joining-{self.name}", daemon=True)
        self._joining.start()
        return intended

    def joining_peers(self) -> list[PeerRecord]:
        """Nodes setting up to join (`announce_joining`) whose record has not expired, as records of the round they
        mean to join (``t`` = their record's last renewal; ``info``: what they had set by then, `set_info`)."""
        return [PeerRecord(name, "node", int(v["round"]), float(v["t"]), float(v["t"]), str(v.get("maddr", "")),
                           info=dict(v["info"]) if isinstance(v.get("info"), dict) else {})
                for name, v in self._records("joining", {"round", "t"}).items()]

    # -- heartbeats ---------------------------------------------------------------------------------------
    def start_heartbeat(self, period_s: float, ttl_s: float) -> None:
        """Publish this peer's record every ``period_s`` seconds, each valid for ``ttl_s`` seconds."""

        def beat() -> None:
            # A store returns when every replica answered or timed out: with an unreachable replica (a peer just
            # killed, a partition) that took 3-6 s, longer than a test's 4 s TTL, so a peer's own record expired
            # while its heartbeat thread was still waiting. Each beat goes out on time instead; a store still in
            # flight keeps reaching the replicas that answer.
            pending: list = []
            while not self._stop.is_set():
                pending = [f for f in pending if not f.done()]
                if len(pending) < _MAX_PENDING_BEATS:
                    try:
                        pending.append(self._store_heartbeat(ttl_s, wait=False))
                    except Exception as e:  # a missed heartbeat is harmless; the next one retries
                        log.debug("heartbeat failed: %r", e)
                self._stop.wait(period_s)

        self._joined.set()
        self._ttl_s, self._period_s = ttl_s, period_s
        try:
            self._maddr = visible_multiaddr(self.dht)
        except SwarmError:
            self._maddr = ""
        self._store_heartbeat(ttl_s)
        self._heartbeat = threading.Thread(target=beat, name=f"heartbeat-{self.name}", daemon=True)
        self._heartbeat.start()
        self._redial = threading.Thread(target=self._redial_loop, args=(max(period_s, 5.0),),
                                        name=f"redial-{self.name}", daemon=True)
        self._redial.start()

    # -- finding the swarm again after a partition -------------------------------------------------------------
    def _redial_loop(self, period_s: float, forget_s: float = 1800.0) -> None:
        """Every ``period_s`` seconds, ping the peers this one saw alive (and its ``--peer``s) whose heartbeat is gone.

        hivemind's DHT drops a peer from its routing table when an RPC to it fails and never looks for it again, so a
        partition (a link down for longer than a heartbeat's TTL) would leave two halves of the run that each see only
        themselves, for good. A ping that is answered puts both peers back into each other's routing table (hivemind's
        ``DHTProtocol.call_ping``), and the halves see each other's records again; `recovery.split_check` then brings
        every replica back to one theta. Peers not seen for ``forget_s`` seconds are no longer dialled.
        """
        while not self._stop.wait(period_s):
            try:
                live = self.live_peers()  # and into `_last_read`
                now = get_dht_time()
                alive = {p.name for p in live} | {p.peer_id for p in live}
                # a name setting up again (a standby's takeover, a restart) is a new life, not a partition: it dials
                # the peers its last life saw itself (`Node`), and its peer ID would answer this ping at once
                alive |= {p.name for p in self.joining_peers()}
                lost = {p.maddr for name, p in list(self._last_read.items())
                        if p.maddr and name != self.name and name not in alive and now - p.t < forget_s}
                lost |= {m for m in self.initial_peers if m.rsplit("/p2p/", 1)[-1] not in alive}
                if lost:
                    answered = self.dht.run_coroutine(partial(_ping_peers, maddrs=sorted(lost)))
                    if answered:
                        log.warning("%s: reached %s again (their heartbeats had expired: a partition?)", self.name,
                                    ", ".join(answered))
            except Exception as e:  # a failed look or ping is retried next period
                log.debug("redial failed: %r", e)

    def set_round(self, round_: int, sha: str = "", *, settled: bool = True) -> None:
        """Record the round this peer now trains toward (and theta's SHA-256 for it), and publish it at once.

        ``settled=False``: theta may still be replaced by a group member's (after an incomplete all-reduce). A
        settled hash joins `history`, which the heartbeats publish (their last `LINEAGE_ROUNDS` rounds)."""
        if round_ != self.round or self._ttl_s is None:  # a new round, or the first one this peer trains
            self.round_since = get_dht_time()
        self.round, self.sha, self.settled = round_, sha, settled
        if sha and settled:
            self.history[round_] = sha
        if self._ttl_s is not None:
            try:
                self._store_heartbeat(self._ttl_s)
            except Exception as e:
                log.debug("heartbeat failed: %r", e)

    def set_info(self, publish: bool = False, **fields: Any) -> None:
        """Add or replace fields of this peer's ``info``, which rides in every heartbeat from the next one on
        (`PeerRecord.info`; `coordinator.status` shows it): e.g. ``device``, ``precision``, ``phase``, the last
        round's ``inner_seconds`` / ``sync_seconds`` / ``samples``. A field set to None is removed. The next beat
        (every ``heartbeat_s`` seconds) carries them; ``publish``: store a heartbeat now as well (without waiting
        for the store), once the heartbeat has started.

        Values must be what the DHT's msgpack serializer takes (str, int, float, bool, None, and lists or
        str-keyed dicts of them); that is checked by the store, not here.

        A late joiner's first ``phase="inner"`` also drops ``joined_late`` and is stored at once: the barrier of its
        round waits for it from then on (`announce_joining`, `setting_up_late`)."""
        if fields.get("phase") == "inner" and self.info.get("joined_late"):
            fields["joined_late"], publish = None, True
        for key, value in fields.items():
            if value is None:
                self.info.pop(key, None)
            else:
                self.info[key] = value
        if publish and self._ttl_s is not None:
            try:
                self._store_heartbeat(self._ttl_s, wait=False)
            except Exception as e:  # a missed heartbeat is harmless; the next one retries
                log.debug("heartbeat failed: %r", e)

    def _store_heartbeat(self, ttl_s: float, *, wait: bool = True) -> Any:
        """Store this peer's record, valid ``ttl_s`` seconds. ``wait=False`` returns the store's future at once."""
        lineage = [[r, self.history[r][:_LINEAGE_HEX]] for r in sorted(self.history)[-LINEAGE_ROUNDS:]]
        value = {"role": self.role, "round": self.round, "since": self.round_since, "sha": self.sha,
                 "settled": self.settled, "lineage": lineage, "maddr": self._maddr, "t": get_dht_time(),
                 "info": dict(self.info)}
        return self.dht.store(f"{self.run}.peers", value, get_dht_time() + ttl_s, subkey=self.name,
                              return_future=not wait)

    def live_peers(self) -> list[PeerRecord]:
        """Peers whose heartbeat has not expired, as this DHT read returned them."""
        out = []
        for name, v in self._records("peers", {"role", "round", "t"}).items():
            lineage = {int(r): str(h) for r, h in v.get("lineage", []) if isinstance(h, str)}
            info = v.get("info")
            out.append(PeerRecord(name, str(v["role"]), int(v["round"]), float(v["t"]), float(v.get("since", v["t"])),
                                  str(v.get("maddr", "")), str(v.get("sha", "")), bool(v.get("settled", True)),
                                  lineage, dict(info) if isinstance(info, dict) else {}))
        for p in out:
            self._last_read[p.name] = p
        return out

    def still_in_round(self, round_: int, names: list[str]) -> list[str]:
        """Which of ``names`` are live peers at round ``round_`` or behind it (not past it), a heartbeat that this
        read missed but an earlier one returned counting until its TTL (`_unexpired`)."""
        wanted = set(names)
        return sorted({p.name for p in self._unexpired(self.live_peers()) if p.name in wanted and p.round <= round_})

    def _unexpired(self, peers: list[PeerRecord]) -> list[PeerRecord]:
        """``peers`` (one DHT read) and the heartbeats earlier reads returned of peers this one did not, whose TTL
        (``heartbeat_ttl_s``, the same on every peer of a run) has not run out: a record still stored that a read
        under load missed. The barrier once went on without a live node that way, in the middle of its inner phase,
        and the round split into two groups (churn with a standby per node, `bench/churn.py`)."""
        if self._ttl_s is None:
            return peers
        now, read = get_dht_time(), {p.name for p in peers}
        return peers + [p for name, p in list(self._last_read.items())
                        if name not in read and name != self.name and now < p.t + self._ttl_s]

    def _records(self, key: str, required: set[str]) -> dict[str, dict]:
        """The unexpired subkey records of ``{run}.{key}`` (subkey = peer name -> its dict value), those holding the
        ``required`` fields: what `live_peers`, `joining_peers` and `ready_peers` read."""
        found = self.dht.get(f"{self.run}.{key}", latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(name): item.value for name, item in found.value.items()
                if isinstance(getattr(item, "value", None), dict) and required <= item.value.keys()}

    # -- the round barrier --------------------------------------------------------------------------------
    def announce_ready(self, round_: int, weight: float) -> None:
        """Tell the swarm this peer finished the inner phase of ``round_`` with ``weight`` samples."""
        self.dht.store(
            f"{self.run}.ready.{round_}", {"t": get_dht_time(), "weight": float(weight), "role": self.role},
            get_dht_time() + _RECORD_TTL_S, subkey=self.name,
        )

    def record_averaged(self, round_: int, members: list[str]) -> None:
        """Record that this peer's group averaged ``round_`` with the pseudo-gradients of ``members`` (names, the
        ones screening dropped left out; ``[name]`` for a round this peer stepped alone): a node's next life reads it
        to learn whether the phase its last life handed off reached the model (`averaged_with`,
        `composer_diloco.inner.journal`). Not waited for: every member of the group stores the same."""
        self.dht.store(f"{self.run}.averaged.{round_}", {"t": get_dht_time(), "members": list(members)},
                       get_dht_time() + _RECORD_TTL_S, subkey=self.name, return_future=True)

    def averaged_with(self, round_: int) -> set[str] | None:
        """The names whose pseudo-gradients a group that averaged ``round_`` counted (every group's, for a round
        matchmaking split), or None when no peer recorded averaging it (`record_averaged`)."""
        records = self._records(f"averaged.{round_}", {"members"})
        if not records:
            return None
        return {str(n) for v in records.values() if isinstance(v["members"], list) for n in v["members"]}

    def ready_peers(self, round_: int) -> dict[str, dict]:
        """Peers that announced ``round_`` ready (`announce_ready`): name -> ``{"t", "weight", "role"}``."""
        return self._records(f"ready.{round_}", set())

    def wait_for_round(self, round_: int, *, slack_s: float, matchmaking_s: float,
                       stop: threading.Event | None = None, poll_s: float = 0.1) -> tuple[float, list[str]] | None:
        """Block until every live node training toward ``round_`` is ready, and the live coordinator too, or
        ``slack_s`` after the first ready node.

        A live peer is one whose last heartbeat's TTL has not run out, whether this poll's DHT read returned it or
        an earlier one did (`_unexpired`). Live nodes whose heartbeat says an earlier round are waited for too (they are finishing the previous
        all-reduce); so is a live coordinator at ``round_`` or ``round_ - 1`` (saving the previous round's
        checkpoint, or a starved process): nodes that went on without it would leave it to download theta from one
        of them, and the round without the peer that keeps the canonical model. A peer that never arrives is given
        up ``slack_s`` after the first ready node.

        So is a node that announced it is setting up to join ``round_`` (`announce_joining`) and has no heartbeat
        yet: nodes launched together all train the run's first round. A node that joined a swarm already past its
        first round is not waited for while it sets up (`setting_up_late`: a restart, a standby's takeover, a node
        added), only from its first inner phase on: once another node of its round is ready it would bring one inner
        step (`DiLoCoRounds.caught_up`) for the whole set-up's wait of every other peer; it takes the next round's
        state instead (`DiLoCoPeer.join_at_round_boundary`). Nor is the last heartbeat of a life that ended once its
        name announced itself again (`superseded`: a standby's takeover keeps the peer ID, so the dead life's
        multiaddr answers the ping below; under churn the barrier waited 10-12 s for it at every kill, BENCHMARKS 3m).

        A peer waited for whose heartbeat is late (older than 1.5 heartbeat periods) is dialed at its multiaddr, at
        most once a period (`_ping_the_late`): one whose dial fails (its process killed: its p2pd is gone, the dial
        is refused) is not waited for, instead of until its heartbeat's TTL ends. A dial that connects is enough to
        keep waiting (a loaded peer may be slow to answer a DHT ping; one CI run lost a live node at round 0,
        perhaps that way). A newer heartbeat of it brings it
        back. Under churn this was the barrier's largest wait: every kill held each other peer for up to the TTL.

        ``poll_s``: seconds between two reads of the round's records. Every peer but the last one ready learns that
        the round is complete at its next read, and the all-reduce starts once all of them are in it: at 0.25 s that
        wait was ~0.125 s of every round's barrier on average (three DHT reads a poll, only while a round waits).

        Returns:
            ``(scheduled_time, ready_nodes)``: the DHT time at which all peers start the all-reduce (the same
            on every peer when all were ready) and the names of the ready nodes; None if ``stop`` was set.
        """
        unanswered: dict[str, float] = {}  # name -> the heartbeat time (``t``) it did not answer a ping after
        pinged: dict[str, float] = {}  # name -> time.monotonic() of its last ping
        while stop is None or not stop.is_set():
            announced = self.ready_peers(round_)
            ready = {n: v for n, v in announced.items() if v.get("role") == "node"}
            if ready:
                joining = {p.name: p for p in self.joining_peers()}
                # the last heartbeat of a life that ended is not waited for once its name set up again
                peers = [p for p in self._unexpired(self.live_peers()) if not superseded(p, joining)]
                # live nodes at this round or behind it (finishing the previous sync) are still coming
                waited = [p for p in peers if (p.role == "node" and p.round <= round_ and not setting_up_late(p))
                          or (p.role == "coordinator" and round_ - 1 <= p.round <= round_)]
                # and nodes still setting up to join this very round (not those given up at an earlier one, nor late
                # joiners: they wait for the next round boundary when they find this round's nodes ready)
                beating = {p.name for p in peers}
                waited += [p for p in joining.values()
                           if p.round == round_ and p.name not in beating and not setting_up_late(p)]
                self._ping_the_late(round_, [p for p in waited if p.name not in announced], unanswered, pinged)
                live = {p.name for p in waited if unanswered.get(p.name) != p.t}
                first = min(v["t"] for v in ready.values())
                if live <= announced.keys():
                    return max(v["t"] for v in announced.values()) + matchmaking_s, sorted(ready)
                if get_dht_time() > first + slack_s:
                    missing = sorted(live - announced.keys())
                    log.warning("round %d: going on without %s after %.0f s", round_, missing, slack_s)
                    return first + slack_s + matchmaking_s, sorted(ready)
            time.sleep(poll_s)
        return None

    def _ping_the_late(self, round_: int, missing: list[PeerRecord], unanswered: dict[str, float],
                       pinged: dict[str, float]) -> None:
        """Dial the peers of ``missing`` whose heartbeat is late, each at most once a heartbeat period; record in
        ``unanswered`` (name -> its heartbeat's ``t``) those whose dial fails (`wait_for_round`)."""
        if self._period_s is None:  # no heartbeat of our own yet: no period to call a beat late by
            return
        now, mono = get_dht_time(), time.monotonic()
        late = [p for p in missing if p.maddr and now - p.t > 1.5 * self._period_s and unanswered.get(p.name) != p.t
                and mono - pinged.get(p.name, -1e9) >= self._period_s]
        if not late:
            return
        for p in late:
            pinged[p.name] = mono
        try:
            answered = set(self.dht.run_coroutine(partial(_ping_peers, maddrs=[p.maddr for p in late],
                                                          dial_only=True)))
        except Exception as e:  # a failed look is no verdict: the TTL still ends the wait
            log.debug("barrier ping failed: %r", e)
            return
        for p in late:
            if p.maddr not in answered:
                unanswered[p.name] = p.t
                log.info("round %d: not waiting for %s: its heartbeat is %.1f s old and it does not answer a ping "
                         "(the dial failed)",
                         round_, p.name, now - p.t)

    def close(self) -> None:
        """Stop the heartbeat and redial threads (the DHT is shut down by its owner)."""
        self._stop.set()
        self._joined.set()
        if self._joining is not None:
            self._joining.join(timeout=5)
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self._redial is not None:
            self._redial.join(timeout=5)


async def _ping_peers(dht: hivemind.DHT, node: Any, *, maddrs: list[str], timeout_s: float = 5.0,
                      dial_only: bool = False) -> list[str]:
    """In the DHT's process: dial each multiaddr and ping its DHT peer (both add each other to their routing tables).
    Returns the multiaddrs that answered. ``dial_only``: those whose libp2p daemon took the connection, pinged or
    not (a process under load may be slow to answer a DHT ping; a dead one refuses the dial)."""
    from hivemind.p2p import PeerID

    async def ping(text: str) -> str | None:
        address, _, peer_id = text.rpartition("/p2p/")
        pid = PeerID.from_base58(peer_id)
        try:  # the libp2p peerstore may have forgotten the address: give it again
            await asyncio.wait_for(node.p2p._client.connect(pid, [Multiaddr(address)]), timeout_s)
        except Exception:
            return None
        if dial_only:
            return text
        return text if await node.protocol.call_ping(pid) is not None else None

    found = await asyncio.gather(*(ping(m) for m in maddrs))
    return [m for m in found if m]


__all__ = ["ConfigError", "LINEAGE_ROUNDS", "PeerRecord", "Swarm", "SwarmError", "check_addresses", "fetch_run_config",
           "all_reduce_began", "first_divergence", "joins_round", "parse_multiaddr", "publish_config", "replica_thetas", "start_dht",
           "visible_multiaddr"]
