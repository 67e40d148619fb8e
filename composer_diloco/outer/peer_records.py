"""What a peer's heartbeat says, and the rules read from heartbeats alone: plain records, no DHT (hivemind-free, so
`composer_diloco.outer.recovery` and `coordinator.status` can be read and tested without a swarm). `Swarm`
(`composer_diloco.outer.swarm`) writes and reads these records in the DHT."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PeerRecord", "all_reduce_began", "first_divergence", "joins_round", "replica_thetas", "setting_up_late",
           "superseded"]


@dataclass(frozen=True)
class PeerRecord:
    """One live peer's heartbeat: ``since`` = DHT time it entered ``round``; ``sha`` = its theta's SHA-256 then
    ("" before its first round ends); ``maddr`` = its multiaddr; ``settled`` = False while its theta for
    ``round`` came from an incomplete all-reduce and may still be replaced by a group member's, or while it lost
    the all-reduce of ``round`` and waits for a peer's state (`composer_diloco.outer.peer`); ``lineage`` = round ->
    the first 16 hex digits of theta's SHA-256 at its start, for the peer's last settled rounds; ``info`` = the
    fields it set with `Swarm.set_info` ({} from a peer that sets none, or predates them)."""

    name: str
    role: str  # "coordinator" | "node"
    round: int
    t: float
    since: float = 0.0
    maddr: str = ""
    sha: str = ""
    settled: bool = True
    lineage: dict[int, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def peer_id(self) -> str:
        """The base58 PeerID of its multiaddr (``/p2p/<id>``; its DHT and averager share it), "" if unknown."""
        return self.maddr.rsplit("/p2p/", 1)[1] if "/p2p/" in self.maddr else ""


def all_reduce_began(peers: list[PeerRecord], round_: int) -> bool:
    """Whether a peer (the coordinator included) published that it began the all-reduce of ``round_`` or a later
    round (its heartbeat's ``info["averaging_round"]``, set by `DiLoCoPeer._all_reduce`): that group can take no
    member. A value that is not a round number does not count."""
    return any(isinstance(a := p.info.get("averaging_round"), int) and a >= round_ for p in peers)


def setting_up_late(peer: PeerRecord) -> bool:
    """Whether ``peer`` is a node that joined a swarm already past its first round (a restart, a standby's takeover, a
    node added: `Swarm.announce_joining` set ``info["joined_late"]``) and has not begun its first inner phase yet
    (``info["phase"]`` is still ``"joining"``). The round barrier does not wait for such a node
    (`Swarm.wait_for_round`)."""
    return peer.role == "node" and peer.info.get("phase") == "joining" and peer.info.get("joined_late") is True


def superseded(heartbeat: PeerRecord, joining: dict[str, PeerRecord]) -> bool:
    """Whether ``heartbeat`` is the last record of a life that ended: its name announced itself again since
    (``joining``: name -> the `Swarm.announce_joining` record, renewed each heartbeat period until that life's first
    heartbeat, whose ``t`` is then newer). A standby's takeover or a restart under the same ``--name`` keeps the peer
    ID, so the dead life's multiaddr still answers a dial (the new life's p2pd takes it) and only this tells the two
    lives apart. Both ``t`` are DHT times of the same name's processes, as a rule on one machine."""
    j = joining.get(heartbeat.name)
    return heartbeat.role == "node" and j is not None and j.t > heartbeat.t


def joins_round(peers: list[PeerRecord], round_: int, join_grace_s: float, now: float) -> bool:
    """Whether a node setting up now still joins ``round_`` (else it waits for the next round boundary).

    It does when no peer has begun the all-reduce of ``round_`` (`all_reduce_began`) and either no node is training ``round_``
    yet or the first of them entered it at most ``join_grace_s`` seconds ago (DHT time, `PeerRecord.since`): the
    others then wait for it at that round's barrier. A group whose all-reduce began cannot take a member: a node that
    joined that round (a standby taking over a node killed in it, a quick restart) trained it, found no group and
    resynced after ``allreduce_timeout_s``, while the others waited that long for it at the next round's barrier.
    The one rule `Swarm.announce_joining` (at the start of a node's set-up) and `DiLoCoPeer.join_at_round_boundary`
    (at its end, for a node that announced nothing) apply.

    Args:
        peers: the live peers' heartbeats (this node's own excluded).
        round_: the round in question; now: DHT time (`hivemind.utils.timed_storage.get_dht_time`), seconds.
    """
    if all_reduce_began(peers, round_):
        return False
    training = [p.since for p in peers if p.role == "node" and p.round == round_]
    return not training or now - min(training) <= join_grace_s


def replica_thetas(peers: list[PeerRecord], round_: int) -> dict[str, list[str]]:
    """Which theta each live peer ended round ``round_ - 1`` on (the theta it started ``round_`` with), grouped by
    hash: ``{hash prefix: [peer names]}``. One key: the replicas agree. A peer's hash is its heartbeat's ``sha``
    when it is at ``round_`` and settled, else its ``lineage`` entry for ``round_``; peers holding neither (still
    behind, or not settled) are left out.

    Args:
        peers: live heartbeats (`Swarm.live_peers`); round_: the run's round (>= 1), so ``round_ - 1`` ended.
    """
    by_hash: dict[str, list[str]] = {}
    for p in peers:
        sha = p.sha if p.round == round_ and p.settled and p.sha else p.lineage.get(round_, "")
        if sha:
            by_hash.setdefault(sha[:16], []).append(p.name)
    # hashes of different lengths (a full SHA-256 and a lineage's 16 digits) were cut to 16 above: equal ones merge
    return {h: sorted(names) for h, names in sorted(by_hash.items(), key=lambda kv: -len(kv[1]))}


def first_divergence(ours: dict[int, str], theirs: dict[int, str]) -> int | None:
    """The first round both hash tables hold where the hashes differ (compared on their common prefix), else None.

    Args:
        ours, theirs: round -> SHA-256 hex of theta at the round's start (`Swarm.history`, `PeerRecord.lineage`).
    """
    for r in sorted(ours.keys() & theirs.keys()):
        a, b = ours[r], theirs[r]
        n = min(len(a), len(b))
        if n and a[:n] != b[:n]:
            return r
    return None
