"""A warm standby's CPU priority: lowered while it prepares and waits, given back when it takes the node over (Linux).

A supervisor starts a node's new standby right after a takeover, so the standby's preparation (its imports, the memory
plan's inputs, its env server, the policy's skeleton: 10-20 s of one core at the embedded default on a 2-core box,
`nodes.standby`) runs beside the takeover it follows and beside the node's training. At ``nice`` +`STANDBY_NICE` the
kernel's scheduler serves those first (CFS weights 110 against 1024 at nice 0); the standby still gets every core
they leave idle.

Raising a priority back takes privilege on Linux: root, ``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` that reaches the old
value (setpriority(2)). Where the process would not be allowed to give itself its priority back at the takeover, it
is left as it is: a node that trained at nice +10 would lose the cores to every other process on the machine. The nice
value is per thread on Linux, and threads and child processes inherit their creator's, so the takeover gives it back
to every thread of the process and of every process it started meanwhile (its env server).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

STANDBY_NICE = 10  # added to the nice value while the standby prepares and waits


def lower_priority() -> int | None:
    """Add `STANDBY_NICE` to this thread's nice value (threads and processes it starts later inherit it) when it may be
    given back later (module docstring). Call it first thing, before the standby starts any thread.

    Returns:
        The nice value to give back at the takeover (`restore_priority`), or None when the priority was left as it is
        (not Linux, or not allowed to raise it again).
    """
    if not sys.platform.startswith("linux"):
        return None
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not _may_raise_to(base):
        return None
    os.setpriority(os.PRIO_PROCESS, 0, min(19, base + STANDBY_NICE))
    return base


def restore_priority(base: int) -> int:
    """Give the nice value ``base`` back to every thread of this process and of its child processes, recursively.

    Returns:
        How many threads were set. A thread or process that ended meanwhile is skipped; a refusal is logged as a
        WARNING (the node then trains with the lowered priority in that thread) and does not raise.
    """
    import psutil

    me = psutil.Process()
    done, refused = 0, []
    for proc in [me, *me.children(recursive=True)]:
        try:
            threads = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, base)
                done += 1
            except ProcessLookupError:
                continue
            except OSError as e:
                refused.append(f"{proc.pid}/{tid}: {e.strerror}")
    if refused:
        log.warning("could not give the standby's threads their CPU priority back (nice %d): %s", base,
                    ", ".join(refused[:5]))
    return done


def _may_raise_to(nice: int) -> bool:
    """Whether this process may set a nice value as low as ``nice`` again once it raised it: root, or an
    ``RLIMIT_NICE`` soft limit of at least ``20 - nice`` (setpriority(2); ``CAP_SYS_NICE`` without root is not
    looked for)."""
    if os.geteuid() == 0:
        return True
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20 - nice


__all__ = ["STANDBY_NICE", "lower_priority", "restore_priority"]
