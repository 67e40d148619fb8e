"""glibc malloc tuning for the processes that move theta-sized data through many mid-sized buffers.

glibc serves an allocation above its mmap threshold (128 KiB at start) with its own ``mmap`` and gives it back to
the OS on ``free``. But the threshold is dynamic: each such free raises it to the freed size, up to 32 MiB on 64-bit
(``mallopt(3)``, ``M_MMAP_THRESHOLD``). After the first few, every part of an all-reduce (hivemind's 512 KiB parts,
their serialized bytes) and every chunk of a state download comes from the heap, and freed heap memory only returns
to the OS from its top: the process keeps its peak. Measured with ``bench/blocked_link.py --memory`` at two policy
sizes (`bench/memory.py slope`), this retention was 3-4 copies of theta per peer (BENCHMARKS.md, section 3c).

`fix_mmap_threshold` pins the threshold at its starting value, which turns the dynamic adjustment off: big buffers
are mapped and unmapped one by one again. The cost is a page fault per page of each such buffer, which matters for a
process that allocates large tensors in a hot loop, not for the averager, whose hot path is the network. Measured on
the embedded default, pinned in a CPU node's own process: the inner phase took 1.43 s a round instead of 1.02 s. So it
is applied where training is not: in hivemind's averager process of every peer (`ExactAverager.run`), and in the
whole coordinator (`composer-coordinator start`), whose own process serves the state downloads (theta and the outer
state, cloned and handed to the averager process, tensor by tensor).

The coordinator trains once: the embedded default's warm start, on a machine's first run. `heap_for_training`, around
the warm start (`composer_diloco.policy.load`), lets it train from the heap (threshold 32 MiB, where the dynamic one
ends up) and pins the threshold again after. Pinned through it, 30 warm-start steps took 1.5x as long on the coding env (6.14 s a step against 4.10) and 1.7x on
`tool_env` (0.82 s against 0.48; `python -m composer_diloco.policy warm-start --steps 30 --env ENV` with and without
``MALLOC_MMAP_THRESHOLD_=131072``, 2-core AMD EPYC VM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
DEFAULT_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's starting value
DYNAMIC_MAX_BYTES = 32 * 1024 * 1024  # where the dynamic threshold stops rising on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_pinned_at: int | None = None  # the threshold `fix_mmap_threshold` pinned in this process, if it did


def _libc() -> ctypes.CDLL | None:
    """The C library if it is glibc (has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def fix_mmap_threshold(threshold_bytes: int = DEFAULT_MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold_bytes`` (bytes) in this process, which disables its dynamic growth.

    A process started with ``MALLOC_MMAP_THRESHOLD_`` in its environment keeps the user's setting. Elsewhere than
    glibc (musl, macOS) this does nothing.

    Returns:
        True when the threshold was set; False when the environment sets it or the C library is not glibc.
    """
    global _pinned_at
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or (libc := _libc()) is None:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)) == 1
    if ok:
        _pinned_at = int(threshold_bytes)
    else:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold_bytes)
    return ok


@contextmanager
def heap_for_training() -> Iterator[None]:
    """Train inside this block of a process that pinned the threshold (`fix_mmap_threshold`): the threshold is
    32 MiB inside (a step's big tensors come from the heap: no page fault per page of each); on leaving, the heap's
    free memory goes back to the OS (``malloc_trim(0)``) and the threshold is pinned where it was. Measured in the
    module docstring. Does nothing in a process that did not pin it (a node, a test process, the user's
    ``MALLOC_MMAP_THRESHOLD_``, a C library other than glibc).
    """
    pinned = _pinned_at
    libc = _libc() if pinned is not None else None
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, DYNAMIC_MAX_BYTES)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(M_MMAP_THRESHOLD, pinned)
