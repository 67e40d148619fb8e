"""A node's warm standby (`composer-node join --standby`): a second process for the same ``--run-dir`` and ``--name``
that does the slow part of a node's start ahead of time and takes the node over the moment its process ends.

A node restarted after a crash pays its whole start again before its next inner step: the imports (torch,
transformers, TRL, peft, hivemind, and OpenEnv's server stack, which the memory plan reads the env package's
demonstrations through: 7-10 s on a 2-core CPU box), its env server's start, and its policy's build (at real size,
the base model read from disk). A standby pays them while the node still trains, then waits for the node's folder lock
(``<run-dir>/<name>/node.lock``: the OS drops it when the process holding it ends, SIGKILL and an OOM kill included).
Once it holds it, it joins the run as that node (`nodes.node.Node.join`: the same identity key, so the same peer ID,
and the peers its last life saw): what is left is the DHT join, the run config, the state download and the wait for
the round boundary.

What it prepares (`Standby.wait`), in order:

1. every module of ``composer_diloco`` (the join and the round import most of theirs lazily);
2. from the run config the node last joined with (`RUN_CONFIG_FILE`, which `Node` writes at each join; the first
   life's standby waits for it): the memory plan's inputs (the tokenizer and the env package's demonstrations), this
   node's own env server (not with ``--env-url``) and the policy's skeleton (`composer_diloco.policy.load.policy_skeleton`: the
   architecture, and with ``[lora]`` or ``--model`` the base weights, on the CPU). At takeover the server and the
   skeleton are used when the run's published config has the same digest, and stopped / dropped otherwise
   (`Prepared.for_config`).

A standby takes the lock only once it has seen it held (the node it stands by was running; looked at first before its
imports, `StandbyStart`), or after ``--join-timeout`` seconds without ever seeing it held (no node runs under that
name: it starts the node itself), so a job script may start the node and its standby together: the node takes its
folder first thing, before its imports (`nodes.folder_lock`), so however slow those are its standby sees it held. It exits 0 without
joining when the node finished its run (`FINISHED_FILE`: written after the standby started, or at any time when it
never saw the node running); SIGINT or SIGTERM while it waits: 130. Its cost while it waits: host memory (the
imports, about 0.5 GB on CPU, and the skeleton: the model's size), one idle env server process, no device memory, and
CPU only while preparing.

Fault model: a standby outlives the node's *process* (an exception, an OOM kill, a CUDA error, SIGKILL), not its
machine: run it on the same machine, beside the node, under its own supervisor (systemd unit or job script), and start
a new standby after each takeover. Torchft's and Decoupled DiLoCo's spare replicas are the multi-machine form of the
same idea; this one needs no change to the round protocol, because the standby *is* the node to the others.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
import time
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
ENV_SERVER_LOG = "env-server.log"  # in <run-dir>/<name>/: the output of the env server the node started (its last life)
STANDBY_ENV_SERVER_LOG = "env-server.standby.log"  # ... of the one its standby started (the node's, once it takes over)


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
    from composer_diloco.checkpoint import write_atomic

    try:
        write_atomic(own_dir / RUN_CONFIG_FILE, config.to_json())
    except OSError as e:
        log.warning("could not keep the run config for a standby in %s: %s", own_dir / RUN_CONFIG_FILE, e)


def mark_finished(own_dir: Path, rounds: int) -> None:
    """Say in ``own_dir / FINISHED_FILE`` that this node's run ended with it (``rounds``: the rounds it took part in),
    so that its standby exits 0 instead of joining a run that is over. A failed write: a WARNING (the standby then
    joins, finds no peer and exits 1 after its ``--join-timeout``)."""
    from composer_diloco.checkpoint import write_atomic

    try:
        write_atomic(own_dir / FINISHED_FILE, json.dumps({"time": time.time(), "rounds": rounds}))
    except OSError as e:
        log.warning("could not mark the run finished in %s: %s", own_dir / FINISHED_FILE, e)


def finished_since(own_dir: Path, since: float) -> bool:
    """True when ``own_dir / FINISHED_FILE`` says the node finished its run at or after ``since`` (time.time())."""
    try:
        return float(json.loads((own_dir / FINISHED_FILE).read_text())["time"]) >= since
    except (OSError, ValueError, KeyError, TypeError):
        return False


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
    """The waiting half of ``composer-node join --standby`` (module docstring): prepare, then wait for the node's
    folder lock.

    Args:
        own_dir: ``<run-dir>/<name>``, the node's folder.
        stop: the process's `GracefulStop` (SIGINT/SIGTERM end the wait).
        own_env_server: False with ``--env-url`` (the node starts no env server of its own).
        alone_after_s: seconds after which a standby that never saw the lock held takes it (``--join-timeout``).
        start: what the process saw at its start (`StandbyStart`; default: now).
    """

    def __init__(self, own_dir: Path, stop: GracefulStop, own_env_server: bool = True, alone_after_s: float = 30.0,
                 start: StandbyStart | None = None):
        self.own_dir, self.stop, self.own_env_server = Path(own_dir), stop, own_env_server
        self.alone_after_s = alone_after_s
        start = start or StandbyStart.now(own_dir)
        self.started = start.time
        self.seen_held = start.held  # the lock was held by another process at least once since this standby started
        self.prepared: Prepared | None = None
        self._config_stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the RUN_CONFIG_FILE prepared from

    def wait(self) -> Any | None:
        """Prepare (module docstring), then wait until this process holds the node's folder lock.

        Returns:
            the held lock (`composer_diloco.outer.identity.try_lock`'s; the caller releases it), or None: the node
            finished its run while this standby waited, or a signal came.
        Raises:
            ImportError: `warm_imports` failed.
        """
        t0 = time.monotonic()
        count = warm_imports()
        log.info("standby for %s: %d modules imported in %.1f s; waiting for the process that holds %s to end",
                 self.own_dir.name, count, time.monotonic() - t0, self.own_dir / LOCK_FILE)
        self.own_dir.mkdir(parents=True, exist_ok=True)
        while not self.stop.event.is_set():
            lock = try_lock(self.own_dir / LOCK_FILE)  # first: a preparation takes seconds
            if lock is None:
                self.seen_held = True
            elif not self.seen_held and time.time() - self.started < self.alone_after_s:
                lock.release()  # the node it stands by may be starting beside it: let it take its folder first
            else:
                # the node finished its run: since this standby started, or (never seen running) at all
                if finished_since(self.own_dir, self.started if self.seen_held else 0.0):
                    lock.release()
                    log.info("%s finished its run: the standby exits", self.own_dir.name)
                    break
                log.warning("standby takes over %s (%s): joining as it, %s", self.own_dir.name,
                            "its process ended" if self.seen_held else "no process of it started",
                            "prepared in %.1f s" % self.prepared.seconds if self.prepared else "nothing prepared")
                return lock
            self._prepare_if_new_config()
            self.stop.event.wait(LOCK_POLL_S)
        if self.prepared is not None:
            self.prepared.close()
        return None

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
            self.prepared = prepare(config, own_env_server=self.own_env_server,
                                    env_log=self.own_dir / STANDBY_ENV_SERVER_LOG)
        except Exception as e:  # the takeover's join meets it again and fails with its own one-line error
            self.prepared = None
            log.warning("standby: preparing for run %r failed (%s: %s): a takeover starts from scratch",
                        config.run_name, type(e).__name__, e)
            return
        log.info("standby prepared for run %r (config %s) in %.1f s: memory plan inputs, %s, policy skeleton%s",
                 config.run_name, config.digest(), self.prepared.seconds,
                 "its env server" if self.prepared.env_server is not None else "no env server (--env-url)",
                 "" if self.prepared.skeleton is not None else " (failed: built again at takeover)")


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


__all__ = ["FINISHED_FILE", "LOCK_POLL_S", "RUN_CONFIG_FILE", "Prepared", "Standby", "StandbyStart", "finished_since",
           "lock_is_held", "mark_finished", "prepare", "save_run_config", "warm_imports"]
