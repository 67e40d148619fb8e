"""`composer-coordinator status`: read the swarm's state from the run's DHT and render it.

A status client joins the DHT in hivemind's client mode (`composer_diloco.outer.swarm.start_dht` with
``client_mode=True``): it serves no DHT request, stores nothing, enters no peer's routing table, publishes no heartbeat
and no joining record and has no averager, so it never counts as a node and never appears in a round's peers. In a
closed run it needs the run secret like any peer (`composer_diloco.outer.auth.ClosedDHT`); without it (or with a
wrong one) no peer answers its bootstrap and it stops with one line naming the secret.

What it reads: every live peer's heartbeat (`Swarm.live_peers`, with the ``info`` the peers set through
`Swarm.set_info`: device, precision, phase, the last round's inner/sync seconds and samples), the nodes still setting
up (`Swarm.joining_peers`), and the coordinator's facts about its last round (`round_facts`: the group, the peers it
went on without and those whose pseudo-gradient screening dropped, each with the reason). Whether the replicas agree
on the last round is judged from the theta hashes the heartbeats carry (`peer_records.replica_thetas`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composer_diloco.outer.peer_records import PeerRecord, replica_thetas

if TYPE_CHECKING:  # the heavy imports (hivemind, rich) wait until a status is read or drawn
    from composer_diloco.config import RunConfig
    from composer_diloco.outer.peer import SyncResult
    from composer_diloco.outer.swarm import Swarm

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 15.0
REFRESH_S = 2.0
_HASH_DIGITS = 12  # hex digits of a theta hash shown


class StatusError(RuntimeError):
    """The status could not be read: the address does not parse, no peer answered within the timeout (or none took
    our run secret), or the DHT holds no run config. The message is one line."""


# -- what the coordinator publishes ------------------------------------------------------------------------------
def round_facts(result: SyncResult, live: list[PeerRecord], previous_group: list[str],
                now: float | None = None) -> dict[str, Any]:
    """The run-level facts of the coordinator's round ``result``, for its heartbeat ``info`` (`Swarm.set_info`).

    Args:
        result: the coordinator's `SyncResult` of the round that just ended.
        live: the live peers' heartbeats now (`Swarm.live_peers`).
        previous_group: the all-reduce group of the coordinator's round before (its last ``group`` fact; [] at
            the first).
        now: DHT time (seconds since the epoch; default: now), for the heartbeat ages the reasons give.
    Returns:
        ``last_round`` (int), ``last_status`` (the round's `SyncStatus`), ``group`` (sorted names of the
        all-reduce's peers), ``dropped`` (name -> reason: a live node at that round or behind that was not in the
        group, or a peer of the previous group whose heartbeat is gone) and ``screened`` (name -> why screening
        dropped its pseudo-gradient), ``sync_seconds`` (the coordinator's). ``dropped`` is empty when no group formed
        (the coordinator stepped alone or took a peer's state).
    """
    members = set(result.members)
    now = time.time() if now is None else now  # hivemind's DHT time is the wall clock
    alive = {p.name: p for p in live}
    dropped: dict[str, str] = {}
    if members:
        for p in live:
            if p.role == "node" and p.name not in members and p.round <= result.round:
                dropped[p.name] = (f"not in round {result.round}'s all-reduce; its heartbeat: round {p.round}, "
                                   f"{max(now - p.t, 0.0):.0f} s old")
        for name in previous_group:
            if name not in members and name not in alive:
                dropped[name] = f"in round {result.round - 1}'s all-reduce, then its heartbeat expired"
    screened = {n: result.rejected_reasons.get(n, "dropped by screening") for n in result.rejected}
    return {"last_round": result.round, "last_status": str(result.status), "group": sorted(members),
            "dropped": dropped, "screened": screened, "sync_seconds": round(result.sync_seconds, 3)}


# -- reading the swarm --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SwarmStatus:
    """One read of the swarm.

    Attributes:
        run_name: the run's name; rounds: the run config's number of rounds.
        peers: the live peers' heartbeats (`PeerRecord`), the coordinator first, then the nodes by name.
        joining: nodes setting up to join that have no heartbeat yet (``round``: the round they mean to join).
        now: DHT time of the read (seconds since the epoch): heartbeat ages are ``now - PeerRecord.t``.
        heartbeat_s: the run's seconds between heartbeats; an age over twice that is shown as late (a peer that
            stopped: its record lasts ``heartbeat_ttl_s``).
    """

    run_name: str
    rounds: int
    peers: list[PeerRecord]
    joining: list[PeerRecord] = field(default_factory=list)
    now: float = 0.0
    heartbeat_s: float = 2.0

    @property
    def coordinator(self) -> PeerRecord | None:
        """The live coordinator's heartbeat, None when it is not alive."""
        return next((p for p in self.peers if p.role == "coordinator"), None)

    @property
    def round(self) -> int | None:
        """The run's round: the one the live coordinator is in, else the newest a live node is in; None when no peer
        is alive."""
        if self.coordinator is not None:
            return self.coordinator.round
        return max((p.round for p in self.peers), default=None)

    @property
    def facts(self) -> dict[str, Any]:
        """The coordinator's facts about its last round (`round_facts`); {} without a live coordinator, or before
        its first round ended."""
        c = self.coordinator
        return dict(c.info) if c is not None and "last_round" in c.info else {}


class StatusClient:
    """A read-only client of a run's DHT (see module docstring).

    Args:
        peers: multiaddrs of peers of the run (``--peer``), each with its ``/p2p/<id>`` part.
        secret: the run secret of a closed run (None: an open run).
        run_name: which run (None: the only one on this DHT).
        timeout_s: seconds to reach a peer and read the run config, at most.

    Use `open` once, then `read` as often as wanted, then `close`.
    """

    def __init__(self, peers: list[str], *, secret: bytes | None = None, run_name: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.peers, self.secret, self.run_name, self.timeout_s = list(peers), secret, run_name, timeout_s
        self.dht = None
        self.config: RunConfig | None = None
        self.swarm: Swarm | None = None

    def open(self) -> RunConfig:
        """Join the DHT as a client and read the run config, within ``timeout_s`` seconds.

        Returns:
            The run's config.
        Raises:
            StatusError: a ``--peer`` is not a multiaddr; no peer answered (or none took our run secret); no run
                config appeared; or ``timeout_s`` passed first. One line each.
        """
        from composer_diloco.outer.swarm import SwarmError, parse_multiaddr

        try:
            for text in self.peers:
                parse_multiaddr(text)
        except SwarmError as e:
            raise StatusError(str(e)) from None
        outcome: dict[str, Any] = {}
        started = time.monotonic()
        thread = threading.Thread(target=self._connect, args=(outcome, started), name="status-connect", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if "error" in outcome:
            raise StatusError(outcome["error"])
        if thread.is_alive() or self.config is None:
            self.close()  # a DHT that started late is left to the process's exit (and its reaper)
            hint = ("is the coordinator running and reachable from here? A closed run also refuses a client without "
                    "its secret: --secret-file or COMPOSER_DILOCO_SECRET")
            raise StatusError(f"no answer from --peer {' '.join(self.peers)} within {self.timeout_s:.0f} s "
                              f"(--timeout; {hint})")
        return self.config

    def _connect(self, outcome: dict[str, Any], started: float) -> None:
        """`open`'s work, in a thread that `open` waits for at most ``timeout_s``: start the DHT, read the config."""
        from composer_diloco.config import ConfigError
        from composer_diloco.outer.swarm import Swarm, SwarmError, fetch_run_config, start_dht

        try:
            dht = start_dht(initial_peers=self.peers, secret=self.secret, client_mode=True)
            self.dht = dht
            left = max(self.timeout_s - (time.monotonic() - started) - 0.5, 0.5)
            config = fetch_run_config(dht, run_name=self.run_name, timeout_s=left)
            self.swarm = Swarm(dht, run_name=config.run_name, peer_name="status", role="status", secret=self.secret)
            self.config = config
        except (SwarmError, ConfigError) as e:
            outcome["error"] = str(e)
        except Exception as e:  # a DHT that broke in some other way: still one line
            outcome["error"] = f"could not read the run from --peer {' '.join(self.peers)}: {type(e).__name__}: {e}"

    def read(self) -> SwarmStatus:
        """One read of the swarm (two DHT reads, milliseconds on a LAN).

        Raises:
            StatusError: `open` did not succeed first.
        """
        if self.swarm is None or self.config is None:
            raise StatusError("the status client is not open")
        from hivemind.utils.timed_storage import get_dht_time

        live = self.swarm.live_peers()
        beating = {p.name for p in live}
        joining = sorted((p for p in self.swarm.joining_peers() if p.name not in beating), key=lambda p: p.name)
        live.sort(key=lambda p: (p.role != "coordinator", p.name))
        return SwarmStatus(self.config.run_name, self.config.rounds, live, joining, get_dht_time(),
                           self.config.network.heartbeat_s)

    @property
    def peer_id(self) -> str:
        """This client's libp2p peer ID (base58), "" before `open`: it is no peer of the run, and no record names it."""
        return str(self.dht.peer_id) if self.dht is not None else ""

    def close(self) -> None:
        """Shut the DHT client down (idempotent)."""
        dht, self.dht, self.swarm = self.dht, None, None
        if dht is not None:
            dht.shutdown()


# -- rendering ----------------------------------------------------------------------------------------------------
def _seconds(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def _names(reasons: dict[str, str]) -> str:
    return "; ".join(f"{n} ({r})" for n, r in sorted(reasons.items())) or "none"


def summary_lines(status: SwarmStatus) -> list[str]:
    """The lines under the table: the run's round, the last round's outcome and agreement, who was dropped or
    screened out and why."""
    round_ = status.round
    if round_ is None:
        return [f"run {status.run_name!r}: no live peer"]
    where = "finished: round" if round_ >= status.rounds else "in round"
    lines = [f"run {status.run_name!r}: {where} {round_} of {status.rounds}"
             + ("" if status.coordinator is not None else " (no live coordinator: the newest round a node is in)")]
    if round_ == 0:
        return lines + ["last round: none finished yet"]
    facts = status.facts
    agree = replica_thetas(status.peers, round_)
    if not agree:
        verdict = "no live peer has published its theta for it yet"
    elif len(agree) == 1:
        (sha, names), = agree.items()
        verdict = f"yes, {len(names)} peer(s) on theta {sha[:_HASH_DIGITS]}"
    else:
        verdict = "NO: " + "; ".join(f"{sha[:_HASH_DIGITS]}: {', '.join(names)}" for sha, names in agree.items())
    # a node still loading the round's average (its sync ends a moment after the coordinator's) is named, not miscounted
    published = {n for names in agree.values() for n in names}
    dropped = facts.get("dropped") or {}
    finishing = sorted(p.name for p in status.peers if p.round == round_ - 1 and p.info.get("phase") == "sync"
                       and p.name not in published and p.name not in dropped)
    if finishing:
        verdict += f"; still finishing it: {', '.join(finishing)}"
    lines.append(f"last round {round_ - 1}: agreement: {verdict}")
    if facts:  # the coordinator's word on its last round (published right after it; a read between sees the one before)
        group = facts.get("group") or []
        lines.append(f"round {facts.get('last_round')} at the coordinator: {facts.get('last_status', '?')}, "
                     f"{len(group)} peer(s) ({', '.join(group) or 'no group'}); dropped: "
                     f"{_names(facts.get('dropped') or {})}; screened: {_names(facts.get('screened') or {})}")
    return lines


COLUMNS = ("peer", "role", "device", "dtype", "round", "phase", "inner s", "sync s", "samples", "age s")
"""The table's columns: ``dtype`` is the training precision; ``inner s``, ``sync s`` and ``samples`` are of the peer's
last finished round; ``age s``, the seconds since its last heartbeat."""


def table_rows(status: SwarmStatus) -> list[list[str]]:
    """The table's rows (`COLUMNS`), as text: the live peers, then the nodes still setting up (phase ``joining``,
    round: the one they mean to join). A heartbeat older than twice ``heartbeat_s`` reads ``late``."""

    def age(p: PeerRecord) -> str:
        seconds = max(status.now - p.t, 0.0)
        return f"{seconds:.1f}" + (" late" if seconds > 2 * status.heartbeat_s else "")

    rows = []
    for p in status.peers:
        i = p.info
        rows.append([p.name, p.role, str(i.get("device", "")), str(i.get("precision", "")), str(p.round),
                     str(i.get("phase", "")), _seconds(i.get("inner_seconds")), _seconds(i.get("sync_seconds")),
                     str(i.get("samples", "")), age(p)])
    for p in status.joining:
        rows.append([p.name, p.role, str(p.info.get("device", "")), str(p.info.get("precision", "")), str(p.round),
                     "joining", "", "", "", age(p)])
    return rows


def render(status: SwarmStatus) -> Any:
    """The status as one rich renderable: the peers' table, then `summary_lines`."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"run {status.run_name!r}: {len(status.peers)} live peer(s), {len(status.joining)} joining "
                        f"(read {time.strftime('%H:%M:%S', time.localtime(status.now))})", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in COLUMNS:  # a narrow terminal wraps the cells; a peer's name is folded, never cut
        numeric = column in COLUMNS[4:] and column != "phase"
        table.add_column(column, justify="right" if numeric else "left", overflow="fold" if column == "peer" else
                         "ellipsis")
    for row in table_rows(status):
        table.add_row(*row)
    return Group(table, *(Text(line) for line in summary_lines(status)))


def run_status(client: StatusClient, *, watch: bool = False, refresh_s: float = REFRESH_S, console: Any = None,
               stop: threading.Event | None = None) -> None:
    """Open ``client``, then print the status once, or with ``watch`` redraw it every ``refresh_s`` seconds in a rich
    live view until Ctrl-C (KeyboardInterrupt, returns) or ``stop`` is set; the client is closed at the end.

    Raises:
        StatusError: from `StatusClient.open`.
    """
    from rich.console import Console
    from rich.live import Live

    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a file: the whole table, not one cut to 80 columns
            console = Console(width=200)
    stop = stop or threading.Event()
    try:
        client.open()
        log.debug("reading as DHT client %s (client mode: no peer of the run)", client.peer_id)
        if not watch:
            console.print(render(client.read()))
            return
        with Live(render(client.read()), console=console, refresh_per_second=4, auto_refresh=False) as live:
            while not stop.wait(refresh_s):
                try:
                    live.update(render(client.read()), refresh=True)
                except Exception as e:  # a read that failed (the DHT busy): show it, try again next time
                    console.log(f"read failed: {type(e).__name__}: {e}")
    except KeyboardInterrupt:
        return
    finally:
        client.close()


__all__ = ["COLUMNS", "DEFAULT_TIMEOUT_S", "REFRESH_S", "StatusClient", "StatusError", "SwarmStatus",
           "render", "round_facts", "run_status", "summary_lines", "table_rows"]
