"""A node's warm standby (`composer-node join --standby`): a second process for the same ``--run-dir`` and ``--name``
that does the slow part of a node's start ahead of time and, each time the node's process ends, starts its next life
at once, forked from itself (`Standby.run_lives`).

A node restarted after a crash pays its whole start again before its next inner step: the imports (torch,
transformers, TRL, peft, hivemind, and OpenEnv's server stack, which the memory plan reads the env package's
demonstrations through: 7-10 s on a 2-core CPU box), its env server's start, and its policy's build (at real size,
the base model read from disk). A standby pays them while the node still trains, then waits for the node's folder lock
(``<run-dir>/<name>/node.lock``: the OS drops it when the process holding it ends, SIGKILL and an OOM kill included).
Once it holds it, it forks the node's next life (`nodes.fork.fork_life`), which joins the run as that node
(`nodes.node.Node.join`: the same identity key, so the same peer ID, and the peers its last life saw) with the lock
handed to it: what is left is the DHT join, the run config, the state download and the wait for the round boundary.
The standby itself goes on standing by: once the new life trains (its first inner phase began: `TRAINING_FILE`) it
launches the next life's env server, and it waits for the lock again, so a second crash finds it as prepared as the
first did. (A crash before that finds all but the env server prepared: that life starts its own. Launched at the fork,
the server's start took its CPU from the takeover it followed, on a loaded box: BENCHMARKS.md 3r.) (Until 2026-12-06 the standby became
the node, and a new standby had to be started after each takeover: its imports and preparation took 25-40 s of a core
on a loaded 2-core box, beside the nodes' training, and a kill in that window found nothing prepared: BENCHMARKS.md
3p.)

What it prepares (`Standby.wait`), in order:

1. every module of ``composer_diloco`` (the join and the round import most of theirs lazily);
2. from the run config the node last joined with (`RUN_CONFIG_FILE`, which `Node` writes at each join), once the
   life that joined with it trains (`TRAINING_FILE`, which `Node` writes at its first inner phase) or
   `PREPARE_AFTER_S` after that join, not beside the join (on a loaded box the preparation took its CPU from the
   node's first start: BENCHMARKS.md 3s): the memory plan's inputs (the tokenizer and the env package's
   demonstrations), this node's own env server (not with ``--env-url``) and the policy's skeleton
   (`composer_diloco.policy.load.policy_skeleton`: the architecture, and with ``[lora]`` or ``--model`` the base
   weights, on the CPU). At takeover the server and the skeleton are used when the run's published config has the
   same digest, and stopped / dropped otherwise (`Prepared.for_config`). A forked life gets the skeleton as a
   copy-on-write copy of the standby's and the env server lent
   (`composer_diloco.rollout.env_process.BorrowedEnvServer`: the standby stops it when the life ended); the standby
   keeps its own skeleton and launches a new env server for the life after. A life that ends before the standby
   prepared is forked with nothing prepared: it builds what it needs itself, as a restarted node does.

With ``--with-standby`` (``first_life_lock``) one command starts both: the process takes the node's folder first
thing, as a node does, imports, and forks the node's first life at once (`wait` returns that lock first), then stands
by it. The first life shares the standby's imports instead of paying its own beside them: on a box where the run's
nodes start together, each node's start competes with half as many imports (BENCHMARKS.md 3t).

Otherwise a standby takes the lock only once it has seen it held (the node it stands by was running; looked at first before its
imports, `StandbyStart`), or after ``--join-timeout`` seconds without ever seeing it held (no node runs under that
name: it starts the node itself), so a job script may start the node and its standby together: the node takes its
folder first thing, before its imports (`nodes.folder_lock`), so however slow those are its standby sees it held. It
exits 0 when the node finished its run (`FINISHED_FILE`: written after the standby started, or at any time when it
never saw the node running), 1 when the node finished it with an error (trained on nothing) or after
`MAX_FAILED_LIVES` lives in a row failed before any round; SIGINT or SIGTERM: 130, after stopping the life it forked. Each life it forks is the leader of its own process group and writes its pid
in ``<run-dir>/<name>/node.pid`` (`nodes.folder_lock.HOLDER_FILE`). Its cost: host memory (the imports, about 0.5 GB
on CPU, and the skeleton: the model's size, shared copy-on-write with the life it forked), one idle env server
process, no device memory, and CPU only while preparing.

Fault model: a standby outlives the node's *process* (an exception, an OOM kill, a CUDA error, SIGKILL), not its
machine: run it on the same machine, beside the node, under its own supervisor (a systemd unit or job script that
restarts it if it dies). Under systemd the node's first process and the standby are two units; every later life of
the node runs in the standby's unit (its cgroup), so stopping that unit stops the life too; with ``--with-standby``
one unit holds the standby and every life. Torchft's and Decoupled
DiLoCo's spare replicas are the multi-machine form of the same idea; this one needs no change to the round protocol,
because each life *is* the node to the others.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import pkgutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_diloco.config import ConfigError, RunConfig
from composer_diloco.lifecycle import GracefulStop
from composer_diloco.outer.identity import try_lock
from nodes.folder_lock import LOCK_FILE, LOCK_POLL_S

log = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.json"  # in <run-dir>/<name>/: the run config this node last joined with
FINISHED_FILE = "finished.json"  # in <run-dir>/<name>/: written when this node took part in its run's last round
TRAINING_FILE = "training.json"  # in <run-dir>/<name>/: written when a life of this node began its first inner phase
ENV_SERVER_LOG = "env-server.log"  # in <run-dir>/<name>/: the output of the env server the node started (its last life)
STANDBY_ENV_SERVER_LOG = "env-server.standby.log"  # ... of the one its standby started (the node's, once it takes over)
STANDBY_ENV_SERVER_LOG_NEXT = "env-server.standby.1.log"  # a forked life's successor's, while the life plays on the first

MAX_FAILED_LIVES = 3
"""Lives in a row that may fail (end with an error before writing a round line) before a standby stops forking them
(`Standby.run_lives`): a node that cannot start (a run that is over, an env that is gone) is not restarted forever."""

PREPARE_AFTER_S = 60.0
"""Seconds after the node's life joined (wrote `RUN_CONFIG_FILE`) by which its standby prepares (and, after a fork,
launches the next life's env server) even if that life has not begun training yet (`Standby._life_trains`)."""

LIFE_STOP_S = 7.0
"""Seconds a stopping standby gives the life it forked to stop on its SIGTERM (the life's hard exit comes at 8 s),
before it SIGKILLs the life's process group."""


def warm_imports() -> int:
    """Import every module of the ``composer_diloco`` package (its ``__main__`` modules excepted), so that the lazy
    imports of a join and of the first round cost nothing later. Returns how many modules were imported.

    Raises:
        ImportError: a module of the package does not import (a broken install: the node would fail on it too).
    """
    import composer_diloco

    names = [m.name for m in pkgutil.walk_packages(composer_diloco.__path__, "composer_diloco.")
             if not m.name.endswith(".__main__")]
    for name in names:
        importlib.import_module(name)
    return len(names)


def save_run_config(own_dir: Path, config: RunConfig) -> None:
    """Keep ``config`` (the run's published config, `RunConfig.to_json`) in ``own_dir / RUN_CONFIG_FILE`` for this
    node's standby; written atomically (a standby never reads half a file). A failed write costs only the standby's
    head start: a WARNING."""
    _write_for_standby(own_dir / RUN_CONFIG_FILE, config.to_json(), "keep the run config for a standby")


def mark_finished(own_dir: Path, rounds: int, error: str | None = None) -> None:
    """Say in ``own_dir / FINISHED_FILE`` that this node's run ended with it (``rounds``: the rounds it took part in;
    ``error``: the one line a run that ended without learning failed with, e.g. "trained on nothing"), so that its
    standby exits (0, or 1 with ``error``) instead of joining a run that is over. A failed write: a WARNING (the
    standby then joins, finds no peer and exits 1 after its ``--join-timeout``)."""
    _write_for_standby(own_dir / FINISHED_FILE, json.dumps({"time": time.time(), "rounds": rounds, "error": error}),
                       "mark the run finished")


def mark_training(own_dir: Path) -> None:
    """Say in ``own_dir / TRAINING_FILE`` that this life of the node began its first inner phase (its join is over),
    so that its standby starts preparing now and not beside the join (`Standby._life_trains`). Written atomically; a
    failed write: a WARNING (the standby then prepares `PREPARE_AFTER_S` after the join)."""
    _write_for_standby(own_dir / TRAINING_FILE, json.dumps({"time": time.time(), "pid": os.getpid()}),
                       "mark the node training")


def _write_for_standby(path: Path, text: str, what: str) -> None:
    """Write ``text`` to ``path`` atomically (`composer_diloco.checkpoint.write_atomic`: a standby never reads half a
    file); a failed write is a WARNING ("could not <what> in <path>"), since it costs only the standby's timing."""
    from composer_diloco.checkpoint import write_atomic

    try:
        write_atomic(path, text)
    except OSError as e:
        log.warning("could not %s in %s: %s", what, path, e)


def finished_since(own_dir: Path, since: float) -> dict | None:
    """What ``own_dir / FINISHED_FILE`` says (``{"time", "rounds", "error"}``) when the node finished its run at or after
    ``since`` (time.time()), else None."""
    try:
        finished = json.loads((own_dir / FINISHED_FILE).read_text())
        return finished if float(finished["time"]) >= since else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def lock_is_held(own_dir: Path) -> bool:
    """True when another process holds ``own_dir / LOCK_FILE`` now (tried without waiting, and let go at once:
    `nodes.folder_lock.lock_node_folder` tries again, `LOCK_POLL_S` apart, so this instant never refuses the node)."""
    lock = try_lock(Path(own_dir) / LOCK_FILE)
    if lock is None:
        return True
    lock.release()
    return False


@dataclass(frozen=True)
class StandbyStart:
    """What a standby saw when its process started, before its imports (which take seconds, in which the node may
    end): when (``time``, time.time()), and whether the node's folder lock was held (``held``)."""

    time: float
    held: bool

    @classmethod
    def now(cls, own_dir: Path) -> StandbyStart:
        """Look now (`lock_is_held`; a folder that does not exist yet is not held)."""
        return cls(time.time(), Path(own_dir).is_dir() and lock_is_held(own_dir))


@dataclass
class Prepared:
    """What a standby built ahead of a takeover from the run config its node last joined with.

    Attributes:
        config: that run config (`RUN_CONFIG_FILE`).
        env_server: this node's own env server, launched and maybe not yet healthy
            (`composer_diloco.rollout.env_process.EnvServerLaunch`), or None with ``--env-url``.
        skeleton: ``(model, tokenizer)`` of `composer_diloco.policy.load.policy_skeleton` on the CPU, or None when it failed (the
            join builds it again and raises there).
        seconds: wall seconds the preparation took.
        plan_inputs: the memory plan's inputs for ``config`` (`composer_diloco.policy.memory_plan.plan_inputs`: the
            tokenizer's and the env's demonstrations' part, which does not change while the standby waits; the free
            memory is read again at the takeover), or None.
    """

    config: RunConfig
    env_server: Any | None
    skeleton: tuple[Any, Any] | None
    seconds: float
    plan_inputs: Any | None = None

    def for_config(self, config: RunConfig) -> Prepared | None:
        """This preparation when ``config`` (the run's published config, read at takeover) has its digest; else
        None, after stopping its env server (the join launches and builds for ``config`` itself)."""
        if config.digest() == self.config.digest():
            return self
        log.info("the run's config (%s) is not the one this standby prepared for (%s): starting from scratch",
                 config.digest(), self.config.digest())
        self.close()
        return None

    def close(self) -> None:
        """Stop the env server (idempotent) and drop the skeleton."""
        if self.env_server is not None:
            self.env_server.stop()
        self.skeleton = None


class Standby:
    """``composer-node join --standby`` (module docstring): prepare, wait for the node's folder lock (`wait`), fork the
    node's next life and stand by it again (`run_lives`).

    Args:
        own_dir: ``<run-dir>/<name>``, the node's folder.
        stop: the process's `GracefulStop` (SIGINT/SIGTERM end the wait).
        own_env_server: False with ``--env-url`` (the node starts no env server of its own).
        alone_after_s: seconds after which a standby that never saw the lock held takes it (``--join-timeout``).
        start: what the process saw at its start (`StandbyStart`; default: now).
        first_life_lock: the node's folder lock, taken by this process at its start (``--with-standby``): the
            node's first life is forked with it at once (`wait` returns it first), with nothing prepared.
    """

    def __init__(self, own_dir: Path, stop: GracefulStop, own_env_server: bool = True, alone_after_s: float = 30.0,
                 start: StandbyStart | None = None, first_life_lock: Any | None = None):
        self.own_dir, self.stop, self.own_env_server = Path(own_dir), stop, own_env_server
        self.alone_after_s = alone_after_s
        start = start or StandbyStart.now(own_dir)
        self.started = start.time
        self.seen_held = start.held  # the lock was held by another process at least once since this standby started
        self.prepared: Prepared | None = None
        self._config_stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the RUN_CONFIG_FILE prepared from
        self._imported = False
        self.life: ForkedLife | None = None  # the node's life this standby forked, while it runs (`run_lives`)
        self.successor_due = False  # the next life's env server is still to launch (`_prepare_successor_when_due`)
        self.lives = 0  # lives forked
        self.failed_in_a_row = 0  # lives that ended with an error before any round line, in a row
        self.gave_up: str | None = None  # why this standby stopped forking lives (`MAX_FAILED_LIVES`)
        self.finished_error: str | None = None  # the node finished its run with this error (`mark_finished`)
        self._first_life_lock = first_life_lock
        self._starts_node = first_life_lock is not None
        # True from the first life's fork to its end, in that life's process only (the fork copies it; this process
        # sets it back at once): the life started by ``--with-standby``, whose join counts from the command's start
        self.starting_first_life = False

    def wait(self) -> Any | None:
        """Prepare (module docstring), then wait until this process holds the node's folder lock.

        Returns:
            the held lock (`composer_diloco.outer.identity.try_lock`'s; the caller releases it), or None: the node
            finished its run while this standby waited, a signal came (the life it forked, if one runs, is stopped
            first: `LIFE_STOP_S`), or it gave up forking lives (`gave_up`).
        Raises:
            ImportError: `warm_imports` failed.
        """
        self._import()
        self.own_dir.mkdir(parents=True, exist_ok=True)
        if self._first_life_lock is not None:  # --with-standby: this process took the folder to start the node
            lock, self._first_life_lock = self._first_life_lock, None
            log.info("standby: starting %s's first life", self.own_dir.name)
            return lock
        while not self.stop.event.is_set() and self.gave_up is None:
            self._reap_life()  # the life this standby forked (`run_lives`), once it ended
            lock = try_lock(self.own_dir / LOCK_FILE)  # first: a preparation takes seconds
            if lock is not None and self.life is not None:
                self._reap_life(wait_s=LIFE_STOP_S)  # the lock is free: the life it forked has ended, or is ending
            if lock is None:
                self.seen_held = True
            elif not self.seen_held and time.time() - self.started < self.alone_after_s:
                lock.release()  # the node it stands by may be starting beside it: let it take its folder first
            else:
                # the node finished its run: since this standby started, or (never seen running) at all
                finished = finished_since(self.own_dir, self.started if self.seen_held else 0.0)
                if finished is not None:
                    lock.release()
                    self.finished_error = finished.get("error")
                    if self.finished_error:
                        log.error("%s finished its run with an error (%s): the standby exits 1", self.own_dir.name,
                                  self.finished_error)
                    else:
                        log.info("%s finished its run: the standby exits", self.own_dir.name)
                    break
                log.warning("standby takes over %s (%s): joining as it, %s", self.own_dir.name,
                            "its process ended" if self.seen_held else "no process of it started",
                            "prepared in %.1f s" % self.prepared.seconds if self.prepared else "nothing prepared")
                return lock
            if self._life_trains():  # not beside a join: the standby's work took its CPU on a loaded box
                self._prepare_if_new_config()
                self._prepare_successor_when_due()
            self.stop.event.wait(LOCK_POLL_S)
        self._stop_life()
        if self.prepared is not None:
            self.prepared.close()
        return None

    def run_lives(self, life: Callable[[Any, Prepared | None, GracefulStop], int]) -> int:
        """Stand by the node for the rest of its run: each time its process ends, fork the next one from this
        prepared process (`nodes.fork.fork_life`), and stand by that one too.

        A fork shares the imports and the policy skeleton this process holds: the new life starts with the DHT join,
        and this standby is ready for the next end as soon as it launched that life's successor env server (one
        process's start, once the life trains: `_prepare_successor_when_due`), instead of a new standby's imports and
        preparation (25-40 s of a core on a loaded 2-core box, during which a second kill found nothing prepared:
        BENCHMARKS.md 3p). The lock is handed to the child
        (`composer_diloco.outer.identity.FileLockHeld.hand_over`): it holds the node's folder from the first instant.
        Each life is its own session (process group); this process never trains, never touches a GPU (its skeleton
        is on the CPU) and keeps torch at one thread (`nodes.fork.single_threaded_torch`). Where a fork is unsafe
        (`nodes.fork.fork_unsafe`: CUDA initialized here, threads running) this process joins as the node itself, as
        a standby did before, and no standby is left.

        Args:
            life: what a life runs, ``life(lock, prepared, stop)`` -> its exit code: ``lock`` the node's folder lock it
                holds, ``prepared`` what this standby built (its env server lent, `BorrowedEnvServer`; None when
                nothing was), ``stop`` the life's own `GracefulStop`, installed.
        Returns:
            The exit code: 0 when the node finished its run (1 when it finished it with an error: trained on
            nothing, `mark_finished`), 130 on SIGINT/SIGTERM (forwarded to the life, which
            gets `LIFE_STOP_S` to stop), 1 after `MAX_FAILED_LIVES` lives in a row ended with an error before any
            round line (the reason logged at ERROR), or the exit code of ``life`` when it ran in this process.
        Raises:
            ImportError: `warm_imports` failed.
        """
        from nodes.fork import fork_life, fork_unsafe, single_threaded_torch

        self._import()
        torch_threads = single_threaded_torch()  # before the preparation's first torch op (`nodes.fork`)
        while True:
            lock = self.wait()
            if lock is None:
                return 1 if self.gave_up or self.finished_error else 130 if self.stop.event.is_set() else 0
            if self.gave_up is not None:  # the life that just ended was one failure too many
                lock.release()
                return 1
            self.starting_first_life = self.lives == 0 and self._starts_node  # --with-standby's first life
            unsafe = fork_unsafe()
            if unsafe is not None:
                import torch

                log.warning("standby: cannot fork %s's next life (%s): this process joins as it, and no standby is "
                            "left for it", self.own_dir.name, unsafe)
                torch.set_num_threads(torch_threads)
                return life(lock, self.prepared, self.stop)
            handed, server = self._lend_prepared()
            pid = fork_life(lambda: _forked_life(life, lock, handed, server), torch_threads)
            self.starting_first_life = False
            lock.hand_over()  # the child holds the folder now, alone
            self.seen_held = True  # by the life it forked: a free lock from now on means that life ended
            self.lives += 1
            self.life = ForkedLife(pid, time.time(), _round_lines(self.own_dir), server)
            log.warning("standby: %s's life %d runs as pid %d (its own process group); preparing for the next "
                        "once it trains", self.own_dir.name, self.lives, pid)
            if self.prepared is not None:  # the server it lent is the life's now (stopped once the life ended)
                self.prepared = dataclasses.replace(self.prepared, env_server=None)
            self.successor_due = self.prepared is not None and self.own_env_server

    def _import(self) -> None:
        """`warm_imports`, once."""
        if self._imported:
            return
        t0 = time.monotonic()
        count = warm_imports()
        self._imported = True
        log.info("standby for %s: %d modules imported in %.1f s; waiting for the process that holds %s to end",
                 self.own_dir.name, count, time.monotonic() - t0, self.own_dir / LOCK_FILE)

    def _lend_prepared(self) -> tuple[Prepared | None, Any | None]:
        """What the next forked life takes: this preparation, and its env server once healthy (waited for here:
        the life cannot poll a process that is not its child; one that does not come up is stopped, and the life
        starts its own). The server stays this process's (`ForkedLife.env_server`); the life gets it lent."""
        prepared = self.prepared
        if prepared is None or prepared.env_server is None:
            return prepared, None
        from composer_diloco.rollout.env_process import EnvServerError

        launch = prepared.env_server
        try:
            server = launch.wait(prepared.config.env.connect_timeout_s)
        except EnvServerError as e:
            log.warning("standby: the env server it prepared did not come up (%s): the node's life starts its own", e)
            launch.stop()
            return dataclasses.replace(prepared, env_server=None), None
        return prepared, server

    def _life_trains(self) -> bool:
        """Whether the standby may work now: the life holding the node's folder began training since it joined
        (`TRAINING_FILE` not older than its join: `RUN_CONFIG_FILE`, which each join writes, the fork of a life this
        standby forked, which writes it only once its DHT is up, and this standby's start), or joined
        `PREPARE_AFTER_S` ago (a first inner phase that is minutes away at real size; a standby started beside a node
        that trained already), or nothing joined yet (no `RUN_CONFIG_FILE`: nothing to prepare from). Not while a
        life joins: a preparation (the imports of transformers and OpenEnv's server stack, the policy's skeleton, an
        env server's start: 15 s on a loaded 2-core box) beside the node's first start, and an env server's start
        beside a takeover, took their CPU from the join (BENCHMARKS.md 3r, 3s)."""
        try:
            joined = (self.own_dir / RUN_CONFIG_FILE).stat().st_mtime
        except OSError:
            return True
        # a life this standby forked joined after its fork; the first life after this standby's start (a run dir's
        # files may be an earlier run's: a job script that starts both on a resumed run)
        joined = max(joined, self.life.started if self.life is not None else self.started)
        if time.time() - joined >= PREPARE_AFTER_S:
            return True
        try:
            return (self.own_dir / TRAINING_FILE).stat().st_mtime >= joined
        except OSError:
            return False

    def _prepare_successor_when_due(self) -> None:
        """After a fork, once the life trains (`_life_trains`): the next life's env server (the skeleton and the
        memory plan's inputs are this process's still: the life got copies). Not at the fork: a server's start is a
        Python process's imports (about 1.2 s of a core on an idle box), and during a takeover it took that CPU from
        the life's join on a loaded box (BENCHMARKS.md 3r). A life that ends before its successor's server came up
        starts its own (`_lend_prepared`). ``successor_due`` is a flag, not derived from a missing server: a launch
        that failed is not retried."""
        if not self.successor_due:
            return
        self.successor_due = False
        prepared = self.prepared
        if prepared is None:
            return
        from composer_diloco.rollout.env_process import launch_env_server

        try:
            server = launch_env_server(prepared.config.env.server_module, args=prepared.config.env.server_args,
                                       log_path=self._next_env_log())
        except OSError as e:  # the next life starts its own
            log.warning("standby: could not launch the next life's env server (%s)", e)
            server = None
        self.prepared = dataclasses.replace(prepared, env_server=server)

    def _reap_life(self, wait_s: float = 0.0) -> None:
        """If the life this standby forked has ended, collect it: log how it ended, stop the env server it played on,
        and count it toward `MAX_FAILED_LIVES`. ``wait_s`` > 0: wait that long for it to end, then SIGKILL its process
        group (a life that let go of the node's folder and does not exit is stuck in its shutdown) and collect it."""
        life = self.life
        if life is None:
            return
        deadline = time.monotonic() + wait_s
        while True:
            try:
                pid, status = os.waitpid(life.pid, os.WNOHANG)
            except ChildProcessError:  # collected elsewhere: its end is unknown
                pid, status = life.pid, None
            if pid != 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if pid == 0:
            if wait_s <= 0:
                return
            log.warning("standby: %s's life %d (pid %d) did not end within %.0f s: killing its process group",
                        self.own_dir.name, self.lives, life.pid, wait_s)
            try:
                os.killpg(life.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(life.pid, 0)
        self.life = None
        if life.env_server is not None:
            life.env_server.stop()
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        how = ("ended" if code is None else f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited {code}")
        log.log(logging.INFO if code == 0 else logging.WARNING, "standby: %s's life %d (pid %d) %s after %.1f s",
                self.own_dir.name, self.lives, life.pid, how, time.time() - life.started)
        failed = code is not None and code > 0 and code != 130 and _round_lines(self.own_dir) == life.lines
        self.failed_in_a_row = self.failed_in_a_row + 1 if failed else 0
        if self.failed_in_a_row >= MAX_FAILED_LIVES:
            self.gave_up = (f"the last {self.failed_in_a_row} lives of {self.own_dir.name} ended with an error before "
                            f"any round (the last: exit {code}; see its log above): the standby stops")
            log.error("standby: %s", self.gave_up)

    def _stop_life(self) -> None:
        """On this standby's stop: SIGTERM the life it forked, give it `LIFE_STOP_S`, then SIGKILL its group."""
        life = self.life
        if life is None:
            return
        try:
            os.kill(life.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self._reap_life(wait_s=LIFE_STOP_S)

    def _next_env_log(self) -> Path:
        """The output file of the env server the next life will play on: not the one the running life's writes."""
        return self.own_dir / (STANDBY_ENV_SERVER_LOG_NEXT if self.lives % 2 else STANDBY_ENV_SERVER_LOG)

    def _prepare_if_new_config(self) -> None:
        """Prepare from `RUN_CONFIG_FILE` when it exists and changed since the last preparation (the node joined a
        new run); a file that does not parse is skipped with a WARNING (once per change)."""
        path = self.own_dir / RUN_CONFIG_FILE
        try:
            st = path.stat()
        except OSError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._config_stamp:
            return
        self._config_stamp = stamp
        try:
            config = RunConfig.from_json(path.read_text())
        except (OSError, ConfigError, ValueError) as e:
            log.warning("standby: %s is not a run config (%s): nothing prepared from it", path, e)
            return
        if self.prepared is not None:
            if self.prepared.config.digest() == config.digest():
                return
            self.prepared.close()
        try:
            self.prepared = prepare(config, own_env_server=self.own_env_server, env_log=self._next_env_log())
        except Exception as e:  # the takeover's join meets it again and fails with its own one-line error
            self.prepared = None
            log.warning("standby: preparing for run %r failed (%s: %s): a takeover starts from scratch",
                        config.run_name, type(e).__name__, e)
            return
        log.info("standby prepared for run %r (config %s) in %.1f s: memory plan inputs, %s, policy skeleton%s",
                 config.run_name, config.digest(), self.prepared.seconds,
                 "its env server" if self.prepared.env_server is not None else "no env server (--env-url)",
                 "" if self.prepared.skeleton is not None else " (failed: built again at takeover)")


@dataclass
class ForkedLife:
    """A life of the node that its standby forked (`Standby.run_lives`).

    Attributes:
        pid: its process (the leader of its own process group).
        started: when it was forked, time.time().
        lines: the round lines of ``<name>/metrics.jsonl`` at its start (a life that wrote none failed at its start).
        env_server: the env server it plays on (`EnvServer`), the standby's own: stopped once the life ended.
    """

    pid: int
    started: float
    lines: int
    env_server: Any | None = None


def _round_lines(own_dir: Path) -> int:
    """Lines of ``own_dir / metrics.jsonl`` (0 when there is none)."""
    try:
        with open(own_dir / "metrics.jsonl", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _forked_life(life: Callable[[Any, Prepared | None, GracefulStop], int], lock: Any, prepared: Prepared | None,
                 server: Any | None) -> int:
    """In a forked life (`nodes.fork.fork_life`): its own signal handlers (`GracefulStop`), its own reaper (its DHT's
    and averager's processes die with it, `composer_diloco.reaper`) and the standby's env server lent, then ``life``."""
    from composer_diloco.reaper import watch_this_process
    from composer_diloco.rollout.env_process import BorrowedEnvServer

    stop = GracefulStop().install()
    watch_this_process()
    if prepared is not None and server is not None:
        prepared = dataclasses.replace(prepared, env_server=BorrowedEnvServer(server))
    return life(lock, prepared, stop)


def prepare(config: RunConfig, own_env_server: bool = True, env_log: Path | None = None) -> Prepared:
    """Build what a node's join would for ``config`` before it holds the node's identity (module docstring, step 2):
    the memory plan's inputs (its imports and tokenizer), its own env server (``own_env_server``, its output to
    ``env_log``, or a temp file when None) and the policy's skeleton. Errors are left to the join, which meets them
    again and raises them with its one-line messages: a failed skeleton is None here, a failed env server is raised at
    the join's ``wait``."""
    from composer_diloco.policy.memory_plan import plan_inputs
    from composer_diloco.rollout.env_process import launch_env_server
    from composer_diloco.policy.load import policy_skeleton

    t0 = time.monotonic()
    server = (launch_env_server(config.env.server_module, args=config.env.server_args, log_path=env_log)
              if own_env_server else None)
    inputs = plan_inputs(config)
    try:
        skeleton = policy_skeleton(config)
    except Exception as e:  # the join builds it again and raises its own error
        log.warning("standby: the policy skeleton did not build (%s: %s)", type(e).__name__, e)
        skeleton = None
    return Prepared(config, server, skeleton, time.monotonic() - t0, plan_inputs=inputs)


__all__ = ["FINISHED_FILE", "LIFE_STOP_S", "LOCK_POLL_S", "MAX_FAILED_LIVES", "PREPARE_AFTER_S", "RUN_CONFIG_FILE",
           "TRAINING_FILE", "ForkedLife", "Prepared", "Standby", "StandbyStart", "finished_since", "lock_is_held",
           "mark_finished", "mark_training", "prepare", "save_run_config", "warm_imports"]
