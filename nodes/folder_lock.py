"""A node's folder lock, ``<run-dir>/<name>/node.lock``: one process owns the folder, hence its identity key, metrics
file and peer ID. An OS file lock (`composer_diloco.outer.identity.try_lock`), dropped when the process ends, SIGKILL
and an OOM kill included, which is how a warm standby (`nodes.standby`) learns that its node's process ended.

`composer-node join` takes it first, before its imports (seconds: torch, transformers, TRL, hivemind), so a standby
started beside the node sees it held from the node's first second on. Taken after the imports, it once was not: in a
churn run on a loaded 2-core box a node's imports outlasted its standby's ``--join-timeout``, the standby concluded that
no node ran under the name and took the folder, and the node then exited 1 ("is in use").

Light at import (no torch, no hivemind): the command line imports it before everything else.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from composer_diloco.outer.identity import try_lock

LOCK_FILE = "node.lock"
HOLDER_FILE = "node.pid"
"""In ``<run-dir>/<name>/``: ``{"pid", "since"}`` of the process that holds the folder now (`write_holder`), for an
operator (or `bench/churn.py`) asking which process is the node: after a standby's takeover it is a process the
standby forked (`nodes.standby.Standby.run_lives`)."""
LOCK_POLL_S = 0.2  # seconds between two tries of the lock
LOCK_RETRIES = 5  # more tries, LOCK_POLL_S apart, before `NodeBusy`: a standby started beside the node holds it for
# an instant while it has not yet seen the node hold it (`nodes.standby.lock_is_held`)


class NodeBusy(RuntimeError):
    """Another live process holds this node's folder (``<run-dir>/<name>``), hence its identity."""


def lock_node_folder(own_dir: Path, name: str, run_dir: Path | str) -> Any:
    """Take ``own_dir / LOCK_FILE`` (the folder is made if missing), trying ``1 + LOCK_RETRIES`` times
    ``LOCK_POLL_S`` apart (a standby's probe holds it for an instant).

    Args:
        own_dir: ``<run-dir>/<name>``; name, run_dir: the node's ``--name`` and ``--run-dir``, for the error.
    Returns:
        The held lock (`composer_diloco.outer.identity.FileLockHeld`): ``release()`` it at exit (the OS drops it
        anyway when the process ends).
    Raises:
        NodeBusy: another process holds it (one line naming the folder and what to do).
    """
    own_dir = Path(own_dir)
    own_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1 + LOCK_RETRIES):
        if attempt:
            time.sleep(LOCK_POLL_S)
        lock = try_lock(own_dir / LOCK_FILE)
        if lock is not None:
            return lock
    raise NodeBusy(f"--name {name!r} is in use in --run-dir {str(run_dir)!r} by another node (its lock "
                   f"{str(own_dir / LOCK_FILE)!r} is held): stop it first, or give this node another --name")


def write_holder(own_dir: Path) -> None:
    """Say in ``own_dir / HOLDER_FILE`` that this process holds the folder since now (written whole or not at all).

    Raises:
        OSError: the file cannot be written.
    """
    import json
    import os

    from composer_diloco.checkpoint import write_atomic

    write_atomic(Path(own_dir) / HOLDER_FILE, json.dumps({"pid": os.getpid(), "since": time.time()}))


__all__ = ["HOLDER_FILE", "LOCK_FILE", "LOCK_POLL_S", "LOCK_RETRIES", "NodeBusy", "lock_node_folder", "write_holder"]
