"""Shared fixtures: a reaper that kills any child process a test leaves behind, and process helpers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.toml"


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


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> Path:
    """The embedded default's warm start, computed once per session (~45 s) and shared by the run tests.

    ``COMPOSER_DILOCO_TEST_WARM_DIR=DIR`` keeps it in DIR across sessions (for rerunning a few tests by hand;
    the cache key covers seed, steps, model config and tokenizer, so a stale entry is never reused).
    """
    from composer_diloco.config import load_config
    from composer_diloco.policy import load_policy

    kept = os.environ.get("COMPOSER_DILOCO_TEST_WARM_DIR")
    root = Path(kept) if kept else tmp_path_factory.mktemp("warm")
    cfg = load_config(SMOKE)
    load_policy(None, run_dir=root, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps)
    return root / "warmstart"


@pytest.fixture
def run_dir(tmp_path, warm_cache) -> Path:
    """A fresh run directory whose warm-start cache is the session's (so no test repeats the warm start)."""
    path = tmp_path / "run"
    path.mkdir()
    (path / "warmstart").symlink_to(warm_cache, target_is_directory=True)
    return path
