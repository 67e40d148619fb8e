"""glibc's mmap threshold pinned in the averager process (`composer_diloco.malloc`): freed buffers go back to the OS."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from composer_diloco.malloc import fix_mmap_threshold

# 200 buffers of 1 MiB, all freed but the last (allocated last, it sits at the top of the heap if the heap serves
# them, and then nothing below it can be trimmed): the private bytes that stay, in MiB
RETAINED = """
import json, sys
from composer_diloco.malloc import fix_mmap_threshold, heap_for_training
pinned = fix_mmap_threshold() if sys.argv[1] in ("pin", "train") else False
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
first = bytearray(1 << 20); del first  # one mapped buffer freed: glibc's dynamic threshold rises to 1 MiB
before = rss_mib()
def allocate():
    bufs = [bytearray(b"x" * (1 << 20)) for _ in range(200)]
    return bufs[-1]
inside = None
if sys.argv[1] == "train":  # a training loop's buffers, inside `heap_for_training`
    with heap_for_training():
        last = allocate()
        inside = rss_mib() - before
else:
    last = allocate()
print(json.dumps({"pinned": pinned, "inside_mib": inside, "retained_mib": rss_mib() - before}))
"""


def _retained(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", RETAINED, mode], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_pinned_threshold_gives_freed_buffers_back_and_the_dynamic_one_does_not():
    dynamic, pinned = _retained("dynamic"), _retained("pin")
    assert pinned["pinned"] is True
    assert dynamic["retained_mib"] > 100, dynamic  # the retention this module exists for
    assert pinned["retained_mib"] < 20, pinned


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_training_in_a_pinned_process_takes_its_buffers_from_the_heap():
    """The coordinator's warm start (`heap_for_training`): a step's big tensors are not mapped one by one, which made
    the coordinator's warm start 1.5-1.7x slower (malloc.py)."""
    trained = _retained("train")
    assert trained["pinned"] is True and trained["inside_mib"] > 100, trained  # served by the heap, as unpinned
    assert trained["retained_mib"] < 20, trained  # and given back on leaving the block (malloc_trim)


def test_the_users_own_setting_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is False
