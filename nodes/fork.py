"""A node's life forked from its warm standby: a new OS process that shares the standby's imports and policy skeleton
instead of paying them again (`nodes.standby.Standby.run_lives`).

`fork_life` is ``os.fork`` plus what a fresh interpreter would have had and a fork of a busy one has not:
- its own session (process group), so the life's crash or a kill of its group leaves the standby standing;
- hivemind's process-wide multiprocessing locks of its own (`own_process_locks`): made once at the standby's import,
  they would otherwise be one semaphore shared by every life, and a life SIGKILLed while it held one (a pipe write of
  an `MPFuture` update) would leave every later life's DHT start waiting on it forever (the test suite met exactly
  this with its own process template, `tests/prefork.py`);
- numpy's global generator seeded from the OS, and torch's intra-op threads back to the standby's start count (the
  standby keeps torch at one thread, `single_threaded_torch`: GNU OpenMP's worker pool does not survive a fork, and a
  child forked after a parallel region hangs in its first one; checked on torch 2.13's CPU build; tqdm's monitor
  thread is kept from starting the same way);
- on return, the exit of an interpreter: non-daemon threads joined, ``atexit`` run, streams flushed, then
  ``os._exit`` (the standby's own ``finally`` blocks and cleanups are not the life's to run).

`fork_unsafe` says when a fork must not be tried: CUDA already initialized in the standby (a CUDA context does not
survive a fork; the standby keeps its skeleton on the CPU, so this means some library touched the device), or other
Python threads running (a fork copies only the calling thread, and a lock one of them held stays taken in the child).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

__all__ = ["exit_as_interpreter", "fork_life", "fork_unsafe", "own_process_locks", "single_threaded_torch"]


def own_process_locks() -> None:
    """Give this forked process hivemind's process-wide locks of its own, as a fresh interpreter makes them at import.

    hivemind keeps multiprocessing locks at class level (`MPFuture`'s update and initialization locks, `SharedBytes`',
    `_AsyncContextWrapper`'s executor lock), made once when the parent imported it: every process forked from that
    parent would share one semaphore with every other. A process SIGKILLed while it held one left it taken for good,
    and every later DHT start stood in ``_send_update`` forever. hivemind's own `MPFuture.reset_backend` makes the
    first three anew."""
    import multiprocessing as mp

    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


def single_threaded_torch() -> int:
    """Set torch's intra-op threads to 1 in this process (a standby, before it builds anything) and return the count
    it had, which `fork_life` gives each forked life back. Also keeps tqdm from starting its monitor thread: a
    ``--model``'s ``from_pretrained`` shows a progress bar, and the thread that bar starts (``tqdm_monitor``) would
    otherwise make every fork unsafe (`fork_unsafe`; seen with a standby of a ``--model`` run)."""
    import torch
    import tqdm

    tqdm.tqdm.monitor_interval = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def fork_unsafe() -> str | None:
    """Why this process must not fork a life now, or None when it may: CUDA initialized here, or other threads alive
    (their names)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized in the standby's process"
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    if others:
        return f"threads are running in the standby's process ({', '.join(sorted(others))})"
    return None


def fork_life(life: Callable[[], int], torch_threads: int) -> int:
    """Fork a process that runs ``life()`` and exits with the code it returns (module docstring); returns its pid.

    Args:
        life: what the child runs; its return value is the exit code (an exception: its traceback, exit 1).
        torch_threads: torch's intra-op threads in the child (`single_threaded_torch`'s return value).
    Raises:
        OSError: the fork failed (no memory, a process limit).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        own_process_locks()
        import numpy
        import torch

        numpy.random.seed()  # a fresh interpreter seeds numpy's global generator from the OS; a fork copies it
        torch.set_num_threads(torch_threads)
        code = life()
    except SystemExit as exit_:  # as the interpreter: an int is the code, None is 0, anything else is printed, 1
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: its traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        exit_as_interpreter(code)
    raise AssertionError("unreachable")  # exit_as_interpreter never returns


def exit_as_interpreter(code: int) -> None:
    """End this (forked) process as an interpreter ends: wait for non-daemon threads, run ``atexit``, flush the
    streams, then ``os._exit(code)``. Never returns."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's own exit calls first
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing left to say
                pass
        os._exit(code)
