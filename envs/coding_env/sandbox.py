"""Run untrusted Python (the model's code and the tests) in a contained child process.

Every run gets a fresh temporary workspace holding a copy of the episode's files, removed afterwards, and a child
process (``sandbox_runner.py``, standard library only) that isolates itself before it imports any of the model's
code. The model is an adversary paid to find holes, so nothing below relies on the PEP 578 audit hook: the code can
find and disable it in a few lines (a ``gc`` walk to the hook's closure). The hook stays as a guard rail that turns
ordinary mistakes (a socket, a fork) into clear tool errors; ``tests/test_sandbox_containment.py`` attacks with it
off.

Deployment modes (``isolation()["mode"]``; the server logs it at start and refuses to serve in ``none`` unless
``--allow-weak-sandbox``), as measured on this machine (kernel 6.18, cgroup v1):

=====================  ================================  ================================  =====================
layer                  ``root`` (server is root)          ``user_namespace`` (unprivileged  ``none`` (unprivileged,
                                                          server, user namespaces allowed)  no user namespaces)
=====================  ================================  ================================  =====================
network                new netns, no interface up         same                              audit hook only
mount / filesystem     new mount ns; root = empty tmpfs   same (the mounts are locked: a    audit hook only
                       with only the stdlib and system    user namespace of the code's own
                       libraries (read-only), devices,    cannot unmount or remount them)
                       the workspace, own /proc;
                       ``pivot_root``, host root detached
PID, IPC, UTS          new namespaces; own read-only      same                              shared
                       /proc; SysV IPC dies with the run
privileges             fresh random uid; no capabilities  uid 0 of the user namespace with  no capabilities,
                       (bounding set emptied), no_new_    no capabilities (capset, bounding  no_new_privs
                       privs                              set, locked secure bits),
                                                          no_new_privs
disk                   workspace tmpfs of ``disk_mb``,    same                              ``RLIMIT_FSIZE`` per
                       ``max_workspace_files`` entries                                      file only
memory, processes      cgroup: ``memory_mb + disk_mb``    ``RLIMIT_AS`` per process times   as user_namespace
                       and ``max_processes + 2`` for the  ``RLIMIT_NPROC`` (the server's
                       whole run; plus the rlimits        uid counts: documented fallback)
CPU, time              ``RLIMIT_CPU``, per-test ``SIGALRM``, the wall clock (all modes)
=====================  ================================  ================================  =====================

What the model's code can still do in the strong modes: create a user namespace of its own (it gets capabilities
over copies of its own mounts, which the kernel locks: nothing to reveal, nothing to make writable; without a
writable ``/proc`` it cannot even map a uid there), and use its own resources up to the limits above. There is no
seccomp filter (no well-kept library is installed for it).

Threats and how they are reported:

========================  ===========================================================  ==========================
threat                    contained by                                                 reported as
========================  ===========================================================  ==========================
endless loop              per-test ``SIGALRM`` (``per_test_timeout_s``); ``RLIMIT_CPU``  ``timeout`` (reason
                          (SIGXCPU, then SIGKILL); the server's wall clock kills the     ``test_timeout``,
                          process group (and with it the PID namespace)                  ``cpu_time``,
                                                                                         ``wall_clock``)
fork loop                 ``RLIMIT_NPROC`` on a fresh uid, the pids cgroup; a PID        ``execution_error``
                          namespace whose processes all die with its init; the hook      (``process_limit`` /
                                                                                         ``processes_refused``)
huge allocation           ``RLIMIT_AS`` (``memory_mb``) per process; the memory cgroup   ``execution_error``
                          for all of them together                                       (``memory_limit``)
writing outside           the allowlist root (read-only but the workspace); the hook     ``execution_error``
the workspace                                                                            (``write_outside_
                                                                                         workspace``), or the
                                                                                         path does not exist
filling the disk          the workspace tmpfs (size and entries); ``RLIMIT_FSIZE``       ``file_size_limit`` or
                                                                                         the code's ENOSPC
opening a socket          a new network namespace (no interfaces up, not even            ``execution_error``
                          loopback); the hook                                            (``network_disabled``)
reading hidden answers    the allowlist: no checkout, no site-packages, no other run's   -
                          ``/tmp`` is in view; expected outputs never enter the sandbox
                          (results are compared here)
forging the results       the records file is parsed defensively (`_parse_records`,      ``execution_error``
                          `parse_json`); ``submit`` compares values in the server        (``malformed_output``)
========================  ===========================================================  ==========================

Limits, honestly:

- Without namespaces (mode ``none``) the audit hook is the only layer for the network, the filesystem and
  processes, and the code can switch it off: then it runs as the server's user with the server's view. Hence the
  refusal to serve there.
- The uid drop needs root. The fresh uid is random per run, so ``RLIMIT_NPROC`` counts only that run's processes.
  If the allowlist root cannot be built (e.g. no ``pivot_root`` on this architecture), the run falls back to a
  read-only view of the host with the ``hide`` paths covered, and says so in ``notes``.
- Without a cgroup (a non-root server, or a cgroup tree that is not writable) memory is bounded per process:
  ``memory_mb`` times up to ``max_processes`` processes when the hook is off and forking is allowed.
- The runner's records travel on a file descriptor the code could also write to. That can only mislead the
  agent's own ``run_tests`` feedback: ``submit`` compares returned values with expected ones in the server. The
  server parses the stream defensively (size, line length, nesting depth, each record's fields and types:
  `_parse_records`, `parse_json`); a stream that fails is reported as ``malformed`` and becomes a typed tool
  error, never an exception in the server.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "PROJECT_ROOT",
    "REQUIRED_LAYERS",
    "SandboxLimits",
    "SandboxPolicy",
    "SandboxResult",
    "check_workspace",
    "isolation",
    "missing_layers",
    "parse_json",
    "run_sandboxed",
    "safe_relative_path",
]

logger = logging.getLogger(__name__)

RUNNER = Path(__file__).resolve().with_name("sandbox_runner.py")
PROJECT_ROOT = RUNNER.parents[2]
"""The repository holding ``envs/`` (hidden from the sandbox: it holds the tasks' reference solutions)."""

_UID_BASE = 100_000_000
_STDERR_TAIL_CHARS = 2000
_CHILD_PATH = "/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox run.

    Attributes:
        wall_time_s: wall-clock seconds for the whole run (interpreter start included); then the process group
            is killed and the run reports ``timed_out``.
        cpu_time_s: CPU seconds of the runner process (``RLIMIT_CPU``; SIGXCPU, SIGKILL one second later).
        per_test_timeout_s: wall-clock seconds for one test function or one case (``SIGALRM`` in the runner).
        memory_mb: address-space limit of each process in MiB (``RLIMIT_AS``).
        max_processes: processes the run's uid may have at once (``RLIMIT_NPROC``).
        max_file_mb: largest file a process may write, in MiB (``RLIMIT_FSIZE``; also caps the captured output).
        max_open_files: file descriptors per process (``RLIMIT_NOFILE``).
        disk_mb: size of the workspace in MiB, all files together (a tmpfs of that size; needs a mount namespace).
        max_workspace_files: files and directories the workspace may hold (the tmpfs's inodes).

    Total memory: with a cgroup (root on a machine whose cgroup tree is writable) all processes of a run together
    get ``memory_mb + disk_mb`` MiB (the workspace's tmpfs pages count too) and at most ``max_processes + 2``
    processes (the runner's own two included); without one, only the per-process limits hold.

    Raises:
        ValueError: if a limit is not positive, or ``memory_mb < 64`` (the interpreter alone needs about 30 MiB).
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 8
    per_test_timeout_s: float = 2.0
    memory_mb: int = 512
    max_processes: int = 16
    max_file_mb: int = 4
    max_open_files: int = 64
    disk_mb: int = 64
    max_workspace_files: int = 4096

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")
        if self.memory_mb < 64:
            raise ValueError(f"SandboxLimits.memory_mb must be >= 64 (the interpreter needs it), got {self.memory_mb}")


@dataclass(frozen=True)
class SandboxPolicy:
    """Which isolation layers a run tries (tests switch layers off to check each one alone).

    Attributes:
        namespaces: try new network, mount and PID namespaces.
        drop_uid: when the server runs as root, run the code as a fresh random unprivileged uid.
        audit_hook: install the PEP 578 hook that refuses sockets, processes, ctypes and writes outside the
            workspace, and reports each refusal.
        hide: directories the code must not read (covered by an empty tmpfs, or refused by the hook).
    """

    namespaces: bool = True
    drop_uid: bool = True
    audit_hook: bool = True
    hide: tuple[str, ...] = (str(PROJECT_ROOT),)


@dataclass
class SandboxResult:
    """What one run produced.

    Attributes:
        records: the runner's JSON records in order (``isolation``, ``start``, ``test``, ``case``,
            ``import_error``, ``violation``, ``done``); see ``sandbox_runner.py``.
        exit_code: the runner's exit status, 128 + N when killed by signal N; None when the wall clock killed it.
        timed_out: whether the wall clock (``SandboxLimits.wall_time_s``) ran out.
        wall_s: seconds the run took, workspace set-up and clean-up excluded.
        stderr_tail: the last 2000 characters of the code's output (stdout and stderr), workspace path replaced by
            ``./``.
        isolation: the layers that were active (the ``isolation`` record), ``{}`` if the runner died first.
        violations: the ``violation`` records (what the audit hook refused).
        malformed: why the runner's output stream could not be trusted (a line that is not a well-formed record,
            too long, too deep, or too much in all; see `_parse_records`), None when it was well formed. The
            records before the bad line are kept; nothing after it is read.
    """

    records: list[dict[str, Any]]
    exit_code: int | None
    timed_out: bool
    wall_s: float
    stderr_tail: str
    isolation: dict[str, Any] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)
    malformed: str | None = None
    oom_killed: bool = False

    @property
    def finished(self) -> bool:
        """Whether the runner reached its end (a ``done`` record)."""
        return any(r.get("type") == "done" for r in self.records)

    @property
    def killed_by(self) -> int | None:
        """The signal number that killed the runner, if any (e.g. 9 SIGKILL, 24 SIGXCPU)."""
        if self.exit_code is not None and self.exit_code > 128:
            return self.exit_code - 128
        return None

    @property
    def last_started(self) -> str | None:
        """Name of the last test or case that started (the one running when a run was killed)."""
        starts = [r["name"] for r in self.records if r.get("type") == "start"]
        return starts[-1] if starts else None


def safe_relative_path(path: str) -> str | None:
    """``path`` normalized if it is a plain relative path inside a workspace, else None.

    Allowed: components of letters, digits, ``_``, ``-`` and ``.``, at most 3 deep, no ``..``, not absolute, at
    most 100 characters. Example: ``"./pkg/util.py"`` -> ``"pkg/util.py"``; ``"../x"`` -> None.
    """
    if not isinstance(path, str) or not path or len(path) > 100 or path.startswith("/") or "\\" in path:
        return None
    parts = [p for p in PurePosixPath(path).parts if p != "."]
    if not parts or len(parts) > 3:
        return None
    for part in parts:
        if part == ".." or not all(c.isalnum() or c in "_-." for c in part) or part.startswith("."):
            return None
    return "/".join(parts)


def check_workspace(files: Mapping[str, str]) -> dict[str, str]:
    """``files`` with normalized paths, checked so that a workspace can always be built from them.

    Raises:
        ValueError: for an unsafe path (see `safe_relative_path`), a non-string text, two names of one path, or a
            path that is both a file and another file's directory (``solution.py`` and ``solution.py/x.py``).
    """
    checked: dict[str, str] = {}
    for name, text in files.items():
        rel = safe_relative_path(name)
        if rel is None:
            raise ValueError(f"unsafe workspace path {name!r}")
        if not isinstance(text, str):
            raise ValueError(f"workspace file {name!r} holds a {type(text).__name__}, not text")
        if rel in checked:
            raise ValueError(f"workspace path {name!r} names {rel!r} twice")
        checked[rel] = text
    for name in sorted(checked):
        inside = next((other for other in sorted(checked) if other.startswith(name + "/")), None)
        if inside is not None:
            raise ValueError(f"workspace path {name!r} is a file and the directory of {inside!r}")
    return checked


def _materialize(files: Mapping[str, str], workspace: Path, uid: int | None) -> None:
    """Write ``files`` into ``workspace`` (owned by ``uid`` when given); checked first, so it writes all or none.

    Raises:
        ValueError: see `check_workspace`.
    """
    for rel, text in check_workspace(files).items():
        target = workspace / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    if uid is not None:
        for root, dirs, names in os.walk(workspace):
            for name in dirs + names:
                os.chown(os.path.join(root, name), uid, uid)
        os.chown(workspace, uid, uid)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by ``uid`` (a run's fresh uid: nothing else runs as it)."""
    for _ in range(3):  # a process may fork while we scan
        found = False
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if entry.stat().st_uid == uid:
                        os.kill(int(entry.name), signal.SIGKILL)
                        found = True
                except (OSError, ValueError):
                    pass
        if not found:
            return


def _own_cgroups() -> dict[str, Path]:
    """This process's cgroup directory per hierarchy the sandbox uses: ``memory`` and ``pids`` (cgroup v1), or
    ``unified`` (v2), where that hierarchy is mounted."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else ["unified"]:
                own[name] = path
    found: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, after = left.split(), right.split()
            if len(fields) < 5 or len(after) < 3 or fields[3] != "/":
                continue
            if after[0] == "cgroup":
                for name in ("memory", "pids"):
                    if name in after[2].split(",") and name in own:
                        found[name] = Path(fields[4]) / own[name].lstrip("/")
            elif after[0] == "cgroup2" and "unified" in own:
                found.setdefault("unified", Path(fields[4]) / own["unified"].lstrip("/"))
    return found


def _make_cgroups(limits: SandboxLimits) -> list[tuple[str, Path]]:
    """New cgroups for one run (hierarchy name, directory), holding its total memory (``memory_mb + disk_mb``) and
    process count (``max_processes + 2``); ``[]`` where that is not possible (not root, or no writable tree)."""
    if os.geteuid() != 0:
        return []
    try:
        own = _own_cgroups()
    except OSError:
        return []
    memory = (limits.memory_mb + limits.disk_mb) << 20
    pids = limits.max_processes + 2  # the runner's parent outside the PID namespace and its init count too
    name = f"coding-env-{secrets.token_hex(6)}"
    plans: list[tuple[str, list[tuple[str, int]]]] = []
    if "memory" in own and "pids" in own:
        plans = [("memory", [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)]),
                 ("pids", [("pids.max", pids)])]
    elif "unified" in own:
        try:
            enabled = (own["unified"] / "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        if {"memory", "pids"} <= set(enabled):
            plans = [("unified", [("memory.max", memory), ("memory.swap.max", 0), ("pids.max", pids)])]
    made: list[tuple[str, Path]] = []
    try:
        for hierarchy, settings in plans:
            directory = own[hierarchy] / name
            directory.mkdir()
            made.append((hierarchy, directory))
            for setting, value in settings:
                if (directory / setting).exists():  # memsw and swap files exist only with swap accounting
                    (directory / setting).write_text(str(value))
        return made
    except OSError as exc:
        logger.debug("coding_env sandbox: no cgroup (%s)", exc)
        _remove_cgroups(made)
        return []


def _remove_cgroups(cgroups: list[tuple[str, Path]]) -> bool:
    """Kill every process left in the run's cgroups, remove them; True if the memory limit OOM-killed a process."""
    oom = False
    for _, directory in cgroups:
        for events in ("memory.oom_control", "memory.events"):
            try:
                for line in (directory / events).read_text().splitlines():
                    if line.startswith("oom_kill ") and int(line.split()[1]) > 0:
                        oom = True
            except (OSError, ValueError):
                pass
        for _ in range(200):
            try:
                procs = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                procs = []
            for pid in procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.005)  # killed processes leave the cgroup a moment later
        else:
            logger.warning("coding_env sandbox: could not remove cgroup %s", directory)
    return oom


def _read_tail(path: Path, max_chars: int) -> str:
    """Last ``max_chars`` characters of a file ('' when unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4 * max_chars))
            return fh.read().decode("utf-8", "replace")[-max_chars:]
    except OSError:
        return ""


MAX_RECORD_LINE_BYTES = 1 << 20
"""Longest record line the server parses (a case's JSON result included); a longer one makes the stream malformed."""
MAX_JSON_DEPTH = 64
"""Deepest nesting `parse_json` accepts (a case's result); the server's comparisons recurse that deep at most."""

_STR, _INT, _OPT_STR = (str,), (int,), (str, type(None))
_TEST_STATUSES = frozenset({"passed", "failed", "error", "timeout", "skipped"})
_CASE_STATUSES = frozenset({"ok", "error", "timeout", "skipped"})
_FAILURE_FIELDS = {"message": _STR, "error_type": _STR, "where": _OPT_STR, "line": _OPT_STR}
_RECORD_FIELDS: dict[str, tuple[dict[str, tuple[type, ...]], dict[str, tuple[type, ...]]]] = {
    # type -> (required fields, optional fields); every record also carries "pid" (int)
    "isolation": ({"network": _STR, "filesystem": _STR, "processes": _STR, "uid": _STR, "audit_hook": (bool,),
                   "hidden_paths": (list,), "notes": (list,)},
                  {"mode": _STR, "ipc": _STR, "uts": _STR, "proc": _STR, "capabilities": _STR, "no_new_privs": (bool,),
                   "disk": _STR, "cgroups": (list,), "visible_paths": (list,)}),
    "start": ({"name": _STR}, {}),
    "test": ({"name": _STR, "status": _STR}, _FAILURE_FIELDS),
    "case": ({"index": _INT, "status": _STR}, {"result": _STR, **_FAILURE_FIELDS}),
    "import_error": ({"file": _STR, "error_type": _STR, "message": _STR}, {"where": _OPT_STR, "line": _OPT_STR}),
    "violation": ({"what": _STR, "detail": _STR}, {}),
    "done": ({}, {}),
}


def parse_json(text: str, max_chars: int = MAX_RECORD_LINE_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` with bounds, for text that came out of the sandbox.

    Raises:
        ValueError: if ``text`` is not a string, is longer than ``max_chars``, is not JSON, or nests lists and
            objects deeper than ``max_depth`` (checked without recursion; the decoder's own recursion limit turns
            into this error too).
    """
    if not isinstance(text, str):
        raise ValueError(f"expected JSON text, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ValueError(f"JSON text of {len(text)} characters is over the limit of {max_chars}")
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    stack = [(value, 1)]
    while stack:  # iterative: a deep value must not exhaust the server's stack here either
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


def _record_problem(record: Any) -> str | None:
    """Why ``record`` is not a well-formed runner record, or None when it is."""
    if not isinstance(record, dict):
        return f"a record is a JSON {type(record).__name__}, not an object"
    kind = record.get("type")
    if kind not in _RECORD_FIELDS:
        return f"unknown record type {str(kind)[:40]!r}"
    required, optional = _RECORD_FIELDS[kind]
    for name, types in {"pid": _INT, **required}.items():
        if name not in record:
            return f"a {kind} record has no {name!r}"
        if not isinstance(record[name], types) or (types == _INT and isinstance(record[name], bool)):
            return f"a {kind} record's {name!r} is a {type(record[name]).__name__}"
    for name, types in optional.items():
        if name in record and not isinstance(record[name], types):
            return f"a {kind} record's {name!r} is a {type(record[name]).__name__}"
    for name in ("hidden_paths", "notes", "cgroups", "visible_paths"):
        if kind == "isolation" and not all(isinstance(v, str) for v in record.get(name, [])):
            return f"an isolation record's {name!r} holds a non-string"
    if kind == "test" and record["status"] not in _TEST_STATUSES:
        return f"a test record's status {record['status'][:40]!r} is unknown"
    if kind == "case":
        if record["status"] not in _CASE_STATUSES:
            return f"a case record's status {record['status'][:40]!r} is unknown"
        if record["status"] == "ok" and "result" not in record:
            return "an ok case record has no 'result'"
        if record["index"] < 0:
            return f"a case record's index {record['index']} is negative"
    return None


def _parse_records(path: Path, max_bytes: int) -> tuple[list[dict[str, Any]], str | None]:
    """The runner's records (JSON-object lines of the process that wrote the ``isolation`` record) and why the
    stream is malformed (None when it is not).

    The records file is written by the runner process, and the model's code runs in that process: it can write
    anything to it. So every line is checked: at most ``max_bytes`` in all and `MAX_RECORD_LINE_BYTES` a line,
    each a JSON object of a known record type with the fields that type needs (`_RECORD_FIELDS`). The first line
    that fails makes the stream malformed; records of other processes (children the code forked) are skipped. An
    unterminated last line under ``max_bytes`` is a record cut by the wall clock's kill and is dropped.
    """
    records: list[dict[str, Any]] = []
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError:
        return records, None
    lines = data.split(b"\n")
    lines.pop()  # b"" after a final newline, else a line cut by the wall clock's kill
    if len(data) >= max_bytes:  # the file-size limit cut it (the runner's own records are far smaller)
        return records, f"the output stream reached {max_bytes} bytes"
    problem = None
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_RECORD_LINE_BYTES:
            problem = f"record line {number} has {len(line)} bytes (limit {MAX_RECORD_LINE_BYTES})"
            break
        try:
            record = parse_json(line.decode("utf-8"), max_depth=3)
        except (UnicodeDecodeError, ValueError) as exc:
            problem = f"record line {number} is not valid JSON: {str(exc)[:120]}"
            break
        problem = _record_problem(record)
        if problem is not None:
            problem = f"record line {number}: {problem}"
            break
        records.append(record)
    runner = next((r["pid"] for r in records if r["type"] == "isolation"), None)
    return [r for r in records if r["pid"] == runner], problem


def _rmtree(path: Path) -> None:
    """Remove a run's directory, also when the code left entries without write permission."""
    def retry(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


def _wait(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``process`` to exit, at most ``timeout_s`` seconds; True if it did not.

    Sleeps on a pidfd where the kernel has them, so the server wakes as the runner exits: ``Popen.wait(timeout)``
    polls with sleeps growing to 50 ms, which cost about 30 ms a run here.
    """
    try:
        fd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        try:
            process.wait(timeout=timeout_s)
            return False
        except subprocess.TimeoutExpired:
            return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout_s * 1000):
            return True
    finally:
        os.close(fd)
    process.wait()
    return False


def run_sandboxed(
    files: Mapping[str, str],
    request: Mapping[str, Any],
    limits: SandboxLimits | None = None,
    policy: SandboxPolicy | None = None,
) -> SandboxResult:
    """Run ``request`` on a temporary copy of ``files`` in a contained child process; never raises for bad code.

    Args:
        files: workspace contents, relative path -> text (see `safe_relative_path`).
        request: ``{"mode": "tests"}`` (every ``test_*`` function of the workspace's ``test_*.py`` files),
            ``{"mode": "cases", "module": "solution", "function": "f", "cases": [[arg, ...], ...]}`` (call
            ``module.function(*args)`` per case; arguments must be JSON values), or ``{"mode": "probe"}``.
        limits: resource limits (default `SandboxLimits()`).
        policy: isolation layers to try (default `SandboxPolicy()`).

    Returns:
        The run's `SandboxResult`. The workspace is removed and every process of the run is killed before this
        returns.

    Raises:
        ValueError: for an unsafe or clashing path in ``files`` (`check_workspace`), before anything is written.
        OSError: if the temporary directory or the child process cannot be created.
    """
    limits = limits or SandboxLimits()
    policy = policy or SandboxPolicy()
    base = Path(tempfile.mkdtemp(prefix="coding-env-"))
    cgroups: list[tuple[str, Path]] = []
    uid = _UID_BASE + secrets.randbelow(1 << 30) if policy.drop_uid and os.geteuid() == 0 else None
    try:
        os.chmod(base, 0o711)  # the run's uid may enter (to reach its workspace) but not list
        workspace = base / "workspace"
        workspace.mkdir(mode=0o700)
        private = base / "io"
        private.mkdir(mode=0o700)  # request and output files: the child only gets their fds
        (base / "root").mkdir(mode=0o700)  # the mount point of the sandbox's own root (an empty tmpfs)
        _materialize(files, workspace, uid)
        cgroups = _make_cgroups(limits)
        config = {
            "workspace": str(workspace), "uid": uid, "namespaces": policy.namespaces, "root_dir": str(base / "root"),
            "max_inodes": limits.max_workspace_files, "cgroup_procs": [[n, str(c / "cgroup.procs")] for n, c in cgroups],
            "audit_hook": policy.audit_hook, "hide": list(policy.hide), "request": dict(request),
            **{k: v for k, v in asdict(limits).items() if k != "wall_time_s"},
        }
        config["request"].setdefault("per_test_timeout_s", limits.per_test_timeout_s)
        (private / "request.json").write_text(json.dumps(config))
        env = {"PATH": _CHILD_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "HOME": str(workspace),
               "TMPDIR": str(workspace)}
        started = time.monotonic()
        timed_out = False
        with open(private / "request.json", "rb") as stdin, open(private / "records", "wb") as stdout, \
                open(private / "output", "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-S", "-s", "-B", str(RUNNER)], stdin=stdin, stdout=stdout, stderr=stderr,
                cwd=str(base), env=env, start_new_session=True, close_fds=True,
            )
        try:
            timed_out = _wait(process, limits.wall_time_s)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # also whatever the run left in its group
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
            oom_killed = _remove_cgroups(cgroups)
            if uid is not None:
                _kill_uid(uid)
        wall_s = time.monotonic() - started
        records, malformed = _parse_records(private / "records", limits.max_file_mb << 20)
        tail = _read_tail(private / "output", _STDERR_TAIL_CHARS).replace(str(workspace) + "/", "./")
        iso = dict(next((r for r in records if r["type"] == "isolation"), {}))
        if iso:
            iso["memory"] = (f"cgroup: {limits.memory_mb + limits.disk_mb} MiB and {limits.max_processes + 2} "
                             "processes for the whole run" if iso.get("cgroups") else
                             f"per process only: {limits.memory_mb} MiB each, RLIMIT_NPROC {limits.max_processes}")
        return SandboxResult(
            records=records,
            exit_code=None if timed_out else (process.returncode if process.returncode >= 0
                                              else 128 - process.returncode),
            timed_out=timed_out,
            wall_s=wall_s,
            stderr_tail=tail,
            isolation={k: v for k, v in iso.items() if k not in ("type", "pid")},
            violations=[r for r in records if r["type"] == "violation"],
            malformed=malformed,
            oom_killed=oom_killed,
        )
    finally:
        _remove_cgroups(cgroups)  # a no-op when the run removed them
        _rmtree(base)


REQUIRED_LAYERS: dict[str, tuple[str, ...]] = {
    "network": ("namespace",), "processes": ("pid_namespace",), "ipc": ("namespace",), "filesystem": ("allowlist",),
    "proc": ("own",), "capabilities": ("none",), "no_new_privs": (True,),
}
"""The layers a sandbox needs to hold without the audit hook: `isolation` key -> accepted values (root and
unprivileged-with-user-namespaces give all of them; a memory cgroup is not required: without one the per-process
limits are the documented fallback)."""


def missing_layers(found: Mapping[str, Any]) -> list[str]:
    """The `REQUIRED_LAYERS` that ``found`` (an `isolation` result) lacks, as ``"key=value"``; ``[]`` when the
    sandbox isolates. A failed probe (``{"error": ...}``) lacks them all."""
    return [f"{key}={found.get(key, 'unknown')}" for key, accepted in REQUIRED_LAYERS.items()
            if found.get(key) not in accepted]


_ISOLATION: dict[SandboxPolicy, dict[str, Any]] = {}
_ISOLATION_LOCK = threading.Lock()


def isolation(policy: SandboxPolicy | None = None) -> dict[str, Any]:
    """The isolation layers a run gets on this machine under ``policy`` (probed once with an empty run, cached).

    Returns:
        ``{"mode": "root" | "user_namespace" | "none", "network": "namespace" | "audit_hook" | "none",
        "filesystem": "allowlist" | "read_only_except_workspace" | "audit_hook" | "none", "processes":
        "pid_namespace" | "process_group", "ipc" / "uts": "namespace" | "shared", "proc": "own" | "none" | "host",
        "uid": "fresh unprivileged uid per run" | "unchanged", "capabilities": "none" | a hex mask,
        "no_new_privs": bool, "disk": ..., "memory": ..., "cgroups": [...], "audit_hook": bool, "hidden_paths":
        [...], "visible_paths": [...], "notes": [...]}`` (see the module docstring); ``{"error": ...}`` when the
        probe itself failed. `missing_layers` says whether it isolates.
    """
    policy = policy or SandboxPolicy()
    with _ISOLATION_LOCK:
        if policy not in _ISOLATION:
            try:
                result = run_sandboxed({}, {"mode": "probe"}, SandboxLimits(wall_time_s=20.0), policy)
                found = dict(result.isolation) or {"error": f"probe ended with {result.exit_code}: "
                                                            f"{result.stderr_tail[-300:]}"}
            except OSError as exc:
                found = {"error": f"probe failed: {exc}"}
            if "uid" in found and found["uid"].startswith("unprivileged uid"):
                found["uid"] = "fresh unprivileged uid per run"
            _ISOLATION[policy] = found
            logger.debug("coding_env sandbox isolation: %s", found)
        return dict(_ISOLATION[policy])
