"""A standby's CPU priority (`nodes.standby_priority`): lowered while it waits, given back at its takeover to every
thread and child process, and left alone where it could not be given back. Each case runs in a fresh interpreter (the
nice value of this test process stays as it is)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# lower, then start what a standby starts while it waits (a thread, a child process with a thread of its own), then
# take over: every thread of both back at the old nice value
SCRIPT = """
import json, os, resource, subprocess, sys, threading, time
if os.environ.get("AS_A_USER"):  # a user's process: not root, RLIMIT_NICE 0 (the usual default)
    resource.setrlimit(resource.RLIMIT_NICE, (0, resource.getrlimit(resource.RLIMIT_NICE)[1]))
    os.geteuid = lambda: 1000
from nodes.standby_priority import lower_priority, restore_priority

def nice_of(pid):
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}

before = os.getpriority(os.PRIO_PROCESS, 0)
base = lower_priority()
waiting = threading.Event()
thread = threading.Thread(target=waiting.wait, daemon=True)
thread.start()
child = subprocess.Popen([sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, "
                          "args=(30,), daemon=True).start(); time.sleep(30)"])
time.sleep(1.0)  # the child's own thread is up
lowered = {"self": nice_of(os.getpid()), "child": nice_of(child.pid)}
restored_threads = restore_priority(base) if base is not None else 0
after = {"self": nice_of(os.getpid()), "child": nice_of(child.pid)}
child.kill()
child.wait()
print(json.dumps({"before": before, "base": base, "lowered": lowered, "after": after, "set": restored_threads}))
"""


def _run(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _values(seen: dict) -> set[int]:
    return {v for proc in seen.values() for v in proc.values()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread: Linux only")
def test_a_standby_yields_the_cpu_while_it_waits_and_gets_it_back_in_every_thread_at_takeover():
    seen = _run()
    if seen["base"] is None:  # not allowed to raise it back here (no root, RLIMIT_NICE 0): left alone
        assert _values(seen["lowered"]) == _values(seen["after"]) == {seen["before"]}, seen
        return
    assert seen["base"] == seen["before"], seen
    assert _values(seen["lowered"]) == {min(19, seen["before"] + 10)}, seen  # the thread and the child inherit it
    assert _values(seen["after"]) == {seen["before"]}, seen
    assert seen["set"] >= 4, seen  # main thread + thread, the child's main thread + its thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread: Linux only")
def test_a_standby_that_could_not_get_its_priority_back_is_not_lowered():
    seen = _run(AS_A_USER="1")  # its real RLIMIT_NICE is 0; only its uid is made up
    assert seen["base"] is None, seen
    assert _values(seen["lowered"]) == _values(seen["after"]) == {seen["before"]}, seen
