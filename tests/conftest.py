"""Shared fixtures: a reaper that kills any child process a test leaves behind, and process helpers."""

from __future__ import annotations

import os
import signal

import psutil
import pytest


def descendants() -> list[psutil.Process]:
    """Live descendant processes of this pytest process."""
    try:
        return [p for p in psutil.Process(os.getpid()).children(recursive=True) if p.is_running()]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(autouse=True, scope="session")
def reap_children():
    """After the session, kill whatever child processes tests leaked (and fail loudly if any did)."""
    yield
    leaked = descendants()
    for p in leaked:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if leaked:
        names = sorted({p.name() for p in leaked if p.is_running()} or {"?"})
        print(f"\nreaped {len(leaked)} leaked child process(es): {names}")
