"""The warm start is cached once per machine (a per-user folder), safely: where the folder is, one computation for
processes asking at once, a damaged entry rebuilt, a killed computation leaving no entry."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import prefork
from composer_diloco.policy import cache as cache_module
from composer_diloco.policy import load as load_module
from composer_diloco.policy import PolicyLoadError, load_policy, warmstart_cache_dir
from composer_diloco.policy.cache import CACHE_ENV, cache_root, get_or_build

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2  # a real warm start, a few seconds


def _entries(cache: Path) -> list[Path]:
    """The entries of a warm-start cache (no lock files, no temporary folders)."""
    folder = cache / "warmstart"
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "composer_diloco"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty = unset, as the XDG spec says
    assert cache_root() == tmp_path / "home" / ".cache" / "composer_diloco"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "composer_diloco"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    assert warmstart_cache_dir() == tmp_path / "mine" / "warmstart"
    monkeypatch.setenv(CACHE_ENV, "~/c")
    assert cache_root() == tmp_path / "home" / "c"
    assert not (tmp_path / "home").exists()  # nothing created by asking


def test_the_suite_never_writes_to_the_real_user_cache(user_cache):
    assert os.environ[CACHE_ENV] == str(user_cache) and cache_root() == user_cache
    assert not str(user_cache).startswith(str(Path.home() / ".cache"))


_ASK = """
import hashlib, json, logging, os, sys, time
logging.basicConfig(level=logging.INFO)
from pathlib import Path
cache, ready, n, log = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["COMPOSER_DILOCO_CACHE"] = cache
from composer_diloco.policy import load as load_module
from composer_diloco.policy import load_policy
real = load_module.warm_start

def counted(*args, **kwargs):  # every real warm start appends its pid, start and end to the log
    start = time.time()
    result = real(*args, **kwargs)
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {start} {time.time()}\\n")
    return result

load_module.warm_start = counted
(ready / str(os.getpid())).touch()
while len(list(ready.iterdir())) < n:  # a barrier: every process asks at the same moment
    time.sleep(0.01)
start = time.time()
model, _ = load_policy(None, seed=0, warmstart_steps=int(sys.argv[5]))
h = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    h.update(name.encode())
    h.update(tensor.detach().cpu().numpy().tobytes())
print(json.dumps({"pid": os.getpid(), "digest": h.hexdigest(), "start": start, "end": time.time()}))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_processes_asking_at_once_compute_the_warm_start_once(tmp_path):
    """Three processes (a coordinator and two nodes of a LoRA run, say) ask for the same warm start at once: one
    computes it, the others wait for it and load the same weights."""
    ready, log = tmp_path / "ready", tmp_path / "warm_starts.log"
    ready.mkdir()
    procs = [prefork.popen([sys.executable, "-c", _ASK, str(tmp_path / "cache"), str(ready), "3", str(log),
                            str(STEPS)], cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        outs = [p.communicate(timeout=280) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    computed = log.read_text().splitlines()
    assert len(computed) == 1, computed  # one warm start for three processes
    builder, _, trained_until = computed[0].split()
    assert len({r["digest"] for r in results}) == 1  # the same weights for all
    waiters = [r for r in results if r["pid"] != int(builder)]
    assert len(waiters) == 2 and all(r["start"] < float(trained_until) for r in waiters)  # they did ask meanwhile
    assert all("another process is building" in err for p, (_, err) in zip(procs, outs) if p.pid != int(builder))
    assert len(_entries(tmp_path / "cache")) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["missing", "truncated", "bad-json"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(damage, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model, _ = load_policy(None, seed=1, warmstart_steps=0)
    digest = _digest(model)  # now: the loaded weights may map the file damaged below
    (entry,) = _entries(tmp_path)
    weights = entry / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    elif damage == "truncated":
        os.truncate(weights, weights.stat().st_size - 100)
    else:
        (entry / "config.json").write_text('{"model_type": ')
    with caplog.at_level(logging.WARNING, logger=cache_module.__name__):
        again, _ = load_policy(None, seed=1, warmstart_steps=0)
    assert f"cache entry {entry} is damaged" in caplog.text
    assert _entries(tmp_path) == [entry] and cache_module.entry_problem(entry, load_module._WARMSTART_FILES) is None
    assert _digest(again) == digest
    assert not [p for p in (tmp_path / "warmstart").iterdir() if ".broken-" in p.name]


_KILLED = """
import os, sys
os.environ["COMPOSER_DILOCO_CACHE"] = sys.argv[1]
from composer_diloco.policy import load_policy
load_policy(None, seed=0, warmstart_steps=int(sys.argv[2]))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_killed_warm_start_leaves_no_entry_and_the_next_one_cleans_up(tmp_path, caplog):
    cache = tmp_path / "cache"
    proc = prefork.popen([sys.executable, "-c", _KILLED, str(cache), "200"], cwd=ROOT, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 150
        staging = []
        while not staging and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            staging = list((cache / "warmstart").glob(".*.tmp-*")) if (cache / "warmstart").is_dir() else []
        assert staging, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no staging folder"
        time.sleep(2.0)  # into the training
        os.killpg(proc.pid, signal.SIGKILL)  # no cleanup runs
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _entries(cache) == []  # no half entry under the key's name
    assert staging[0].exists()  # the killed process's leftover
    # the dead process's lock is free, and the next builder removes the leftover: the same key, so the same folder
    calls = []

    def build(entry: Path) -> None:  # what warm_start does, minus the training: staging, then rename
        calls.append(entry)
        tmp = entry.parent / f".{entry.name}.tmp-new"
        tmp.mkdir()
        (tmp / "a.json").write_text("{}")
        os.rename(tmp, entry)

    entry = staging[0].parent / staging[0].name.split(".tmp-")[0].lstrip(".")
    with caplog.at_level(logging.INFO, logger=cache_module.__name__):
        got, built = get_or_build(entry, build, required=["a.json"])
    assert built and got == entry and calls == [entry] and not staging[0].exists()
    assert "left by an interrupted build" in caplog.text


def test_an_unwritable_cache_is_a_one_line_error_naming_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file" / "cache"))
    with pytest.raises(PolicyLoadError, match=r"cannot cache the warm start in .*file/cache/warmstart: .*"
                                              r"point COMPOSER_DILOCO_CACHE at a writable folder"):
        load_policy(None, seed=0, warmstart_steps=0)


def test_a_failing_build_leaves_no_entry_and_releases_the_lock(tmp_path):
    entry = tmp_path / "warmstart" / "k"

    def boom(e: Path) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        get_or_build(entry, boom, required=["a.json"])
    assert not entry.exists()

    def build(e: Path) -> None:
        e.mkdir()
        (e / "a.json").write_text("{}")

    assert get_or_build(entry, build, required=["a.json"]) == (entry, True)
    assert get_or_build(entry, boom, required=["a.json"]) == (entry, False)  # whole: not built again

    def half(e: Path) -> None:
        e.mkdir()

    with pytest.raises(RuntimeError, match="missing b.json"):
        get_or_build(tmp_path / "other", half, required=["b.json"])


def test_the_entry_key_covers_the_torch_and_transformers_versions(monkeypatch):
    """An entry built under another torch or transformers release is not reused: its key differs."""
    import torch
    import transformers

    from composer_diloco.policy.tiny_model import tiny_model_config
    from composer_diloco.policy.tokenizer import load_default_tokenizer

    config = tiny_model_config(load_default_tokenizer())
    key = load_module._default_cache_key(0, 200, config)
    assert load_module._default_cache_key(0, 200, config) == key
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert load_module._default_cache_key(0, 200, config) != key
    monkeypatch.undo()
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    assert load_module._default_cache_key(0, 200, config) != key


@pytest.mark.timeout(120)
def test_a_cached_warm_start_loads_without_importing_the_env_package(warm_cache):
    """Every coordinator start (and `simulate`, the evaluations) loads the cached warm start: finding its key must not
    import the env package, whose ``envs/__init__.py`` imports OpenEnv's core (~2 s of CPU a process). A fresh process,
    as a coordinator is; the session's warm start is cached."""
    code = ("import sys; from composer_diloco.config import load_config; from composer_diloco.policy import load_policy;"
            f"cfg = load_config({str(ROOT / 'configs' / 'smoke.toml')!r});"
            "load_policy(None, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps);"
            "print(sorted(m for m in sys.modules if m == 'envs' or m.startswith(('envs.', 'openenv'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
