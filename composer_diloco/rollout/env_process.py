"""Run an OpenEnv environment server as its own OS process and wait for it to be healthy.

The server is ``sys.executable -m <module> --host H --port P`` in a new process group (so stopping
it also stops anything it spawned). Readiness is a ``GET /health`` answering 200.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["BorrowedEnvServer", "EnvServer", "EnvServerError", "EnvServerLaunch", "find_free_port", "launch_env_server",
           "start_env_server", "wait_for_env"]

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.1
_PROBE_TIMEOUT_S = 2.0
_PORT_RETRIES = 3  # a port picked by find_free_port can be taken before the server binds it


class EnvServerError(RuntimeError):
    """An environment server did not start, died, or cannot be reached."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _probe(url: str) -> str | None:
    """GET ``url/health`` once; None when it answers 200, else why not (one line)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=_PROBE_TIMEOUT_S) as response:
            if response.status == 200:
                return None
            return f"/health answered HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"/health answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason).replace("\n", " ")


def wait_for_env(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll ``url/health`` until it answers 200.

    Args:
        url: server base URL, e.g. ``http://127.0.0.1:8000`` (a trailing slash is ignored).
        timeout_s: how long to keep polling, in seconds.
        process: when given, stop waiting as soon as this process exits.

    Raises:
        EnvServerError: ``"env server at URL not reachable: ..."`` (one line) when nothing healthy
            answers within ``timeout_s``, or when ``process`` exits first.
    """
    url = url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    while True:
        problem = _probe(url)
        if problem is None:
            return
        if process is not None and process.poll() is not None:
            raise EnvServerError(
                f"env server at {url} not reachable: process exited with code {process.returncode}"
            )
        if time.monotonic() >= deadline:
            raise EnvServerError(
                f"env server at {url} not reachable: {problem} (waited {timeout_s:.1f} s)"
            )
        time.sleep(_POLL_INTERVAL_S)


class EnvServer:
    """A running environment server process; use as a context manager or call ``stop()``.

    Attributes:
        url: base URL, ``http://host:port`` (clients add ``/ws``).
        pid: process id, also the id of its process group.
        log_path: file holding the server's stdout and stderr: a temp file ``stop()`` removes, or the caller's
            (``keep_log``), kept for a post-mortem.
    """

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path, keep_log: bool = False) -> None:
        self._process = process
        self.url = url
        self.pid = process.pid
        self.log_path = log_path
        self.keep_log = keep_log
        atexit.register(self.stop)

    @property
    def running(self) -> bool:
        """Whether the server process is still alive."""
        return self._process.poll() is None

    def log_tail(self, max_chars: int = 2000) -> str:
        """The last ``max_chars`` characters of the server's output ('' when none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-max_chars:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, wait up to ``timeout_s`` seconds, then SIGKILL it.

        Also removes ``log_path`` unless it is the caller's (``keep_log``). Idempotent; never raises for a process
        that is already gone.
        """
        atexit.unregister(self.stop)
        if self._process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("env server %s (pid %d) ignored SIGTERM for %.1f s; killing",
                               self.url, self.pid, timeout_s)
        # Also reap children left in the group after the leader exited.
        self._signal_group(signal.SIGKILL)
        if self._process.poll() is None:
            self._process.wait()
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    def _signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the server's process group, ignoring a group that is gone."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> EnvServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EnvServer(url={self.url!r}, pid={self.pid}, running={self.running})"


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``), so a
    node killed with SIGKILL does not leave its env servers behind. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def _spawn(module: str, host: str, port: int, args: Sequence[str] = (), log_path: Path | None = None) -> EnvServer:
    """Start ``module`` on ``host:port`` (with ``args``) in a new process group, its output to ``log_path`` (emptied
    first) or, when None, to a temp file its `EnvServer.stop` removes."""
    keep_log = log_path is not None
    if log_path is None:
        fd, log_name = tempfile.mkstemp(prefix="env-server-", suffix=".log")
        log_path = Path(log_name)
        log = os.fdopen(fd, "ab")
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log:
        process = subprocess.Popen(
            [sys.executable, "-m", module, "--host", host, "--port", str(port), *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=_die_with_parent(),
        )
    return EnvServer(process, f"http://{host}:{port}", log_path, keep_log=keep_log)


class EnvServerLaunch:
    """An env server process started by `launch_env_server` and not yet known to be healthy: the caller does other
    work while the process imports and binds, then calls `wait`. (A process, not a thread: the server is spawned from
    the calling thread, whose exit would SIGTERM it through ``PR_SET_PDEATHSIG``, so that thread must live on.)"""

    def __init__(self, module: str, host: str, port: int, args: Sequence[str], log_path: Path | None = None):
        self.module, self.host, self.port, self.args, self.log_path = module, host, port, tuple(args), log_path
        self._attempts = _PORT_RETRIES if port == 0 else 1
        self._attempt = 1
        self.server = _spawn(module, host, port or find_free_port(host), self.args, log_path)

    def wait(self, startup_timeout_s: float = 60.0) -> EnvServer:
        """Return the server once its ``/health`` answers (within ``startup_timeout_s`` seconds of this call); a lost
        race for a free port respawns it on another, from the calling thread.

        Raises:
            EnvServerError: the process exited or is not healthy in time; the message names the URL and ends with
                the tail of the server's output. The process is stopped before raising.
        """
        while True:
            try:
                wait_for_env(self.server.url, startup_timeout_s, process=self.server._process)
            except EnvServerError as exc:
                tail = self.server.log_tail()
                self.server.stop()
                if self._attempt < self._attempts and "address already in use" in tail.lower():
                    logger.info("port race on %s, retrying with another port", self.server.url)
                    self._attempt += 1
                    self.server = _spawn(self.module, self.host, find_free_port(self.host), self.args, self.log_path)
                    continue
                raise EnvServerError(f"{exc}\n--- server output (tail) ---\n{tail}") from None
            logger.info("env server %s up at %s (pid %d)", self.module, self.server.url, self.server.pid)
            return self.server

    def stop(self) -> None:
        """Stop the process (`EnvServer.stop`: idempotent), healthy or not."""
        self.server.stop()


class BorrowedEnvServer:
    """An env server another process owns, used by URL: a node's life forked from its standby
    (`nodes.standby.Standby.run_lives`) plays on the server the standby launched and waited for, and the standby stops
    it once that life ended. Shaped as `EnvServerLaunch` (``wait``, ``stop``) and `EnvServer` (``url``, ``pid``) for
    the join that takes it (`nodes.node.Node`); it never signals or waits for the process, which is not its child.

    Args:
        server: the owner's `EnvServer` (its ``url`` and ``pid`` are read; ``atexit`` no longer stops it here).
    """

    def __init__(self, server: EnvServer):
        self.url, self.pid, self.log_path = server.url, server.pid, server.log_path
        atexit.unregister(server.stop)  # the copy a fork inherited: the owner stops it, not this process's exit

    def wait(self, startup_timeout_s: float = 60.0) -> BorrowedEnvServer:
        """Return this server once its ``/health`` answers (within ``startup_timeout_s`` seconds).

        Raises:
            EnvServerError: it does not answer in time (its owner stopped it, or it died).
        """
        wait_for_env(self.url, startup_timeout_s)
        return self

    def stop(self) -> None:
        """Nothing: the owner stops it."""


def launch_env_server(module: str = "envs.tool_env.server", host: str = "127.0.0.1", port: int = 0,
                      args: Sequence[str] = (), log_path: Path | None = None) -> EnvServerLaunch:
    """Spawn an environment server process and return at once (`EnvServerLaunch.wait` gives the healthy server).
    The arguments are `start_env_server`'s."""
    return EnvServerLaunch(module, host, port, args, log_path)


def start_env_server(
    module: str = "envs.tool_env.server",
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout_s: float = 60.0,
    args: Sequence[str] = (),
    log_path: Path | None = None,
) -> EnvServer:
    """Start an environment server process and return once its ``/health`` answers.

    Args:
        module: importable module run with ``python -m``; must accept ``--host`` and ``--port``.
        host: interface to bind; also the host in ``EnvServer.url``.
        port: TCP port; 0 picks a free one (retried on a bind race).
        startup_timeout_s: seconds to wait for ``/health``.
        args: more command-line arguments for the module (``[env] server_args``).
        log_path: file for the server's stdout and stderr, emptied first and kept after ``stop()`` (a node's
            ``<run-dir>/<name>/env-server.log``: its last life's server output stays where the node's other files are,
            a SIGKILLed node leaves no temp file); None: a temp file ``stop()`` removes.

    Raises:
        EnvServerError: if the process exits or is not healthy within ``startup_timeout_s``; the
            message names the URL and ends with the tail of the server's output. The process is
            stopped before raising.
    """
    return launch_env_server(module, host, port, args, log_path).wait(startup_timeout_s)
