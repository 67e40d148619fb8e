"""Shared fixtures: a reaper that kills any child process a test leaves behind, and process helpers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

# Every process a test starts (coordinators, nodes, env servers, benches) runs one torch/OpenMP thread, as `simulate`
# and torchrun give theirs: a test runs 2-4 of them on CI's 2 cores, and at torch's default (a thread per core) each
# they oversubscribe the cores: a 2-node smoke round took 25 s of inner phase instead of 2 s. torch read the thread
# count at its import, just above, so this pytest process keeps its own (one per core) for the in-process tests.
PYTEST_THREADS = torch.get_num_threads()
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


@pytest.fixture(autouse=True, scope="session")
def user_cache(tmp_path_factory) -> Path:
    """The session's per-user cache folder (``COMPOSER_DILOCO_CACHE``, inherited by every process a test starts), so
    the suite never writes to the real ``~/.cache/composer_diloco``: a session temp dir, or
    ``COMPOSER_DILOCO_TEST_WARM_DIR=DIR`` to keep it in DIR across sessions (for rerunning a few tests by hand; the
    warm start's cache key covers seed, steps, recipe, model config, tokenizer and env source, so a stale entry is
    never reused)."""
    from composer_diloco.policy.cache import CACHE_ENV

    kept = os.environ.get("COMPOSER_DILOCO_TEST_WARM_DIR")
    root = Path(kept).absolute() if kept else tmp_path_factory.mktemp("user-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(root))
        yield root


@pytest.fixture(scope="session")
def warm_cache(user_cache) -> Path:
    """The folder of the embedded default's warm starts (``warmstart_cache_dir()``, under the session's
    ``user_cache``), holding smoke.toml's, computed once per session (~45 s) and reused by every run test's
    processes."""
    from composer_diloco.config import load_config
    from composer_diloco.policy import load_policy, warmstart_cache_dir

    cfg = load_config(SMOKE)
    load_policy(None, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps)
    return warmstart_cache_dir()


@pytest.fixture
def run_dir(tmp_path, warm_cache) -> Path:
    """A fresh run directory; the session's warm start is already cached (so no test repeats it)."""
    path = tmp_path / "run"
    path.mkdir()
    return path
