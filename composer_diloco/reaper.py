"""A watcher that kills a peer's whole process tree when the peer dies, whatever the signal.

hivemind forks a DHT process and an averager process (each with its own ``p2pd`` daemon); env servers and
sandbox runners are children too. A normal exit shuts them down, but a SIGKILL of the peer (the OOM killer, a
preemption, a container's stop timeout) runs no ``finally``: they stay as orphans of pid 1, ignore SIGTERM, and
hold hundreds of MB each. ``PR_SET_PDEATHSIG`` cannot reach them all (hivemind forks in its own code, and a
grandchild like ``p2pd`` outlives the child that would carry the flag), so the tie is made from outside:

`watch_this_process` starts ``python -m composer_diloco.reaper PID`` in a session of its own, so that a kill of
the peer's process group does not reach it. The reaper records the peer's descendants every ``POLL_S`` seconds
(pid and start time, so a reused pid is never hit). Once the peer is gone (exited, or a zombie that its parent
has not collected yet), it SIGKILLs every recorded process still alive and their current children, then exits:
within about ``POLL_S`` seconds of the peer's death. A fork made after the last snapshot (an averager started a
moment before a hard exit: seen in CI, an orphan left for good) is found by its parent's command line, which a fork
keeps, among the orphans of pid 1 born after the peer. A clean exit ends the same way, so whatever the peer's own
shutdown left behind goes too. (A pipe closing on death would be quicker to notice, but hivemind forks: its
children inherit every descriptor, so the pipe would stay open exactly when it matters.)

Then it frees their shared memory (`release_shared_memory`). hivemind sets torch's ``file_system`` sharing strategy
(``HIVEMIND_MEMORY_SHARING_STRATEGY``, to avoid running out of descriptors), under which every shared tensor (the
averager's buffers: theta's size in fp32) is a file ``/dev/shm/torch_<creator pid>_...`` that nothing removes when
its processes exit, cleanly or not: on a 2-core test machine 100,000 of them, 9 GB of RAM, piled up in a day, and a
node of an 8B model would leave 32 GB per run. Once the peer and every recorded descendant are dead, no process can
still open those files, so the reaper unlinks the ones they created.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

POLL_S = 0.5
"""Seconds between two snapshots of the watched process's descendants."""


def watch_this_process() -> subprocess.Popen | None:
    """Start a reaper for this process, once per process; returns its handle (None off Linux, where the process
    tree is not walked)."""
    global _REAPER
    if _REAPER is not None and _REAPER[0] == os.getpid():
        return _REAPER[1]
    if not sys.platform.startswith("linux"):
        return None
    reaper = subprocess.Popen([sys.executable, "-m", "composer_diloco.reaper", str(os.getpid())],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    _REAPER = (os.getpid(), reaper)
    return reaper


_REAPER: tuple[int, subprocess.Popen] | None = None


def _descendants(root: psutil.Process) -> dict[int, float]:
    """``{pid: create_time}`` of ``root``'s descendants now (processes that vanish mid-walk are skipped)."""
    out = {}
    try:
        children = root.children(recursive=True)
    except psutil.Error:
        return out
    for p in children:
        try:
            out[p.pid] = p.create_time()
        except psutil.Error:
            continue
    return out


def _orphaned_forks(cmdline: list[str], born_after: float) -> dict[int, float]:
    """``{pid: create_time}`` of the orphans (parent pid 1) that run ``cmdline`` and started at or after
    ``born_after``: forks of the dead peer (a fork keeps its parent's argv) that it made in its last poll interval,
    after the last snapshot, e.g. an averager process forked a moment before a hard exit."""
    out = {}
    for p in psutil.process_iter(["ppid", "cmdline", "create_time"]):
        info = p.info
        if info["ppid"] == 1 and info["cmdline"] == cmdline and (info["create_time"] or 0.0) >= born_after:
            out[p.pid] = info["create_time"]
    return out


def _kill_all(recorded: dict[int, float]) -> int:
    """SIGKILL every recorded process that is still the same process, and its current descendants; returns how
    many were signalled."""
    targets: dict[int, psutil.Process] = {}
    for pid, created in recorded.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() != created:
                continue  # the pid was reused by an unrelated process
            targets[pid] = p
            for child in p.children(recursive=True):
                targets[child.pid] = child
        except psutil.Error:
            continue
    for p in targets.values():
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    return len(targets)


SHM_DIR = Path("/dev/shm")


def release_shared_memory(pids: Iterable[int], shm_dir: Path = SHM_DIR) -> tuple[int, int]:
    """Unlink torch's shared-memory files (``torch_<pid>_*`` in ``shm_dir``) created by processes of ``pids`` that are
    no longer alive (a live pid is skipped: it may be reused by an unrelated process now). Mappings still open keep
    their memory until unmapped, as for any unlinked file. Returns ``(files, bytes)`` removed; never raises."""
    dead = {int(p) for p in pids if not _alive(int(p))}
    files = size = 0
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return 0, 0
    for entry in entries:
        parts = entry.name.split("_")
        if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit() or int(parts[1]) not in dead:
            continue
        try:
            n = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except OSError:
            continue
        files, size = files + 1, size + n
    return files, size


def _wait_gone(pids: Iterable[int], timeout_s: float = 5.0) -> None:
    """Wait (at most ``timeout_s``) until none of ``pids`` is alive: SIGKILL is delivered at once, but the exit is
    not."""
    deadline = time.monotonic() + timeout_s
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        pending = {p for p in pending if _alive(p)}
        if pending:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """True when ``pid`` runs (a zombie has exited: its pid cannot be reused until its parent collects it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(pid: int, poll_s: float = POLL_S) -> int:
    """Watch ``pid`` until it is gone, then kill the descendants it had and free the shared memory they and ``pid``
    created (`release_shared_memory`); returns how many processes were signalled.

    Raises:
        ValueError: ``pid`` is not a live process.
    """
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        raise ValueError(f"reaper: no process with pid {pid}") from None
    recorded: dict[int, float] = {}
    me = os.getpid()
    try:
        cmdline, born = root.cmdline(), root.create_time()
    except psutil.Error:
        cmdline, born = [], 0.0
    while True:
        recorded.update(_descendants(root))
        try:
            if not root.is_running() or root.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    if cmdline:
        recorded.update(_orphaned_forks(cmdline, born))
    recorded.pop(me, None)
    killed = _kill_all(recorded)
    _wait_gone([pid, *recorded])
    release_shared_memory([pid, *recorded])
    return killed


def main(argv: list[str] | None = None) -> int:
    """``python -m composer_diloco.reaper PID``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print(f"usage: python -m composer_diloco.reaper PID (got {' '.join(args)!r})", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl+C to the terminal's group is for the peer, not for us
    try:
        reap(int(args[0]))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
