"""Shared fixtures: a reaper that kills any child process a test leaves behind, and process helpers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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
    import prefork

    # the process template is stopped below; its children are the tests' (leaked ones are reaped here)
    leaked = [p for p in descendants() if p.pid != prefork.template_pid()]
    for p in leaked:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if leaked:
        names = sorted({p.name() for p in leaked if p.is_running()} or {"?"})
        print(f"\nreaped {len(leaked)} leaked child process(es): {names}")
    prefork.stop_template()


_USER_CACHE = pytest.StashKey[Path]()
_PREVIOUS_CACHE_ENV = pytest.StashKey["str | None"]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """The session's per-user cache folder (``COMPOSER_DILOCO_CACHE``, inherited by every process a test starts), so
    the suite never writes to the real ``~/.cache/composer_diloco``: a session temp dir, or
    ``COMPOSER_DILOCO_TEST_WARM_DIR=DIR`` to keep it in DIR across sessions (for rerunning a few tests by hand; the
    warm start's cache key covers seed, steps, recipe, model config, tokenizer and env source, so a stale entry is
    never reused)."""
    from composer_diloco.policy.cache import CACHE_ENV

    _SESSION.append(session)
    kept = os.environ.get("COMPOSER_DILOCO_TEST_WARM_DIR")
    root = Path(kept).absolute() if kept else Path(tempfile.mkdtemp(prefix="composer-diloco-user-cache-"))
    root.mkdir(parents=True, exist_ok=True)
    session.stash[_USER_CACHE] = root
    session.stash[_PREVIOUS_CACHE_ENV] = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(root)


_WARM_BUILD = pytest.StashKey["tuple[subprocess.Popen, Path, float] | None"]()

_BUILD_WARM_START = """
from composer_diloco.config import load_config
from composer_diloco.policy import load_policy
cfg = load_config({smoke!r})
load_policy(None, seed=cfg.warmstart.seed, warmstart_steps=cfg.warmstart.steps)
"""


def _needs_warm_start(item: pytest.Item) -> bool:
    """Whether a test needs the embedded default's warm start cached: it asks for `warm_cache` (`run_dir` does), or
    it is a multi-process run (its coordinator or nodes load the default)."""
    return "warm_cache" in getattr(item, "fixturenames", ()) or item.get_closest_marker("multiprocess") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that need no warm start first, each group in collection order: the warm start builds in the
    background meanwhile (`pytest_collection_finish`), on CI's second core (the suite's time)."""
    items.sort(key=_needs_warm_start)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the embedded default's warm start (smoke.toml's, ~50 s on 2 cores) in a process of its own, once, for
    every test that needs it (`_needs_warm_start`, which waits for it in `pytest_runtest_protocol`: outside every
    test's time limit, so that a slow machine times no test out in its setup, and a failure stops the session with
    one error instead of one per test that needed it)."""
    session.stash[_WARM_BUILD] = None
    if session.config.option.collectonly or not any(_needs_warm_start(item) for item in session.items):
        return
    log = session.stash[_USER_CACHE] / "warm-start-build.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(PYTEST_THREADS)}  # as it ran in this process before
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _BUILD_WARM_START.format(smoke=str(SMOKE))], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    session.stash[_WARM_BUILD] = (proc, log, time.monotonic())


def _wait_for_warm_start(item: pytest.Item) -> None:
    """Wait for the background warm start (once); a failed one ends the session with its log's last lines."""
    session = item.session
    build = session.stash.get(_WARM_BUILD, None)
    if build is None:
        return
    proc, log, started = build
    waited = time.monotonic()
    code = proc.wait()
    session.stash[_WARM_BUILD] = None
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        pytest.exit(f"the embedded default's warm start failed before the tests that need it (exit {code}):\n{tail}",
                    returncode=1)
    session.config.get_terminal_writer().line(
        f"\nwarm start of the embedded default: {time.monotonic() - started:.1f} s in the background beside "
        f"{session.items.index(item)} test(s), {time.monotonic() - waited:.1f} s waited (cached for the session)")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test that needs the warm start waits for it first, before its own timeout starts."""
    if _needs_warm_start(item):
        _wait_for_warm_start(item)
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Put ``COMPOSER_DILOCO_CACHE`` back and delete a session temp cache."""
    from composer_diloco.policy.cache import CACHE_ENV

    build = session.stash.get(_WARM_BUILD, None)
    if build is not None and build[0].poll() is None:  # no test needed it after all (e.g. a -x stop)
        build[0].kill()
        build[0].wait()
    if _USER_CACHE not in session.stash:
        return
    previous = session.stash[_PREVIOUS_CACHE_ENV]
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous
    if not os.environ.get("COMPOSER_DILOCO_TEST_WARM_DIR"):
        shutil.rmtree(session.stash[_USER_CACHE], ignore_errors=True)


@pytest.fixture(scope="session")
def user_cache(request: pytest.FixtureRequest) -> Path:
    """The session's per-user cache folder (`pytest_sessionstart`)."""
    return request.session.stash[_USER_CACHE]


@pytest.fixture(scope="session")
def warm_cache(user_cache) -> Path:
    """The folder of the embedded default's warm starts (``warmstart_cache_dir()``, under the session's
    ``user_cache``), holding smoke.toml's, computed before the first test (`pytest_collection_finish`) and reused by
    every run test's processes."""
    from composer_diloco.policy import warmstart_cache_dir

    return warmstart_cache_dir()


@pytest.fixture
def run_dir(tmp_path, warm_cache) -> Path:
    """A fresh run directory; the session's warm start is already cached (so no test repeats it)."""
    path = tmp_path / "run"
    path.mkdir()
    return path


def pytest_terminal_summary(terminalreporter) -> None:
    """How many of the tests' CLI processes were forked from the process template, how many exec'd and why."""
    import prefork

    if prefork.FORKED or prefork.EXECED:
        terminalreporter.write_line(prefork.summary())


# -- what a failing CI run shows while it still runs ------------------------------------------------------------------
# CI shows the tail of the suite's output, and pytest prints a failure's traceback only at the session's end: a run
# that outlives CI's clock (stop 57: eleven multi-process tests failing one after another, none reproducible on
# another 2-core box) ends without a word of why. So a failure is described when it happens, with the machine's
# busiest processes, and every multi-process test ends with no stray process of the session behind it.
from tests_support import alive, cmdline  # noqa: E402 - the suite's helpers (pythonpath = tests)

_SESSION_STARTED = time.time()
_SESSION: list[pytest.Session] = []  # the session, from `pytest_sessionstart` on


def _terminal():
    """The session's terminal reporter (None without one, e.g. under ``-p no:terminal``)."""
    return _SESSION[0].config.pluginmanager.get_plugin("terminalreporter") if _SESSION else None


def busiest_processes(n: int = 6, interval_s: float = 0.5) -> list[str]:
    """The ``n`` processes of the machine using the most CPU over ``interval_s`` seconds, one line each (pid, parent,
    CPU %, resident MB, command), for a failure's report."""
    procs = list(psutil.process_iter(["pid", "ppid", "cmdline", "name"]))
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(interval_s)
    rows = []
    for p in procs:
        try:
            rows.append((p.cpu_percent(None), p.info["pid"], p.info["ppid"], p.memory_info().rss >> 20,
                         " ".join(p.info["cmdline"] or [p.info["name"] or "?"]).replace("\n", " ")[:110]))
        except psutil.Error:
            continue
    rows.sort(reverse=True)
    return [f"  pid {pid} (parent {ppid}) {cpu:5.1f}% cpu {rss} MB: {cmd}" for cpu, pid, ppid, rss, cmd in rows[:n]]


STOP_AFTER_FAILURES_IN_A_ROW = 4
"""Multi-process tests failing one after another that stop the session (as ``--maxfail`` does): each can take its
whole timeout, and eleven in a row outlived CI's 90 minutes (stop 57)."""
_RUN_OF_FAILURES: list[str] = []
_STRAY_NOTES: list[str] = []  # what `no_strays_after_multiprocess_tests` killed, printed after the test's teardown


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failed test's last traceback lines and the machine's busiest processes, printed as it fails; after a
    teardown, the orphans it killed (outside the test's output capture, so they reach CI's log)."""
    tw = _terminal()
    if tw is None:
        return
    while _STRAY_NOTES:
        tw.write_line("\n" + _STRAY_NOTES.pop(0))
    if report.when == "call" and "multiprocess" in report.keywords:
        _RUN_OF_FAILURES[:] = [*_RUN_OF_FAILURES, report.nodeid] if report.failed else []
        if len(_RUN_OF_FAILURES) >= STOP_AFTER_FAILURES_IN_A_ROW:
            _SESSION[0].shouldstop = (f"{len(_RUN_OF_FAILURES)} multi-process tests failed in a row "
                                      f"({', '.join(_RUN_OF_FAILURES)}): the machine, not one test, is the likelier "
                                      "cause; stopping so that the reasons above are printed within CI's time")
    if not report.failed:
        return
    if report.when == "call" and "multiprocess" in report.keywords:
        import prefork

        # after one multi-process failure, every later test's forked peers hung at their DHT's start (stop 57's CI):
        # hivemind's process-wide locks, shared through the template until `prefork._own_process_locks`. Whatever
        # else a failed test may leave in the template's children, the next test gets a template of its own
        prefork.stop_template()
        tw.write_line("\n--- the suite's process template is started afresh for the next test")
    lines = report.longreprtext.splitlines()
    tw.write_line(f"\n--- {report.nodeid} failed in its {report.when} after {report.duration:.1f} s; its last lines:")
    for line in lines[-25:]:
        tw.write_line(f"  {line[:200]}")
    tw.write_line("--- the machine's busiest processes now:")
    for line in busiest_processes():
        tw.write_line(line)


def _session_strays() -> list[psutil.Process]:
    """Processes of this session outside pytest's tree: orphans (parent pid 1) started since the session began whose
    command runs this checkout's interpreter, code or hivemind's ``p2pd``."""
    me, markers = os.getpid(), (sys.prefix, str(Path(__file__).resolve().parents[1]), "p2pd")
    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "create_time"]):
        info = p.info
        if info["ppid"] != 1 or info["pid"] == me or (info["create_time"] or 0.0) < _SESSION_STARTED:
            continue
        cmd = " ".join(info["cmdline"] or [])
        if any(m in cmd for m in markers):
            out.append(p)
    return out


@pytest.fixture(autouse=True)
def no_strays_after_multiprocess_tests(request: pytest.FixtureRequest):
    """After a multi-process test: its peers' reapers (`composer_diloco.reaper`) get 5 s to take their orphans down;
    whatever of the session is still an orphan then is killed and named on the terminal, so that a leak costs the
    test that made it, not the CPU of every test after it."""
    yield
    if request.node.get_closest_marker("multiprocess") is None:
        return
    deadline = time.monotonic() + 5.0
    strays = _session_strays()
    while strays and time.monotonic() < deadline:
        time.sleep(0.25)
        strays = [p for p in strays if alive(p)]
    if not strays:
        return
    names = [f"{p.pid} {cmdline(p)[:100]}" for p in strays]
    for p in strays:
        try:
            p.kill()
        except psutil.Error:
            continue
    _STRAY_NOTES.append(f"{request.node.nodeid} left {len(names)} orphan process(es), killed now: " + "; ".join(names))
