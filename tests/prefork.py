"""The suite's process template: nodes and coordinators forked from one interpreter that imported them once.

A node's interpreter spends ~11 s of CPU importing torch, transformers, TRL and hivemind before the first line of its
CLI runs, a coordinator's ~5 s; on CI's two cores that was most of a multi-process test's CPU, paid again for every
restart. The template imports the modules of ``python -m nodes`` and ``python -m coordinator`` once, in a process of
its own, and forks from it the CLI processes the tests start (`popen`, `run`; `local_run.LocalRun` starts every node
and coordinator so): each a new OS process with its own pid, session (process group, so a test's SIGKILL takes down its
whole tree as before), environment, working directory, stdin/stdout/stderr and argv, which runs the module as
``python -m`` would (``runpy``, ``__main__``) and exits as an interpreter does (non-daemon threads joined, ``atexit``
run, the exit code of ``SystemExit``). The tests' own peer scripts (``python tests/state_peer.py ...``: hivemind and
torch imported, ~4 s of CPU each) are forked the same way and run as ``python script.py`` would (``runpy.run_path``,
the script's folder first on ``sys.path``). Their children (env servers, p2pd, hivemind's processes, the nodes of a
``simulate``) are started as always, by exec.

What differs from a fresh interpreter: the imports are already done. So a process is exec'd instead when it asks for
an interpreter option (``-X importtime``: the tests of what a CLI does before its imports, or of which modules it
imports, use one) or for an environment that differs from the template's in anything read at start or import
(`READ_WHEN_USED`, `Template.why_not`); ``COMPOSER_DILOCO_TEST_EXEC=1`` execs every process.

Protocol, on a Unix ``SOCK_SEQPACKET`` socket: a client sends one JSON message (``module``, ``path`` or ``code``,
``args``, ``env``, ``cwd``, ``netns``) with three file descriptors (stdin, stdout, stderr) by ``SCM_RIGHTS``; the
template answers the child's pid,
then, once the child exited, its exit status as `subprocess.Popen.returncode` gives it (``-N``: killed by signal N),
and closes the connection.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("nodes.cli", "nodes.node", "nodes.standby", "coordinator.cli", "coordinator.coordinator")
"""What the template imports: everything ``python -m nodes join`` and ``python -m coordinator start`` import."""

DUMP_SIGNAL = signal.SIGUSR1
"""The signal on which a forked process (and every process hivemind forks from it) prints its threads' stacks."""

READ_WHEN_USED = ("COMPOSER_DILOCO_", "COLUMNS", "LINES", "TTY_", "PYTEST_", "TORCHINDUCTOR_CACHE_DIR")
"""Environment variables (prefixes) read when they are used, not at start or import: this project's (its cache, its
fault plan, its secret, its device-memory cap), the terminal's (rich reads them as it makes a console) and pytest's
(``PYTEST_CURRENT_TEST`` names the test running). A spawn's environment may differ from the template's only in these:
libraries read others once, at import (trackio its ``TRACKIO_DIR``, huggingface_hub its ``HF_*``, torch
``OMP_NUM_THREADS``, glibc ``MALLOC_*``), so a process that asks for other values of them is exec'd."""

_MAX_MESSAGE = 1 << 20


def _fixed_at_start(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what is read when used (`READ_WHEN_USED`): what must be the template's for a fork."""
    return {k: v for k, v in env.items() if not k.startswith(READ_WHEN_USED)}


# -- the template process ------------------------------------------------------------------------------------------
def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process, run its module as ``python -m`` does (or its script, as
    ``python script.py`` does), exit. Never returns."""
    code = 1
    try:
        if request.get("netns"):
            _enter_netns(request["netns"])
        os.setsid()
        _own_process_locks()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        import faulthandler

        # SIGUSR1 writes every thread's Python stack to stderr (its log), here and in the processes hivemind forks
        # from it: what a test that timed out reads of a process that hangs (`local_run.LocalRun.dump_stacks`)
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy

        import numpy

        numpy.random.seed()  # a fresh interpreter seeds numpy's global generator from the OS; a fork would copy it
        try:
            if "path" in request:  # ``python path/to/script.py``: the script's folder is the first import path
                sys.argv = [request["path"], *request["args"]]
                sys.path[0] = os.path.dirname(os.path.abspath(request["path"]))
                runpy.run_path(request["path"], run_name="__main__")
            elif "code" in request:  # ``python -c CODE``: the working directory is the first import path
                sys.argv = ["-c", *request["args"]]
                sys.path[0] = ""
                main = {"__name__": "__main__", "__builtins__": __builtins__}
                exec(compile(request["code"], "<string>", "exec"), main)
            else:
                sys.argv = [request["module"], *request["args"]]
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
    finally:
        from nodes.fork import exit_as_interpreter

        exit_as_interpreter(code)  # non-daemon threads joined, atexit run, streams flushed, os._exit


def _own_process_locks() -> None:
    """hivemind's process-wide locks of the forked child's own (`nodes.fork.own_process_locks`): made once when the
    template imported hivemind, every process of the session would share one semaphore, and a process SIGKILLed while
    it held one left every later DHT start waiting on it (the CI hang of stop 57 and of 2026-12-01)."""
    from nodes.fork import own_process_locks

    own_process_locks()


def _enter_netns(name: str) -> None:
    """Join the network namespace ``/var/run/netns/NAME``, as ``ip netns exec NAME`` does for the network (setns(2);
    ``os.setns`` from Python 3.12 on). The calling thread's namespace; the forked child has no other thread yet.

    Raises:
        OSError: no such namespace, or not allowed (setns needs CAP_SYS_ADMIN)."""
    import ctypes

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


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
    ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``, and ``stdout`` /
    ``stderr`` (streams, where `popen` was asked for pipes). Its exit status comes from the template, its parent.

    Raises (``poll``, ``wait``): RuntimeError when the template died before reporting the status.
    """

    def __init__(self, conn: socket.socket, args: list[str], stdin=None, stdout=None, stderr=None):
        self._conn = conn
        self.args = args
        self.pid = int(conn.recv(64))
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._read: dict[str, list] | None = None

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

    def communicate(self, input=None, timeout: float | None = None):  # noqa: A002 - Popen's name
        """Read ``stdout`` and ``stderr`` (where they are pipes) to their end, then wait; as `subprocess.Popen`."""
        if input is not None:
            raise ValueError("communicate(input=...) is not offered: write to stdin")
        if self.stdin is not None and not self.stdin.closed:  # as Popen: the child sees its input end
            try:
                self.stdin.close()
            except BrokenPipeError:
                pass
        if self._read is None:  # name -> (its reader thread, [what it read])
            self._read = {}
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    box: list = []
                    thread = threading.Thread(target=lambda s=stream, b=box: b.append(s.read()), daemon=True)
                    thread.start()
                    self._read[name] = (thread, box)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread, _ in self._read.values():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = {name: box[0] for name, (_, box) in self._read.items()}
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return out.get("stdout"), out.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """The template process (`start`, one per pytest session) and the client side of its protocol (`spawn`)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="composer-diloco-prefork-")
        self.path = os.path.join(self._dir, "socket")
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def start(self, env: dict[str, str]) -> None:
        """Start the template with ``env`` (`why_not` compares a spawn's against it) and wait for its imports.

        Raises:
            RuntimeError: the template exited before it was ready.
        """
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdout=subprocess.PIPE, env=self.env,
                                     cwd=ROOT, stdin=subprocess.DEVNULL)
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the suite's process template did not start (exit {self.proc.wait()})")

    def why_not(self, env: dict[str, str]) -> str:
        """Why a process with ``env`` cannot be forked from the template ("" when it can): the template is gone, or
        the two environments differ in what is read at start or import (anything but `READ_WHEN_USED`)."""
        if self.proc is None or self.proc.poll() is not None:
            return "the template is not running"
        mine, theirs = _fixed_at_start(env), _fixed_at_start(self.env)
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        return f"environment: {', '.join(differ)}" if differ else ""

    def spawn(self, argv: list[str], target: tuple[str, str, list[str], str], env: dict[str, str], cwd: str,
              fds: tuple[int, int, int], ends: tuple = (None, None, None)) -> ForkedProcess:
        """Fork ``argv``, parsed by `_target` into ``target``, with ``env``, ``cwd`` and ``fds`` as its stdin, stdout
        and stderr (the caller closes its copies); ``ends`` are the caller's ends of pipes (stdin, stdout, stderr;
        None where there is none), kept on the process.

        Raises:
            ValueError: the request is larger than a message may be."""
        kind, what, args, netns = target
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            message = json.dumps({kind: what, "args": args, "env": env, "cwd": cwd, "netns": netns}).encode()
            if len(message) > _MAX_MESSAGE:
                raise ValueError(f"a fork request of {len(message)} bytes: at most {_MAX_MESSAGE}")
            socket.send_fds(conn, [message], list(fds))
            return ForkedProcess(conn, list(argv), *ends)
        except BaseException:
            conn.close()
            raise

    def stop(self) -> None:
        """Stop the template (children it leaves are the tests' leaks: the suite's reaper reports them)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


_template: Template | None = None
FORKED: list[str] = []
"""The module of every process `popen` forked this session."""
EXECED: dict[str, int] = {}
"""Why `popen` exec'd a process -> how many times, this session (`summary`)."""


def template() -> Template | None:
    """The session's template, started on first use with this process's environment (the suite's: conftest set
    ``OMP_NUM_THREADS=1``); None when ``COMPOSER_DILOCO_TEST_EXEC=1`` asks for every process to be exec'd."""
    global _template
    if os.environ.get("COMPOSER_DILOCO_TEST_EXEC") == "1":
        return None
    if _template is None:
        started = time.monotonic()
        _template = Template()
        _template.start({**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        print(f"\nprocess template ready in {time.monotonic() - started:.1f} s (nodes and coordinators are forked "
              "from it)", flush=True)
    return _template


def template_pid() -> int | None:
    """The pid of the session's template while it runs (the suite's reaper leaves it to `stop_template`)."""
    return _template.proc.pid if _template is not None and _template.proc is not None else None


def summary() -> str:
    """One line: how many processes were forked and how many exec'd, and why (the suite's terminal summary)."""
    why = "; ".join(f"{n} ({reason})" for reason, n in sorted(EXECED.items(), key=lambda x: -x[1]))
    return f"process template: {len(FORKED)} CLI processes forked, {sum(EXECED.values())} exec'd" + \
        (f": {why}" if why else "")


def stop_template() -> None:
    """Stop the session's template, if one was started."""
    global _template
    if _template is not None:
        _template.stop()
        _template = None


_FORKABLE = {"stdin", "stdout", "stderr", "text", "env", "cwd", "start_new_session"}


def _target(argv: list[str]) -> tuple[str, str, list[str], str] | None:
    """What the template can run of ``argv``, as ``(kind, target, args, netns)``: ``("module", module, args, ...)`` for
    ``[sys.executable, "-m", module, *args]``, ``("path", script, args, ...)`` for ``[sys.executable, "script.py",
    *args]``, ``("code", code, args, ...)`` for ``[sys.executable, "-c", code, *args]``; ``netns`` is ``NS`` after an
    ``ip netns exec NS`` prefix, else "". None for anything else (an interpreter option such as ``-X importtime``)."""
    netns = ""
    if len(argv) > 4 and list(argv[:3]) == ["ip", "netns", "exec"]:
        netns, argv = str(argv[3]), argv[4:]
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if len(argv) > 2 and argv[1] in ("-m", "-c"):
        return ("module" if argv[1] == "-m" else "code"), str(argv[2]), [str(a) for a in argv[3:]], netns
    if str(argv[1]).endswith(".py") and os.path.isfile(argv[1]):
        return "path", str(argv[1]), [str(a) for a in argv[2:]], netns
    return None


def popen(argv: list[str], **kwargs) -> ForkedProcess | subprocess.Popen:
    """``subprocess.Popen(argv, **kwargs)``, forked from the template when `_target` can run ``argv`` (``python -m``,
    a script, ``-c``, maybe after ``ip netns exec NS``: the child joins the namespace, `_enter_netns`; a ``-c`` that
    looks at what is imported, or at the process's memory, must stay a `subprocess` call: here its imports are done),
    the keyword arguments are among ``stdin``, ``stdout``, ``stderr`` (None, a file, a descriptor, ``PIPE``,
    ``DEVNULL``, ``STDOUT``), ``text``, ``env``, ``cwd`` and ``start_new_session`` (always: a forked process leads its
    own session), and `Template.why_not` finds nothing; exec'd as asked otherwise."""
    env = dict(kwargs["env"]) if kwargs.get("env") is not None else dict(os.environ)
    target = _target(argv)
    if target is None:
        why = "not python -m MODULE, python SCRIPT.py or python -c CODE"
    elif not set(kwargs) <= _FORKABLE:
        why = f"Popen arguments {sorted(set(kwargs) - _FORKABLE)}"
    elif (forks := template()) is None:
        why = "COMPOSER_DILOCO_TEST_EXEC=1"
    else:
        why = forks.why_not(env)
    if why:
        EXECED[why] = EXECED.get(why, 0) + 1
        return subprocess.Popen(argv, **kwargs)
    FORKED.append("-c" if target[0] == "code" else os.path.basename(target[1]))
    text = bool(kwargs.get("text"))
    mine: list[int] = []  # our copies of the child's descriptors, closed once it has them
    ends: list = [None, None, None]

    def resolve(spec, default: int, which: int) -> int:
        if spec is None:
            return default
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
        elif spec == subprocess.PIPE:
            read_end, write_end = os.pipe()
            fd, ours = (read_end, write_end) if which == 0 else (write_end, read_end)
            mode = ("w" if which == 0 else "r") + ("" if text else "b")
            ends[which] = os.fdopen(ours, mode, **({"buffering": 1} if text and which == 0 else {}))
        elif isinstance(spec, int):
            return spec
        else:
            return spec.fileno()
        mine.append(fd)
        return fd

    try:
        stdin = resolve(kwargs.get("stdin") or subprocess.DEVNULL, 0, 0)  # never the suite's own stdin
        stdout = resolve(kwargs.get("stdout"), 1, 1)
        stderr = stdout if kwargs.get("stderr") == subprocess.STDOUT else resolve(kwargs.get("stderr"), 2, 2)
        return forks.spawn(list(argv), target, env, str(kwargs.get("cwd") or os.getcwd()), (stdin, stdout, stderr),
                           tuple(ends))
    except BaseException:
        for end in ends:
            if end is not None:
                end.close()
        raise
    finally:
        for fd in mine:
            os.close(fd)


def run(argv: list[str], *, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run``, its process started by `popen` (forked when it can be)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if "input" in kwargs:
        return subprocess.run(argv, timeout=timeout, check=check, **kwargs)
    proc = popen(argv, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    serve(sys.argv[1])
