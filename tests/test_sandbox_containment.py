"""The model's code attacks the coding sandbox with the audit hook off, in every deployment mode this machine allows
(``root``, ``non_root``: see ``tests/sandbox_modes.py``). Each test fails while its hole is open (checked against the
sandbox before issue 14: capabilities kept in the user namespace, host /proc, shared SysV IPC, per-file quotas)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from envs.coding_env.sandbox import PROJECT_ROOT, SandboxLimits
from envs.coding_env.tasks import TASKS_FILE
from tests.sandbox_modes import MODES, NOBODY, attack_run, case_result, mode_skip_reason, run_in_mode, \
    world_readable_copy

LIMITS = SandboxLimits(wall_time_s=8.0, cpu_time_s=4, per_test_timeout_s=4.0, memory_mb=256, disk_mb=4,
                       max_workspace_files=256)

PRELUDE = """
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

def err(ret):
    return "ok" if ret == 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

def oserr(fn, *args):
    try:
        fn(*args)
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
"""

MOUNTS = PRELUDE + """
MS_REMOUNT, MS_BIND, MNT_DETACH = 32, 4096, 2

def attack():
    ws = os.getcwd().encode()
    out = {
        "umount_root": err(libc.umount2(b"/", MNT_DETACH)),
        "umount_workspace": err(libc.umount2(ws, MNT_DETACH)),
        "umount_proc": err(libc.umount2(b"/proc", MNT_DETACH)),
        "remount_root_rw": err(libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None)),
        "remount_lib_rw": err(libc.mount(None, b"/usr/lib", None, MS_REMOUNT | MS_BIND, None)),
        "mount_tmpfs_over_usr": err(libc.mount(b"tmpfs", b"/usr", b"tmpfs", 0, None)),
    }
    # a user namespace of its own gives capabilities again, over copies of these mounts that the kernel locks
    out["unshare_user_mount"] = err(libc.unshare(0x10000000 | 0x00020000))
    out["nested_umount_lib"] = err(libc.umount2(b"/usr/lib", MNT_DETACH))
    out["nested_remount_lib_rw"] = err(libc.mount(None, b"/usr/lib", None, MS_REMOUNT | MS_BIND, None))
    out["write_lib"] = oserr(lambda: open("/usr/lib/pwned", "w"))
    out["write_root"] = oserr(lambda: open("/pwned", "w"))
    out["project_visible"] = os.path.exists(PROJECT)
    return out
"""

CAPABILITIES = PRELUDE + """
def attack():
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)(*([0xFFFFFFFF] * 6))
    out = {k: status[k].strip() for k in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb", "NoNewPrivs")}
    out["capset_all"] = err(libc.capset(header, data))
    out["uid"] = os.getuid()
    return out
"""

VIEW = PRELUDE + """
def attack():
    out = {"hostname": os.uname().nodename, "root": sorted(os.listdir("/")),
           "proc_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
    for name, path in PATHS.items():
        try:
            with open(path, "rb") as fh:
                fh.read(64)
            out[name] = "read"
        except OSError as exc:
            out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
    return out
"""

SHM = PRELUDE + """
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]

def attack():
    shmid = libc.shmget(KEY, 32 << 20, 0o1000 | 0o666)  # IPC_CREAT: 32 MiB that would outlive the run
    if shmid < 0:
        return {"shmget": err(-1)}
    address = libc.shmat(shmid, None, 0)
    ctypes.memset(address, 0x41, 1 << 20)
    return {"shmget": "ok", "found_again": libc.shmget(KEY, 0, 0) == shmid}
"""

SHM_LOOKUP = PRELUDE + """
def attack():
    return err(0 if libc.shmget(KEY, 0, 0) >= 0 else -1)
"""

DISK = PRELUDE + """
def attack():
    chunk, written, out = b"x" * 65536, 0, {}
    try:
        for index in range(100000):  # 6 GiB if nothing stops it
            with open(f"big{index}", "wb") as fh:
                fh.write(chunk)
            written += len(chunk)
    except OSError as exc:
        out["big_error"] = errno.errorcode.get(exc.errno, str(exc.errno))
    created = 0
    try:
        for index in range(100000):
            open(f"e{index}", "w").close()
            created += 1
    except OSError as exc:
        out["small_error"] = errno.errorcode.get(exc.errno, str(exc.errno))
    out.update(written=written, created=created)
    return out
"""

MEMORY = PRELUDE + """
import time

def attack():
    children = []
    for _ in range(4):  # 4 x 200 MiB, each under the per-process limit of 256 MiB
        pid = os.fork()
        if pid == 0:
            data = b"x" * (200 << 20)
            time.sleep(1.0)
            os._exit(0)
        children.append(pid)
    killed = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        killed += os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    return {"killed": killed}
"""


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    """Each deployment mode this machine allows; a mode it does not is skipped with the reason."""
    reason = mode_skip_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    return request.param


def test_layers_are_reported_per_mode(mode):
    iso = run_in_mode(mode, {"probe": ({}, {"mode": "probe"})}, LIMITS)["probe"]["isolation"]
    assert iso["mode"] == ("root" if mode == "root" else "user_namespace"), iso
    assert (iso["network"], iso["processes"], iso["ipc"], iso["uts"], iso["proc"]) == (
        "namespace", "pid_namespace", "namespace", "namespace", "own"), iso
    assert iso["filesystem"] == "allowlist" and iso["capabilities"] == "none" and iso["no_new_privs"] is True, iso
    assert iso["disk"].startswith("workspace tmpfs 4 MiB")
    if mode == "root":
        assert iso["uid"].startswith("unprivileged uid") and iso["cgroups"], iso
    else:  # documented fallback: no cgroup for a non-root launcher
        assert iso["cgroups"] == [] and iso["memory"].startswith("per process only"), iso


def test_mount_attacks_fail_and_reveal_nothing(mode):
    code = MOUNTS.replace("PROJECT", repr(str(PROJECT_ROOT)))
    out = case_result(run_in_mode(mode, {"mounts": attack_run(code)}, LIMITS)["mounts"])
    for name in ("umount_root", "umount_workspace", "umount_proc", "remount_root_rw", "remount_lib_rw",
                 "mount_tmpfs_over_usr"):
        assert out[name] == "EPERM", (name, out)
    # Inside a user namespace of its own the code may try again: the copied mounts are locked
    if out["unshare_user_mount"] == "ok":
        assert out["nested_umount_lib"] in ("EINVAL", "EPERM"), out
        assert out["nested_remount_lib_rw"] in ("EPERM", "EINVAL"), out
    assert out["write_lib"] in ("EROFS", "EACCES") and out["write_root"] in ("EROFS", "EACCES"), out
    assert out["project_visible"] is False


def test_no_capabilities_and_capset_is_refused(mode):
    out = case_result(run_in_mode(mode, {"caps": attack_run(CAPABILITIES)}, LIMITS)["caps"])
    assert [out[k] for k in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb")] == ["0" * 16] * 5, out
    assert out["NoNewPrivs"] == "1" and out["capset_all"] == "EPERM", out
    assert out["uid"] != 0 if mode == "root" else True


def test_the_host_is_not_in_view(mode, tmp_path_factory):
    """A world-readable reference solution elsewhere, another session's workspace, the server's /proc entry."""
    base = Path("/tmp") / f"coding-env-other-{secrets.token_hex(4)}"
    try:
        leak = world_readable_copy(TASKS_FILE, base / "checkout" / "envs" / "coding_env")
        other = world_readable_copy(TASKS_FILE, base / "workspace")
        if mode == "non_root":
            for path in (base, base / "workspace", other):
                os.chown(path, NOBODY, NOBODY)
        paths = {"reference_copy": str(leak), "other_workspace": str(other), "project_tasks": str(TASKS_FILE),
                 "server_cmdline": f"/proc/{os.getpid()}/cmdline", "host_passwd": "/etc/passwd"}
        # package data next to the interpreter (e.g. a pip-installed copy of this project with its tasks)
        purelib = Path(sysconfig.get_paths()["purelib"])
        base_lib = Path(sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"])
        for name, directory in (("server_site_packages", purelib), ("stdlib_site_packages", base_lib)):
            files = sorted(p for p in directory.glob("*") if p.is_file())[:1] if directory.is_dir() else []
            if files:
                paths[name] = str(files[0])
        code = VIEW.replace("PATHS.items()", f"{paths!r}.items()")
        out = case_result(run_in_mode(mode, {"view": attack_run(code)}, LIMITS)["view"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name in paths:
        assert out[name] == "ENOENT", (name, out)
    assert out["hostname"] == "sandbox" and max(out["proc_pids"]) < 16, out
    assert set(out["root"]) <= {"dev", "lib", "lib64", "proc", "root", "tmp", "usr"}, out


def test_sysv_shared_memory_is_gone_after_the_run(mode):
    key = 0x5A000000 + secrets.randbelow(1 << 20)
    code = SHM.replace("KEY", str(key))
    lookup = SHM_LOOKUP.replace("KEY", str(key))
    out = run_in_mode(mode, {"create": attack_run(code), "lookup": attack_run(lookup)}, LIMITS)
    assert case_result(out["create"]) == {"shmget": "ok", "found_again": True}
    assert case_result(out["lookup"]) == "ENOENT"  # a later run does not find it
    with open("/proc/sysvipc/shm") as fh:  # nor does the host
        keys = [int(line.split()[0]) for line in fh.read().splitlines()[1:] if line.strip()]
    assert key not in keys


def test_the_workspace_has_a_total_disk_quota(mode):
    out = case_result(run_in_mode(mode, {"disk": attack_run(DISK)}, LIMITS)["disk"])
    assert out["big_error"] == "ENOSPC" and out["written"] <= LIMITS.disk_mb << 20, out
    assert out["small_error"] == "ENOSPC" and out["created"] <= LIMITS.max_workspace_files, out


def test_total_memory_of_all_processes_is_bounded_with_a_cgroup(mode):
    if mode != "root":
        pytest.skip("non_root: no cgroup for an unprivileged launcher; the documented fallback is RLIMIT_AS per "
                    "process times RLIMIT_NPROC")
    result = run_in_mode(mode, {"memory": attack_run(MEMORY)}, LIMITS)["memory"]
    cases = [r for r in result["records"] if r["type"] == "case"]
    if cases and cases[0]["status"] == "ok":  # the OOM killer took children (the runner may survive)
        assert json.loads(cases[0]["result"])["killed"] >= 2, cases
    assert result["oom_killed"] is True, result["isolation"].get("memory")


def _serve_until(argv: list[str], pattern: str, timeout_s: float = 40.0) -> tuple[int | None, str]:
    """Start a coding-env server command; return (exit code or None if still running, its log) once its log shows
    ``pattern`` or it exits. The process is stopped in ``finally``."""
    import subprocess
    import time

    # its own process group: the nobody launcher forks the server, so ending the launcher alone leaked the server
    proc = subprocess.Popen(argv, cwd=str(PROJECT_ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    log = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                return proc.returncode, "".join(log)
            log.append(line)
            if pattern in line:
                if "refusing" in pattern:  # a server that refuses exits right after its log line
                    proc.wait(timeout=20)
                    log.append(proc.stdout.read())
                else:
                    time.sleep(0.5)
                return proc.poll(), "".join(log)
        raise AssertionError(f"no {pattern!r} within {timeout_s} s: {''.join(log)[-1500:]}")
    finally:
        import signal

        for sig in (signal.SIGTERM, signal.SIGKILL):  # the whole group: the launcher and the server it forked
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                time.sleep(0.5)  # the forked server's own exit after the TERM
            except subprocess.TimeoutExpired:
                continue
        proc.wait()


SERVE = ["-m", "envs.coding_env.server", "--port", "0", "--log-level", "info"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_server_logs_its_layers_and_refuses_a_mode_that_cannot_isolate():
    import sys

    from tests.sandbox_modes import as_nobody

    if os.geteuid() != 0:
        pytest.skip("needs root to set up the modes")
    code, log = _serve_until([sys.executable] + SERVE, "coding_env sandbox: mode")
    assert code is None and "coding_env sandbox: mode root" in log, log[-1500:]
    # (nobody with user namespaces gets mode user_namespace: test_layers_are_reported_per_mode; a server start
    # costs ~5-15 s of imports here, so it is not started a fourth time)
    weak = as_nobody([sys.executable] + SERVE, user_namespaces=False)  # unprivileged, no user namespaces
    code, log = _serve_until(weak, "refusing to serve")
    assert code == 2 and "mode none" in log and "network=audit_hook" in log, log[-1500:]
    allowed = as_nobody([sys.executable] + SERVE + ["--allow-weak-sandbox"], user_namespaces=False)
    code, log = _serve_until(allowed, "serving because of --allow-weak-sandbox")
    assert code is None, log[-1500:]


DISABLE_HOOK = """
import gc

def _disable_the_audit_hook():  # what a policy learns to do: the hook's closure cell 'refuse' becomes a no-op
    for obj in gc.get_objects():
        if getattr(obj, "__name__", None) == "hook" and "sandbox_runner" in getattr(
                getattr(obj, "__code__", None), "co_filename", ""):
            names = obj.__code__.co_freevars
            obj.__closure__[names.index("refuse")].cell_contents = lambda what, detail: None
            return True
    return False

HOOK_DISABLED = _disable_the_audit_hook()
"""


def test_with_the_default_policy_the_code_disables_the_hook_and_is_still_contained():
    """The real configuration (audit hook on): the code switches the hook off, then attacks."""
    from dataclasses import asdict

    from envs.coding_env.sandbox import run_sandboxed

    code = DISABLE_HOOK + MOUNTS.replace("PROJECT", repr(str(PROJECT_ROOT))).replace(
        "    out[\"project_visible\"]", "    out[\"hook_disabled\"] = HOOK_DISABLED\n    out[\"project_visible\"]")
    out = case_result(asdict(run_sandboxed(*attack_run(code), LIMITS)))
    assert out["hook_disabled"] is True, out  # ctypes (refused by the hook) ran: the hook is no boundary
    assert out["remount_root_rw"] == "EPERM" and out["umount_workspace"] == "EPERM", out
    assert out["write_root"] in ("EROFS", "EACCES") and out["project_visible"] is False, out
