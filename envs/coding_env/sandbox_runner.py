"""Child side of the coding sandbox: isolate this process, drop privileges, then run the model's code.

Run by `envs.coding_env.sandbox` as ``python -S -s -B sandbox_runner.py`` with the request (JSON) on stdin, the
runner's stdout and stderr redirected to files the server opened, in a new session. Standard library only, and
nothing imported from this repository: the repository is hidden from the child once the sandbox is set up.

Order of operations (each step is best effort; what took effect is reported in the first record):

0. Join the run's cgroups when the server made them (``cgroup_procs``: total memory and process count).
1. ``unshare`` new network, mount, PID, IPC and UTS namespaces (as root; otherwise inside a new user namespace
   mapping uid 0 to the server's uid).
2. With a PID namespace: fork; the child is the namespace's init (PID 1). In the mount namespace it builds the
   sandbox's root (`_allowlist_root`): an empty tmpfs holding only the standard library and the system's shared
   libraries (read-only), a few devices, the workspace as a size-limited tmpfs, and the namespace's own read-only
   ``/proc``; then ``pivot_root`` and the host's root detached. (If that fails: the older read-only view of the
   host with the ``hide`` paths covered, `_filesystem`.) Host name ``sandbox``. Then it forks the runner, drops
   its own capabilities and only reaps; when it exits, the kernel kills every process left in the namespace, and
   the IPC namespace (SysV shared memory included) goes with the last of them.
3. The runner: resource limits (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``,
   ``RLIMIT_NOFILE``, ``RLIMIT_CORE``), no capabilities (`_drop_privileges`: bounding and ambient sets emptied,
   then a fresh unprivileged uid/gid when started as root, else locked secure bits and capset to zero),
   ``PR_SET_NO_NEW_PRIVS`` and ``PR_SET_PDEATHSIG``, ``cwd`` = the workspace, the ``isolation`` record (layers as
   measured: capabilities by capget), then an audit hook (PEP 578) that refuses sockets, process creation, ctypes,
   writes outside the workspace and reads of hidden paths, and reports each refusal as a ``violation`` record.
   The hook is a guard rail, not a boundary: every layer above holds with it switched off.
4. The request: ``tests`` (every ``test_*`` function of the workspace's ``test_*.py`` files) or ``cases`` (call one
   function of one module on each argument list and report its JSON-encoded result; the comparison with the
   expected value happens in the server, so the child never sees an expected output). Each test or case runs
   under a ``SIGALRM`` of ``per_test_timeout_s``; after the first one that times out, the rest are reported
   ``skipped`` without running (one endless loop costs one timeout, not one per test).

Records are JSON lines written to the original stdout (fd 1 at start); the code's own ``print`` output goes to
stderr. Record types: ``isolation``, ``start``, ``test``, ``case``, ``import_error``, ``violation``, ``done``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math  # an extension module where the interpreter has them: locates lib-dynload for _stdlib_dirs
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWUTS, CLONE_NEWIPC = 0x04000000, 0x08000000
MNT_DETACH = 2
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE, each locked: uid 0
# (inside a user namespace) gains no capabilities by execve, and nothing can turn that off again
_SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
O_PATH = getattr(os, "O_PATH", 0o10000000)

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_LIBC.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_OUT_FD = -1  # the records' fd, set in main()
_STATE = {"timed_out": False}  # after one test or case times out, the rest are skipped
_MAX_MESSAGE_CHARS = 400


class _TestTimeout(BaseException):
    """Raised by SIGALRM when one test or case runs past its limit (a BaseException: ``except Exception`` in the
    model's code does not swallow it)."""


def emit(record: dict) -> None:
    """Write one JSON record line to the records fd (``os.write``: no buffering, no audit event)."""
    data = (json.dumps({**record, "pid": os.getpid()}, default=repr) + "\n").encode()
    try:
        while data:
            data = data[os.write(_OUT_FD, data):]
    except OSError:  # records file over RLIMIT_FSIZE, or closed by the code: the server sees fewer records
        pass


def _errno_fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2); raises OSError."""
    enc = (lambda s: None if s is None else s.encode())
    if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise _errno_fail(f"mount {target}")


def _unshare(flags: int) -> bool:
    """unshare(2); True when it worked."""
    return _LIBC.unshare(flags) == 0


def _prctl(option: int, value: int) -> None:
    _LIBC.prctl(option, value, 0, 0, 0)


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


# ---------------------------------------------------------------------------------------------- isolation


def _namespaces(report: dict) -> dict[str, bool]:
    """Enter new network, mount, PID, IPC and UTS namespaces where allowed (inside a new user namespace when not
    root). Returns which of ``net``, ``mount``, ``pid``, ``ipc``, ``uts`` and ``user`` were entered."""
    wanted = {"net": CLONE_NEWNET, "mount": CLONE_NEWNS, "pid": CLONE_NEWPID, "ipc": CLONE_NEWIPC,
              "uts": CLONE_NEWUTS}
    every = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    got = dict.fromkeys(list(wanted) + ["user"], False)
    if os.geteuid() != 0:
        uid, gid = os.geteuid(), os.getegid()
        if _unshare(CLONE_NEWUSER | every):
            try:
                _write_file("/proc/self/setgroups", "deny")
                _write_file("/proc/self/uid_map", f"0 {uid} 1")
                _write_file("/proc/self/gid_map", f"0 {gid} 1")
                got = dict.fromkeys(got, True)
                report["notes"].append("namespaces inside a new user namespace (not root)")
            except OSError as exc:
                report["notes"].append(f"user namespace maps failed: {exc}")
        else:
            report["notes"].append(f"unshare(CLONE_NEWUSER) refused: {os.strerror(ctypes.get_errno())}")
    elif _unshare(every):
        got.update(dict.fromkeys(wanted, True))
    else:
        for name, flag in wanted.items():
            got[name] = _unshare(flag)
            if not got[name]:
                report["notes"].append(f"unshare({name}) refused: {os.strerror(ctypes.get_errno())}")
    return got


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount in this namespace, outermost first."""
    points = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].encode().decode("unicode_escape")  # \040 -> space
            try:
                st = os.statvfs(point)
            except OSError:
                continue
            keep = 0
            for st_flag, ms_flag in ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME),
                                     (2048, MS_NODIRATIME), (4096, MS_RELATIME)):
                if st.f_flag & st_flag:
                    keep |= ms_flag
            points.append((point, keep))
    return points


def _others_can_enter(path: str) -> bool:
    """Whether a uid with no special rights can traverse ``path`` (a directory)."""
    try:
        return bool(os.stat(path).st_mode & 0o001)
    except OSError:
        return False


def _expose(path: str, report: dict) -> None:
    """Make ``path`` reachable for any uid inside this mount namespace.

    For each ancestor A that others cannot traverse, cover A with a tmpfs (mode 0755; A's other entries vanish
    from view, which also hides them) and bind the next path component back into it.
    """
    parts = [p for p in os.path.realpath(path).split("/") if p]
    current = "/"
    for index, part in enumerate(parts):
        child = os.path.join(current, part)
        if not _others_can_enter(current):
            fd = os.open(child, O_PATH)
            try:
                _mount("tmpfs", current, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(child)
                else:
                    open(child, "w").close()
                _mount(f"/proc/self/fd/{fd}", child, None, MS_BIND | MS_REC)
            finally:
                os.close(fd)
            report["notes"].append(f"exposed {'/'.join(parts[:index + 1])} under a tmpfs over {current}")
        current = child


def _filesystem(workspace: str, hide: list[str], expose: list[str], report: dict) -> bool:
    """Inside a fresh mount namespace: every mount read-only but the workspace; ``hide`` covered. True if done."""
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _mount(workspace, workspace, None, MS_BIND)
        for path in expose:
            _expose(path, report)
        keep_visible = [workspace] + _stdlib_dirs()
        for path in hide:
            inside = [k for k in keep_visible if (k + "/").startswith(path.rstrip("/") + "/")]
            if inside:
                report["notes"].append(f"not hiding {path}: it holds {inside[0]}")
            elif os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
                report["hidden_paths"].append(path)
        failed = {}
        for point, keep in _mount_points():
            if point == workspace:
                continue
            try:
                _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
            except OSError as exc:
                failed[point] = exc.strerror
        if failed:
            report["notes"].append("could not remount read-only: " + ", ".join(f"{p} ({e})" for p, e in failed.items()))
        return "/" not in failed
    except OSError as exc:
        report["notes"].append(f"mount namespace setup failed: {exc}")
        return False


_LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")
"""Shared libraries an extension module of the standard library may load (read-only in the sandbox)."""
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def _allowlist(stdlib: list[str]) -> tuple[list[str], list[str]]:
    """(directories the sandbox sees read-only, directories inside them it must not see: other Pythons' packages)."""
    visible, covered = [], []
    for path in list(stdlib) + list(_LIBRARY_DIRS):
        if os.path.isdir(path) and not os.path.islink(path) and path not in visible:
            visible.append(path)
    for lib in [p for p in visible if p in _LIBRARY_DIRS]:
        covered += sorted(os.path.join(lib, n) for n in os.listdir(lib) if n.startswith("python"))
    covered += [os.path.join(d, "site-packages") for d in stdlib]
    return visible, [c for c in covered if os.path.isdir(c) and not any(
        (s + "/").startswith(c + "/") for s in stdlib)]


def _allowlist_root(cfg: dict, uid: int | None, own_proc: bool, report: dict) -> None:
    """Make an empty tmpfs the root of this mount namespace, holding only the allowlist; raises OSError.

    The new root holds: the standard library and the system's shared libraries (read-only bind mounts, with the
    site-packages and ``python*`` directories in them covered), a few character devices, the workspace as a fresh
    tmpfs of ``disk_mb`` MiB and ``max_inodes`` entries (the server's copy of the files written into it, owned by
    ``uid``) and, with a PID namespace (``own_proc``), the namespace's own read-only ``/proc``. Then ``pivot_root``
    and the old root detached: nothing else of the host (other checkouts, other runs, the server's files, host
    ``/proc``) is in this namespace any more, not even under a mount that could be unmounted.
    """
    if _SYS_PIVOT_ROOT is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    workspace, new = cfg["workspace"], cfg["root_dir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    visible, covered = _allowlist(_stdlib_dirs())
    keep = dict(_mount_points())
    for path in visible:
        target = new + path
        os.makedirs(target, exist_ok=True)
        _mount(path, target, None, MS_BIND | MS_REC)
        flags = next((f for p, f in sorted(keep.items(), key=lambda kv: -len(kv[0]))
                      if (path + "/").startswith(p.rstrip("/") + "/")), 0)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | flags)
    for path in covered:
        _mount("tmpfs", new + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    for link in _LIBRARY_DIRS:  # /lib -> usr/lib on merged-/usr systems
        if os.path.islink(link) and not os.path.lexists(new + link):
            os.symlink(os.readlink(link), new + link)
    os.makedirs(new + "/dev", exist_ok=True)
    for device in _DEVICES:
        if os.path.exists(device):
            open(new + device, "w").close()
            _mount(device, new + device, None, MS_BIND)
    files = {}
    for root, _dirs, names in os.walk(workspace):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                files[os.path.relpath(path, workspace)] = fh.read()
    target = new + workspace
    os.makedirs(target)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={int(cfg['disk_mb'])}m,nr_inodes={int(cfg['max_inodes'])},mode=0700{owner}")
    for rel, data in files.items():
        path = os.path.join(target, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    if uid is not None:
        for root, dirs, names in os.walk(target):
            for name in dirs + names:
                os.chown(os.path.join(root, name), uid, uid)
    os.makedirs(new + "/proc")
    if own_proc:  # before the old root goes: a user namespace may mount proc only while a full one is visible
        _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    os.chdir(new)
    if _LIBC.syscall(_SYS_PIVOT_ROOT, b".", b".") != 0:
        raise _errno_fail("pivot_root")
    if _LIBC.umount2(b".", MNT_DETACH) != 0:
        raise _errno_fail("umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    report["visible_paths"] = visible + ["the workspace"] + (["/proc"] if own_proc else [])
    report["hidden_paths"] = [h for h in cfg["hide"] if h]
    report["proc"] = "own" if own_proc else "none"
    report["disk"] = f"workspace tmpfs {int(cfg['disk_mb'])} MiB, {int(cfg['max_inodes'])} entries"


def _stdlib_dirs() -> list[str]:
    """Directories of the interpreter's standard library (what imports need to read)."""
    return sorted({os.path.dirname(os.__file__), os.path.dirname(getattr(math, "__file__", os.__file__))})


def _count_processes(uid: int) -> int:
    """Processes (tasks) of ``uid`` now, from /proc."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def _limits(cfg: dict, nproc: int) -> None:
    """Apply the resource limits of the request."""
    cpu = int(cfg["cpu_time_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL one second later
    memory = int(cfg["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(cfg["max_file_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(cfg["max_open_files"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _wait_status(status: int) -> int:
    """Exit code of a child's wait status, 128 + signal for a killed child."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# ---------------------------------------------------------------------------------------------- audit hook


_PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "subprocess.Popen", "pty.spawn", "os.startfile"}
_NETWORK_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                   "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.socketpair"}
_PATH_WRITE_EVENTS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                      "os.chown", "os.truncate", "os.utime", "os.mkfifo", "os.mknod", "shutil.rmtree",
                      "shutil.move", "shutil.copyfile", "shutil.copytree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _install_audit_hook(workspace: str, hidden: list[str]) -> None:
    """Refuse (PermissionError "sandbox: ...") what the model's code may not do, and report each refusal."""
    ws = workspace.rstrip("/") + "/"
    hidden_prefixes = [h.rstrip("/") + "/" for h in hidden]

    def resolve(path) -> str | None:
        if isinstance(path, int):
            return None
        try:
            return os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return "?"

    def outside(path) -> bool:
        real = resolve(path)
        return real is not None and not (real + "/").startswith(ws)

    def refuse(what: str, detail: str) -> None:
        emit({"type": "violation", "what": what, "detail": detail[:200]})
        raise PermissionError(f"sandbox: {detail}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            real = resolve(path)
            if real is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and outside(path):
                refuse("write", f"writing outside the workspace is not allowed: {path}")
            if any((real + "/").startswith(h) for h in hidden_prefixes):
                refuse("read", f"reading {path} is not allowed")
        elif event in _PATH_WRITE_EVENTS:
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
            if any(outside(p) for p in paths):
                refuse("write", f"{event} outside the workspace is not allowed: {paths[0]}")
        elif event in ("os.listdir", "os.scandir"):
            real = resolve(args[0] if args else ".")
            if real and any((real + "/").startswith(h) for h in hidden_prefixes):
                refuse("read", f"listing {args[0]} is not allowed")
        elif event in _NETWORK_EVENTS:
            refuse("network", "network access is disabled in the sandbox")
        elif event in _PROCESS_EVENTS:
            refuse("process", "starting processes is not allowed in the sandbox")
        elif event.startswith("ctypes."):
            refuse("ctypes", "ctypes is not allowed in the sandbox")

    sys.addaudithook(hook)


# ---------------------------------------------------------------------------------------------- running code


def _relative(filename: str, workspace: str) -> str | None:
    prefix = workspace.rstrip("/") + "/"
    real = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
    return real[len(prefix):] if real.startswith(prefix) else None


def _describe(exc: BaseException, workspace: str) -> dict:
    """Error type, message and the innermost workspace frame ("file:line" and its source line) of ``exc``."""
    info = {"error_type": type(exc).__name__, "message": "", "where": None, "line": None}
    try:
        text = str(exc)
    except Exception:  # a model-defined exception whose __str__ fails
        text = ""
    if isinstance(exc, SyntaxError):
        name = _relative(exc.filename or "", workspace) or exc.filename
        info["where"] = f"{name}:{exc.lineno}"
        info["line"] = (exc.text or "").strip()
        text = f"{exc.msg} ({name}, line {exc.lineno})"
    else:
        frames = traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__), lookup_lines=False)
        for frame in reversed(frames):  # source lines are read for workspace frames only
            name = _relative(frame.filename, workspace)
            if name is not None:
                info["where"] = f"{name}:{frame.lineno}"
                info["line"] = (frame.line or "").strip()
                break
    info["message"] = text.replace(workspace.rstrip("/") + "/", "")[:_MAX_MESSAGE_CHARS]  # no temp paths
    return info


def _alarm(_signum, _frame) -> None:
    raise _TestTimeout()


def _timed(fn, timeout_s: float, *args):
    """Call ``fn(*args)`` under a wall-clock alarm of ``timeout_s`` seconds."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _load(path: str, name: str, workspace: str, timeout_s: float):
    """Import the workspace file ``path`` as module ``name``; None (and an import_error record) on failure."""
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(workspace, path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        _timed(spec.loader.exec_module, timeout_s, module)
        return module
    except _TestTimeout:
        _STATE["timed_out"] = True
        emit({"type": "import_error", "file": path, "error_type": "Timeout",
              "message": f"importing {path} ran longer than {timeout_s:g} s", "where": None, "line": None})
    except BaseException as exc:  # noqa: BLE001 - the model's code may raise anything, SystemExit included
        emit({"type": "import_error", "file": path, **_describe(exc, workspace)})
    return None


def _run_tests(request: dict, workspace: str) -> None:
    timeout_s = float(request["per_test_timeout_s"])
    files = sorted(f for f in os.listdir(workspace) if f.startswith("test_") and f.endswith(".py"))
    for path in files:
        module = _load(path, path[:-3], workspace, timeout_s)
        if module is None:
            continue
        tests = [(n, f) for n, f in list(vars(module).items()) if n.startswith("test") and callable(f)]
        for name, fn in tests:
            full = f"{path[:-3]}::{name}"
            if _STATE["timed_out"]:  # one endless loop is enough: the rest are not run
                emit({"type": "test", "name": full, "status": "skipped", "message": "not run after a timeout"})
                continue
            emit({"type": "start", "name": full})
            try:
                _timed(fn, timeout_s)
                emit({"type": "test", "name": full, "status": "passed"})
            except _TestTimeout:
                _STATE["timed_out"] = True
                emit({"type": "test", "name": full, "status": "timeout",
                      "message": f"ran longer than {timeout_s:g} s"})
            except BaseException as exc:  # noqa: BLE001
                status = "failed" if isinstance(exc, AssertionError) else "error"
                emit({"type": "test", "name": full, "status": status, **_describe(exc, workspace)})


def _to_json(value) -> str:
    """JSON text of a result; sets become sorted lists (the server normalizes expected values the same way)."""
    def default(obj):
        if isinstance(obj, (set, frozenset)):
            try:
                return sorted(obj)
            except TypeError:
                return sorted(obj, key=repr)
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")
    return json.dumps(value, default=default, allow_nan=True)


def _run_cases(request: dict, workspace: str) -> None:
    timeout_s = float(request["per_test_timeout_s"])
    module = _load(request["module"] + ".py", request["module"], workspace, timeout_s)
    if module is None:
        return
    fn = getattr(module, request["function"], None)
    if not callable(fn):
        emit({"type": "import_error", "file": request["module"] + ".py", "error_type": "AttributeError",
              "message": f"{request['module']}.py defines no function {request['function']}", "where": None,
              "line": None})
        return
    for index, args in enumerate(request["cases"]):
        if _STATE["timed_out"]:
            emit({"type": "case", "index": index, "status": "skipped", "message": "not run after a timeout"})
            continue
        emit({"type": "start", "name": f"case {index}"})
        try:
            result = _timed(fn, timeout_s, *json.loads(json.dumps(args)))  # a fresh copy per case
            emit({"type": "case", "index": index, "status": "ok", "result": _to_json(result)})
        except _TestTimeout:
            _STATE["timed_out"] = True
            emit({"type": "case", "index": index, "status": "timeout", "message": f"ran longer than {timeout_s:g} s"})
        except BaseException as exc:  # noqa: BLE001
            emit({"type": "case", "index": index, "status": "error", **_describe(exc, workspace)})


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capabilities() -> int | None:
    """This process's effective and permitted capabilities (one bit mask, 0 = none); None when capget fails."""
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _LIBC.capget(ctypes.byref(header), data) != 0:
        return None
    return (data[0].effective | data[0].permitted) | (data[1].effective | data[1].permitted) << 32


def _drop_privileges(uid: int | None, report: dict) -> None:
    """No capabilities from here on, whatever the audit hook does: empty bounding and ambient sets, locked secure
    bits (uid 0 of a user namespace gains nothing by execve), every capability cleared (by the uid change when
    root gave a fresh ``uid``, else by capset), then ``no_new_privs``. Records ``capabilities`` and
    ``no_new_privs`` as measured afterwards."""
    if uid is None:
        _prctl(PR_SET_SECUREBITS, _SECUREBITS)  # needs CAP_SETPCAP: before the bounding set loses it
    for cap in range(64):
        if _LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    _LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from root to a uid that is not 0: the kernel clears every capability
    else:
        header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
        if _LIBC.capset(ctypes.byref(header), data) != 0:
            report["notes"].append(f"capset failed: {os.strerror(ctypes.get_errno())}")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    caps = _capabilities()
    report["capabilities"] = "unknown" if caps is None else ("none" if caps == 0 else f"{caps:#x}")
    report["no_new_privs"] = _LIBC.prctl(39, 0, 0, 0, 0) == 1  # PR_GET_NO_NEW_PRIVS


def _runner(cfg: dict, report: dict, uid: int | None, own_processes: int) -> None:
    """The process that runs the model's code: limits, privileges, hook, request. Never returns.

    ``own_processes``: processes the server's (non-root) user already has; RLIMIT_NPROC counts them too.
    """
    workspace = cfg["workspace"]
    _limits(cfg, int(cfg["max_processes"]) + own_processes)
    _drop_privileges(uid, report)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid: a credential change clears it
    os.chdir(workspace)
    sys.path[:] = [workspace] + _stdlib_paths
    signal.signal(signal.SIGALRM, _alarm)
    emit({"type": "isolation", **report})
    if cfg["audit_hook"]:
        _install_audit_hook(workspace, report["hidden_paths"] or cfg["hide"])
    os.dup2(2, 1)  # the code's print() output goes to the stderr file, not into the records
    request = cfg["request"]
    if request["mode"] == "tests":
        _run_tests(request, workspace)
    elif request["mode"] == "cases":
        _run_cases(request, workspace)
    emit({"type": "done"})
    sys.stderr.flush()
    os._exit(0)


_stdlib_paths = [p for p in sys.path if p and os.path.realpath(p) != os.path.dirname(os.path.realpath(__file__))]


def _join_cgroups(cgroups: list[list[str]], report: dict) -> None:
    """Move this process (and so every process it starts) into the run's cgroups (``[hierarchy, cgroup.procs
    file]`` pairs: the cgroups the server created with the run's memory and process limits)."""
    for name, path in cgroups:
        try:
            _write_file(path, str(os.getpid()))
        except OSError as exc:
            report["notes"].append(f"could not join cgroup {os.path.dirname(path)}: {exc.strerror}")
            continue
        report["cgroups"].append(name)


def _isolate(cfg: dict, report: dict, spaces: dict, uid: int | None, own_proc: bool) -> None:
    """The filesystem view and host name, inside the new namespaces (run by the PID namespace's init when there is
    one, so that its ``/proc`` is the namespace's own)."""
    workspace = cfg["workspace"]
    if spaces["mount"]:
        try:
            _allowlist_root(cfg, uid, own_proc, report)
            report["filesystem"] = "allowlist"
        except OSError as exc:
            report["notes"].append(f"allowlist root failed ({exc}); read-only host view instead")
            expose = _stdlib_dirs() if uid is not None else []
            if _filesystem(workspace, [h for h in cfg["hide"] if h], expose, report):
                report["filesystem"] = "read_only_except_workspace"
    if spaces["uts"]:
        name = b"sandbox"
        if _LIBC.sethostname(name, len(name)) == 0:
            report["uts"] = "namespace"


def main() -> None:
    """Read the request from stdin, isolate, run it. Exit status: the runner's (128 + signal when killed)."""
    global _OUT_FD
    cfg = json.load(sys.stdin)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the request file is not the code's to read
    os.close(null)
    _OUT_FD = os.dup(1)
    os.set_inheritable(_OUT_FD, False)
    workspace = os.path.realpath(cfg["workspace"])
    cfg["workspace"] = workspace
    report = {"mode": "none", "network": "none", "filesystem": "none", "processes": "process_group",
              "uid": "unchanged", "audit_hook": bool(cfg["audit_hook"]), "hidden_paths": [], "notes": [],
              "ipc": "shared", "uts": "shared", "proc": "host", "capabilities": "unknown", "no_new_privs": False,
              "disk": "per-file limit only", "cgroups": []}
    root = os.geteuid() == 0  # before a user namespace makes every uid look like 0
    _join_cgroups(cfg.get("cgroup_procs") or [], report)
    own_processes = 0 if root else _count_processes(os.geteuid())
    spaces = dict.fromkeys(("net", "mount", "pid", "ipc", "uts", "user"), False)
    if cfg["namespaces"]:
        spaces = _namespaces(report)
    uid = cfg["uid"] if cfg["uid"] is not None and root else None
    if uid is not None and not spaces["mount"] and not all(_others_can_enter(d) for d in _stdlib_dirs()):
        report["notes"].append("standard library not readable by other uids and no mount namespace: "
                               "kept the server's uid")
        uid = None
    if spaces["net"]:
        report["network"] = "namespace"
    if spaces["ipc"]:
        report["ipc"] = "namespace"
    if uid is not None:
        report["uid"] = f"unprivileged uid {uid}"
    if spaces["net"] and spaces["mount"] and spaces["pid"]:
        report["mode"] = "root" if root else "user_namespace"
    if spaces["pid"]:
        report["processes"] = "pid_namespace"
        child = os.fork()
        if child:  # outside the namespace: wait for its init and pass its status on
            _, status = os.waitpid(child, 0)
            os._exit(_wait_status(status))
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _isolate(cfg, report, spaces, uid, own_proc=spaces["pid"])
    if cfg["audit_hook"]:
        if report["network"] == "none":
            report["network"] = "audit_hook"
        if report["filesystem"] == "none":
            report["filesystem"] = "audit_hook"
    if spaces["pid"]:
        runner = os.fork()
        if runner:  # PID 1 of the namespace: reap until the runner ends; the kernel then kills the rest
            _drop_privileges(None, {"notes": []})  # it only reaps: no capability left for the code to borrow
            while True:
                try:
                    done, status = os.wait()
                except ChildProcessError:
                    os._exit(1)
                if done == runner:
                    os._exit(_wait_status(status))
    _runner(cfg, report, uid, own_processes)


if __name__ == "__main__":
    main()
