"""Process plumbing shared by the node and the coordinator: logging with the peer name, graceful stop.

SIGINT/SIGTERM set `GracefulStop.event`; the training loop and the round barrier poll it and leave at the next
safe point. If the process has not exited ``hard_exit_after_s`` seconds later, the registered cleanups (env
servers, averager, DHT) run and the process exits with code 130, so Ctrl+C always returns within ~10 s.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.logging import RichHandler

log = logging.getLogger(__name__)


def setup_logging(peer_name: str, verbose: bool) -> None:
    """Log lines to stderr carrying the peer name; ``verbose`` adds DEBUG and hivemind's INFO."""
    level = logging.DEBUG if verbose else logging.INFO
    handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=False, markup=False, log_time_format="%H:%M:%S")
    handler.setFormatter(logging.Formatter(f"[{peer_name}] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("hivemind", "httpx", "websockets", "urllib3", "transformers", "datasets", "uvicorn"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.WARNING)
    # hivemind installs its own handler on its loggers; send its records through ours instead.
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Restore this process's SIGINT/SIGTERM handlers after the block.

    hivemind's ``DHT`` and ``DecentralizedAverager`` set SIGINT to SIG_IGN in the *parent* before forking their
    background process (so the child ignores Ctrl+C) and never restore it, which leaves the parent deaf to
    Ctrl+C. Wrap every hivemind start in this.
    """
    in_main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


class GracefulStop:
    """Turns SIGINT/SIGTERM into a stop request, with a hard exit as a backstop.

    Args:
        hard_exit_after_s: seconds after the first signal before cleanups run and the process exits (130).
    """

    def __init__(self, hard_exit_after_s: float = 8.0):
        self.event = threading.Event()
        self.hard_exit_after_s = hard_exit_after_s
        self._cleanups: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def install(self) -> GracefulStop:
        """Install the signal handlers (main thread only)."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Register a cleanup that the hard exit runs (and `run_cleanups` runs on normal exit), last first."""
        self._cleanups.append(fn)

    def run_cleanups(self) -> None:
        """Run every registered cleanup once, most recent first; exceptions are logged, not raised."""
        with self._lock:
            cleanups, self._cleanups = self._cleanups[::-1], []
        for fn in cleanups:
            try:
                fn()
            except Exception as e:
                log.debug("cleanup %r failed: %r", fn, e)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.event.is_set():
            return
        log.info("received %s: stopping (hard exit in %.0f s)", signal.Signals(signum).name, self.hard_exit_after_s)
        self.event.set()
        timer = threading.Timer(self.hard_exit_after_s, self._hard_exit)
        timer.daemon = True
        timer.start()

    def _hard_exit(self) -> None:
        log.warning("did not stop in time: forcing exit")
        cleaner = threading.Thread(target=self.run_cleanups, daemon=True)
        cleaner.start()
        cleaner.join(timeout=1.5)  # a hanging cleanup must not keep the process alive
        sys.stderr.flush()
        os._exit(130)


def run_cli(app: Callable[[], object]) -> int:
    """Run a typer app as a console script and return its exit code (typer exits by raising SystemExit).

    First arms the fault-injection plan of ``COMPOSER_DILOCO_FAULTS`` (tests only; `composer_diloco.faults`): the
    one place a process reads it, before any hivemind process is forked.
    """
    from composer_diloco import faults

    try:
        faults.install_from_environment()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        app()
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        # Every cleanup has run. The interpreter's last garbage collections walk every object torch, transformers
        # and hivemind created (~2.5 s per process on a 2-core CPU): frozen objects are skipped; atexit still runs.
        gc.freeze()
    return 0
