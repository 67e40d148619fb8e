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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
DEFAULT_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's starting value


def fix_mmap_threshold(threshold_bytes: int = DEFAULT_MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold_bytes`` (bytes) in this process, which disables its dynamic growth.

    A process started with ``MALLOC_MMAP_THRESHOLD_`` in its environment keeps the user's setting. Elsewhere than
    glibc (musl, macOS) this does nothing.

    Returns:
        True when the threshold was set; False when the environment sets it or the C library is not glibc.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)) == 1
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold_bytes)
    return ok
