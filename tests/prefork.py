"""The suite's process template: nodes and coordinators forked from one interpreter that imported them once.

A node's interpreter spends ~11 s of CPU importing torch, transformers, TRL and hivemind before the first line of its
CLI runs, a coordinator's ~5 s; on CI's two cores that was most of a multi-process test's CPU, paid again for every
restart. The template imports the modules of ``python -m nodes`` and ``python -m coordinator`` once, in a process of
its own, and forks every node and coordinator `local_run.LocalRun` starts from it: a new OS process with its own pid,
session (process group, so a test's SIGKILL takes down its whole tree as before), environment, working directory,
stdin/stdout/stderr and argv, which runs the module as ``python -m`` would (``runpy``, ``__main__``) and exits as an
interpreter does (non-daemon threads joined, ``atexit`` run, the exit code of ``SystemExit``). Its children (env
servers, p2pd, hivemind's processes, the reaper) are started as always.

What differs from a fresh interpreter: the imports are already done. A test of what a CLI does before its imports,
or of which modules it imports, starts its own interpreter (none of those uses `LocalRun`), and a spawn whose
environment differs from the template's in what an interpreter reads only at its start (``PYTHON*``, ``MALLOC_*``,
``LD_*``, and ``OMP_NUM_THREADS``, which torch reads at import) is not forked (`can_fork`): `LocalRun` execs it.

Protocol, on a Unix ``SOCK_SEQPACKET`` socket: a client sends one JSON message (``module``, ``args``, ``env``,
``cwd``) with three file descriptors (stdin, stdout, stderr) by ``SCM_RIGHTS``; the template answers the child's pid,
then, once the child exited, its exit status as `subprocess.Popen.returncode` gives it (``-N``: killed by signal N),
and closes the connection.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("nodes.cli", "nodes.node", "nodes.standby", "coordinator.cli", "coordinator.coordinator")
"""What the template imports: everything ``python -m nodes join`` and ``python -m coordinator start`` import."""

READ_AT_START = ("PYTHON", "MALLOC_", "LD_", "OMP_NUM_THREADS", "MKL_", "GLIBC_")
"""Environment variables (prefixes) an interpreter or its libraries read once, at start or import."""

_MAX_MESSAGE = 1 << 20


def _read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START)}


# -- the template process ------------------------------------------------------------------------------------------
def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process, run its module as ``python -m`` does, exit. Never returns."""
    code = 1
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy
        import threading

        import numpy

        numpy.random.seed()  # a fresh interpreter seeds numpy's global generator from the OS; a fork would copy it
        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - as the interpreter would: its traceback, exit 1
            import traceback

            traceback.print_exc()
            code = 1
        threading._shutdown()  # as the interpreter's own exit: wait for non-daemon threads, then atexit
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing left to say
                pass
        os._exit(code)


def serve(path: str) -> None:
    """The template's main loop: import `PRELOAD`, print ``ready``, then fork one child per request until the parent
    (pytest) is gone or SIGTERM. Single-threaded (a fork copies only the calling thread): children are reaped by
    polling ``waitpid``."""
    import importlib
    import selectors

    parent = os.getppid()
    sys.path[0] = str(ROOT)  # as ``python -m`` in ROOT has it (not this file's folder)
    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while os.getppid() == parent:
        for _ in selector.select(timeout=0.1):
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                _run_child(json.loads(message), fds)
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass
                conn.close()


# -- the client (the pytest process) ---------------------------------------------------------------------------------
class ForkedProcess:
    """A process the template forked, with what `subprocess.Popen` offers the suite: ``pid``, ``args``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill`` and ``stdout`` (a binary stream
    when asked for a pipe). Its exit status comes from the template, its parent.

    Raises (``poll``/``wait``): RuntimeError when the template died before reporting the status.
    """

    def __init__(self, conn: socket.socket, args: list[str], stdout_pipe=None):
        self._conn = conn
        self.args = args
        self.pid = int(conn.recv(64))
        self.returncode: int | None = None
        self.stdout = stdout_pipe
        self.stderr = None

    def _read_status(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        data = self._conn.recv(64)
        if not data:
            raise RuntimeError(f"the suite's process template died before pid {self.pid} ({self.args}) exited")
        self.returncode = int(data)
        self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._read_status(0)
            except (BlockingIOError, TimeoutError):
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self._read_status(timeout)
            except (BlockingIOError, TimeoutError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class Template:
    """The template process (started by `start`, one per pytest session) and the client side of its protocol."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="composer-diloco-prefork-")
        self.path = os.path.join(self._dir, "socket")
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def start(self, env: dict[str, str]) -> None:
        """Start the template with ``env`` (the suite's: `can_fork` compares a spawn's against it) and wait for its
        imports (up to 300 s).

        Raises:
            RuntimeError: the template exited or did not get ready.
        """
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdout=subprocess.PIPE, env=self.env,
                                     cwd=ROOT, stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the suite's process template did not start (exit {self.proc.poll()})")

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a process with ``env`` can be forked from the template: what is read only at an interpreter's
        start (`READ_AT_START`) is the same in both."""
        return self.proc is not None and self.proc.poll() is None and _read_at_start(env) == _read_at_start(self.env)

    def spawn(self, module: str, args: list[str], env: dict[str, str], cwd: Path, stdout: int,
              stderr: int) -> ForkedProcess:
        """Fork ``python -m module *args`` with ``env``, ``cwd``, stdin from /dev/null and the given stdout/stderr
        (file descriptors, or `subprocess.PIPE` for stdout)."""
        pipe = None
        if stdout == subprocess.PIPE:
            read_end, stdout = os.pipe()
            pipe = os.fdopen(read_end, "rb")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            with open(os.devnull, "rb") as devnull:
                message = json.dumps({"module": module, "args": args, "env": env, "cwd": str(cwd)}).encode()
                socket.send_fds(conn, [message], [devnull.fileno(), stdout, stderr])
            return ForkedProcess(conn, [sys.executable, "-m", module, *args], pipe)
        except BaseException:
            conn.close()
            raise
        finally:
            if pipe is not None:
                os.close(stdout)

    def stop(self) -> None:
        """Stop the template (its children, if any are left, are not its to stop: the suite's reaper reports them)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


_template: Template | None = None


def template(env: dict[str, str]) -> Template | None:
    """The session's template, started on first use with ``env``; None when ``COMPOSER_DILOCO_TEST_EXEC=1`` asks for
    every process to be exec'd (to check that a change works from a fresh interpreter too)."""
    global _template
    if os.environ.get("COMPOSER_DILOCO_TEST_EXEC") == "1":
        return None
    if _template is None:
        started = time.monotonic()
        _template = Template()
        _template.start(env)
        print(f"\nprocess template ready in {time.monotonic() - started:.1f} s (nodes and coordinators are forked "
              "from it)", flush=True)
    return _template


def template_pid() -> int | None:
    """The pid of the session's template while it runs (the suite's reaper leaves it to `stop_template`)."""
    return _template.proc.pid if _template is not None and _template.proc is not None else None


def stop_template() -> None:
    """Stop the session's template, if one was started."""
    global _template
    if _template is not None:
        _template.stop()
        _template = None


if __name__ == "__main__":
    serve(sys.argv[1])
