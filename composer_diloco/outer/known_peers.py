"""The peers a process saw alive, kept on disk so that its restart can dial them (``peers.json``).

A coordinator keeps them in its run dir (a restart dials the nodes of the swarm that went on without it); a node in
its own folder, ``<run-dir>/<name>/peers.json``, so that a node restarted while the coordinator is down (the only
``--peer`` a job script knows) joins through the nodes it trained with in its last life instead of waiting for the
coordinator (issue 37: "re-dial every peer it has seen"). The file holds the multiaddrs and the ``--peer`` lines of
the life that wrote it: a node uses it only when started on one of those lines, so a run dir reused for another run
never dials the old run's peers (two swarms would merge their DHTs).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

KNOWN_PEERS_FILE = "peers.json"


def read_known_peers(path: Path, *, started_on: Iterable[str] | None = None) -> list[str]:
    """The multiaddrs in ``path`` (a missing or unreadable file: none).

    Args:
        path: a ``peers.json``: a list of multiaddrs (the coordinator's), or ``{"peer": [...], "maddrs": [...]}``
            (a node's: the ``--peer`` lines it was started on, the peers it saw).
        started_on: this process's ``--peer`` lines: a node's file counts only when one of them is among its
            ``peer`` lines (None: no such check, the coordinator's own file).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if isinstance(data, dict):
        if started_on is not None and not set(started_on) & {str(p) for p in data.get("peer", [])}:
            return []
        data = data.get("maddrs", [])
    return [str(m) for m in data if isinstance(m, str)] if isinstance(data, list) else []


def write_known_peers(path: Path, maddrs: Iterable[str], *, started_on: Iterable[str] | None = None) -> None:
    """Replace ``path`` atomically with ``maddrs`` (sorted), and the ``--peer`` lines ``started_on`` when given
    (a node's file; `read_known_peers`). Raises OSError when the folder is not writable."""
    from composer_diloco.checkpoint import write_atomic

    peers = sorted(set(maddrs))
    data = peers if started_on is None else {"peer": sorted(set(started_on)), "maddrs": peers}
    write_atomic(path, json.dumps(data))


__all__ = ["KNOWN_PEERS_FILE", "read_known_peers", "write_known_peers"]
