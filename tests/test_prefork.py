"""The suite's process template (``tests/prefork.py``): what a forked process shares with the others must be what
processes of separate interpreters would share, nothing more. Here: hivemind's process-wide locks.
"""

from __future__ import annotations

import os
import sys

import pytest
import prefork

HOLD_AND_DIE = """
import os, signal
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture, SharedBytes
for lock in (MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock,
             _AsyncContextWrapper.EXECUTOR_LOCK):
    lock.acquire()
os.kill(os.getpid(), signal.SIGKILL)  # as a test's kill landing inside an MPFuture update
"""

START_A_DHT = """
import sys
import hivemind
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture, SharedBytes
for name, lock in [("MPFuture._update_lock", MPFuture._update_lock),
                   ("MPFuture._initialization_lock", MPFuture._initialization_lock),
                   ("SharedBytes._lock", SharedBytes._lock),
                   ("_AsyncContextWrapper.EXECUTOR_LOCK", _AsyncContextWrapper.EXECUTOR_LOCK)]:
    if not lock.acquire(timeout=5):
        sys.exit(f"{name} is held by another process")
    lock.release()
dht = hivemind.DHT(start=True, await_ready=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
try:
    dht.wait_until_ready(timeout=60)  # hivemind's DHT process reports ready through an MPFuture update
finally:
    dht.shutdown()
print("ready")
"""


@pytest.mark.skipif(os.environ.get("COMPOSER_DILOCO_TEST_EXEC") == "1", reason="every process is exec'd")
def test_a_process_killed_holding_hiveminds_locks_does_not_stall_the_next_dht_start():
    forked = len(prefork.FORKED)
    dead = prefork.run([sys.executable, "-c", HOLD_AND_DIE], capture_output=True, timeout=60)
    assert dead.returncode == -9, dead.stderr
    after = prefork.run([sys.executable, "-c", START_A_DHT], capture_output=True, text=True, timeout=120)
    assert len(prefork.FORKED) == forked + 2  # both came from the template, which shares what it imported
    assert after.returncode == 0, after.stderr[-2000:]
    assert after.stdout.strip().endswith("ready")
