"""A peer's torch shared-memory files (hivemind's ``file_system`` sharing strategy: ``/dev/shm/torch_<pid>_*``) are
removed by its reaper once it is gone (`composer_diloco.reaper.release_shared_memory`), after a clean exit and after
a SIGKILL alike; files of live processes are never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_diloco.reaper import SHM_DIR, release_shared_memory

# A peer in miniature: hivemind's import sets the file_system strategy; a shared tensor (as the averager's buffers);
# a reaper (as nodes and the coordinator start one); then a clean exit, or a wait for SIGKILL.
PEER = """
import sys, time, torch, hivemind
from composer_diloco.reaper import watch_this_process
watch_this_process()
t = torch.zeros(4096).share_memory_()
print("ready", flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
"""


def files_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"torch_{pid}_")]


def test_only_the_files_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    for name in (f"torch_{dead_pid}_1_1", f"torch_{dead_pid}_2_7", f"torch_{live_pid}_3_1", "torch_x_1", "other"):
        (tmp_path / name).write_bytes(b"x" * 10)
    assert release_shared_memory([dead_pid, live_pid], tmp_path) == (2, 20)
    assert sorted(os.listdir(tmp_path)) == ["other", f"torch_{live_pid}_3_1", "torch_x_1"]


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_a_peer_leaves_no_shared_memory_behind(ending):
    peer = subprocess.Popen([sys.executable, "-c", PEER, "exit" if ending == "exit" else "wait"],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert peer.stdout.readline().strip() == "ready"
        assert files_of(peer.pid), "the shared tensor made no /dev/shm file (not the file_system strategy?)"
        if ending == "sigkill":
            peer.send_signal(signal.SIGKILL)
        peer.wait(timeout=30)
        deadline = time.monotonic() + 10.0  # the reaper polls every 0.5 s
        while files_of(peer.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert files_of(peer.pid) == []
    finally:
        peer.kill()
        peer.wait()
