"""Goodput under churn: a coordinator and N nodes on 127.0.0.1, nodes SIGKILLed and restarted on a schedule, the
coordinator SIGKILLed and restarted once, every restart with the same command a user's job script would run (the
coordinator's first ``peer:`` line, its ``--run-dir`` and ``--listen``).

Each peer is its own process group (a machine): a kill takes its DHT, averager, p2pd and env server down with it.
Every ``--kill-every-s`` seconds one live node (seeded choice) is killed and started again ``--restart-after-s`` later;
at ``--coordinator-kill-at-s`` the coordinator is killed and started again. Restarts stop once the coordinator has
reached the last round. Reported (``OUT/churn.json``, and one line on stdout):

    goodput            inner-loop seconds (``inner_seconds`` of every node round line, plus its
                       ``resumed_inner_seconds``: the steps of a cut phase that a life took over from its last life's
                       journal, `composer_diloco.inner.journal`, ``resent_inner_seconds``: a handed-off phase whose
                       round the swarm averaged without it, re-sent by the next life, and ``landed_inner_seconds``: a
                       handed-off phase a group averaged in whose line was lost with its life, recorded by the next
                       life) over node-seconds alive (spawn to exit or kill, every life of every node)
    goodput_kept       the same, counting only rounds whose ``global_sha256`` is the coordinator's for that round,
                       or, for a round the coordinator was down for, an ancestor of the theta it next recorded
                       (`_reached_model`; before 2026-12-04 those rounds were not counted): work that reached the
                       canonical model
    where the rest went, over node-seconds alive: ``startup`` (spawn, or a standby's takeover, to the start of a
                       life's first inner phase, its line's ``inner_started``: imports, env server, DHT join, state
                       download), ``sync`` (the seconds each round's sync
                       stopped the inner loop: ``blocked_seconds``, which is ``sync_seconds`` unless the sync
                       overlaps), ``lost`` (the rest), split into ``lost_after_last_round`` (from the end of the last
                       phase a life's round lines record to the life's end: the inner phase a kill cut short, with
                       ``[outer] overlap`` also the phase whose sync was under way; the run's shutdown) and
                       ``lost_between_rounds`` (the seconds between a life's rounds that are neither inner phase nor
                       blocked sync); ``resumed`` (over node-seconds alive, in ``inner``): the seconds of cut phases
                       and of re-sent handed-off phases that reached the model through the next life's journal, and of
                       landed ones that reached it in their own round with no line of their life, all out of
                       ``lost_after_last_round``; ``resent`` and ``landed`` those two parts of it
    rounds             rounds some peer completed, of ``--rounds`` (``coordinator_rounds``: those the coordinator
                       recorded; it misses the rounds it was down for)
    agree              every round's peers recorded one ``global_sha256``
    split_rounds       the rounds that broke ``agree``: matchmaking formed several all-reduce groups, whose thetas
                       differ (``thetas``: how many), and ``healed``: every peer's last record of the round names one
                       theta (the losing groups took the run's theta within the round and dropped their
                       pseudo-gradients, `composer_diloco.outer.peer.DiLoCoPeer._join_authority_after_split`)
    back_after_kill_s  per kill, seconds from the kill to the first inner phase of the node's next life (a restart:
                       ``--restart-after-s`` and its whole start; a standby: its takeover)
    join_seconds_median per way a life joined (``joined_as``: ``process``, ``standby, prepared``, ``standby,
                       unprepared``), the lives that got to train and the median seconds of each part of their join
                       (``join_seconds`` of their first metrics line, `composer_diloco.timing.JOIN_PHASES`)
    exits_on_their_own node lives that ended with an error, not by the schedule (e.g. a join that found no peer to
                       send the global model while the coordinator was down): with ``--standby`` its standby takes
                       over and a new one is started, as after a kill; without, the node is not restarted (only the
                       schedule's kills are, so a run whose nodes cannot start ends as stalled)
    orphans            processes of the run still alive after it (p2pd, env servers, hivemind workers)
    blocked_s          the nodes' blocked sync seconds: in all, in round lines blocked more than 2 s, and in lines
                       whose inner phase ended within 15 s after another node's life began (a barrier waiting for a
                       restart or a takeover)
    steady             goodput once the run is under way: from the first inner phase of the last node to start,
                       inner-loop seconds over node-seconds alive (every node's first start left out, every kill and
                       takeover after it in: what a run of hours sees), and the swarm's throughput over that window:
                       ``samples_per_s``, ``kept_samples_per_s`` (goodput alone misleads where nodes share cores: a
                       node waiting at the barrier leaves its core to the others)
    contributed_unrecorded_samples
                       sample weight the coordinator averaged in beyond the node lines of its rounds: with
                       ``[outer] overlap`` a kill after a round's sync landed and before the node's next inner step
                       (before 7314e18: before the next phase's end) leaves that round's pseudo-gradient in the model
                       with no line (goodput counts that phase as lost)

    python bench/churn.py --out runs/churn                    (the embedded default, 3 nodes, a kill every 25 s)
    python bench/churn.py --out runs/churn --kill-every-s 0   (no churn: the same run's goodput without faults)
    python bench/churn.py --out runs/churn --config bench/configs/overlap.toml   (the run's TOML: here the sync overlaps)
    python bench/churn.py --out runs/churn-before --code /tmp/before   (the peers run another checkout's code, e.g. a
                                                                      worktree of an older commit; the same schedule)
    python bench/churn.py --out runs/churn --report   (runs nothing: the finished run in --out summarized again)
    python bench/churn.py --out runs/churn-sb --standby   (each node has a warm standby, `composer-node join --standby`:
                                                           a kill takes only the node's process, its standby takes over
                                                           and a new standby is started where a restart would be)
    python bench/churn.py --out runs/churn-ws --with-standby   (each node under its standby, one command,
                                                               `composer-node join --with-standby`: the standby forks
                                                               the first life too, counted from the command's start)

With ``--standby`` a node's life starts when its standby took over (the kill: the standby's seconds of waiting are not
node-seconds, as a spare process's are not), and the kill is of the node's training process only: the fault a standby
survives (a crash, an OOM kill), not a lost machine, which takes the standby with it. Since 2026-12-06 a standby forks
each life of its node and stands by it again (`nodes.standby.Standby.run_lives`): the bench then finds each new life in
``<run-dir>/<name>/node.pid`` (a process it did not start: `ForkedProc`), kills it there, and starts no new standby.
With the code of an older checkout (``--code``, no ``nodes/fork.py``) it runs the schedule as it did: the standby
becomes the node, and a new standby is started ``--restart-after-s`` after each takeover.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class ForkedProc:
    """A node life the bench did not start: a process its standby forked (`nodes.standby.Standby.run_lives`), found in
    ``<run-dir>/<name>/node.pid``; shaped as the part of `subprocess.Popen` the bench uses. Its exit code is its
    standby's to collect (``returncode`` stays None); it has ended once its pid is gone, a zombie, or another
    process's (its start time differs)."""

    def __init__(self, pid: int):
        import psutil

        self.pid, self.returncode = pid, None
        self._created = psutil.Process(pid).create_time()

    def poll(self) -> int | None:
        """None while it runs, else 0 (ended; its code is not ours to read)."""
        import psutil

        try:
            p = psutil.Process(self.pid)
            if p.create_time() == self._created and p.status() != psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            pass
        return 0

    def wait(self, timeout: float | None = None) -> int:
        """Poll until it ended (`subprocess.TimeoutExpired` after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return 0


@dataclass
class Life:
    """One process of a peer, from spawn to exit."""

    name: str
    proc: subprocess.Popen | ForkedProc | None  # None: a life read back from churn.json (--report)
    started: float
    ended: float | None = None
    killed: bool = False
    standby: bool = False  # started with --standby or --with-standby (`nodes/standby.py`)
    starts_node: bool = False  # started with --with-standby: the standby forks the node's first life itself
    took_over: float | None = None  # a standby: when the node it stood by was killed (its life as the node starts)
    replaces_kill_at: float | None = None  # a restart or a takeover: when the life it replaces was killed

    @property
    def began(self) -> float | None:
        """When this life began as the node: its spawn, or a standby's takeover (None: a standby that never did)."""
        return self.took_over if self.standby else self.started


@dataclass
class Churn:
    """The run's processes and their lives."""

    run_dir: Path
    rounds: int
    listen: str
    code: Path = ROOT
    config: Path | None = None
    lives: list[Life] = field(default_factory=list)
    peer: str = ""

    def spawn(self, name: str, args: list[str]) -> Life:
        """Start ``python ARGS`` as peer ``name`` in its own session (a machine), logging to ``logs/NAME.log``."""
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(self.code), os.environ.get("PYTHONPATH")]))}
        with open(log, "ab") as f:
            stdout = subprocess.PIPE if name == "coordinator" else f
            proc = subprocess.Popen([sys.executable, *args], stdout=stdout, stderr=f, stdin=subprocess.DEVNULL,
                                    env=env, cwd=self.code, start_new_session=True)
        life = Life(name, proc, time.time())
        self.lives.append(life)
        return life

    def start_coordinator(self) -> str:
        """Start (or restart, with the same command) the coordinator; returns its ``peer:`` line.

        Raises:
            RuntimeError: it printed no peer line within 300 s (or exited first)."""
        config = ["--config", str(self.config)] if self.config is not None else []
        life = self.spawn("coordinator", ["-m", "coordinator", "start", "--run-dir", str(self.run_dir), "--rounds",
                                          str(self.rounds), "--listen", self.listen, *config])
        found: list[str] = []

        def read() -> None:
            for raw in life.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith("peer: ") and not found:
                    found.append(line.split()[1])

        threading.Thread(target=read, daemon=True).start()
        deadline = time.time() + 300
        while not found and life.proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        if not found:
            raise RuntimeError(f"the coordinator printed no peer line (exit {life.proc.poll()}); see "
                               f"{self.run_dir / 'logs' / 'coordinator.log'}")
        return found[0]

    def start_node(self, name: str, standby: bool = False, starts_node: bool = False) -> Life:
        """Start (or restart, with the same command) node ``name`` on the coordinator's first ``peer:`` line;
        ``standby``: its warm standby (the same command with ``--standby``); ``starts_node``: the node under its
        standby, one command (``--with-standby``: its first life is forked by it, `adopt_forked_lives`)."""
        flag = ["--with-standby"] if starts_node else ["--standby"] if standby else []
        life = self.spawn(name, ["-m", "nodes", "join", "--peer", self.peer, "--run-dir", str(self.run_dir),
                                 "--name", name, "--device", "cpu", *flag])
        life.standby, life.starts_node = standby or starts_node, starts_node
        return life

    def live(self, name: str) -> Life | None:
        """The running life of peer ``name`` that is the node (not a standby still waiting), or None."""
        return next((x for x in reversed(self.lives) if x.name == name and x.proc.poll() is None
                     and x.began is not None), None)

    def holder(self, name: str) -> tuple[int, float] | None:
        """The pid ``<run-dir>/<name>/node.pid`` names (`nodes.folder_lock.HOLDER_FILE`) and since when (time.time()
        the life wrote it, milliseconds after its fork), or None (none yet, or a checkout older than it)."""
        try:
            held = json.loads((self.run_dir / name / "node.pid").read_text())
            return int(held["pid"]), float(held["since"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def adopt_forked_lives(self, names: list[str], killed_at: dict[str, float]) -> list[Life]:
        """Register each node's life that its standby forked since the last call (its pid in ``node.pid``, a process
        the bench did not start): its life begins at its fork (its start time); ``killed_at`` gives the kill it
        replaces (popped). A standby that became the node itself (a fork refused, `nodes.fork.fork_unsafe`) is
        marked as having taken over. Returns the new lives. (A life begins when it wrote ``node.pid``: the process's
        start time from /proc counts from a boot time read to the second, which put some lives' start before the
        kill they replaced.)"""
        import psutil

        new = []
        for name in names:
            held = self.holder(name)
            if held is None:
                continue
            pid, since = held
            known = next((x for x in self.lives if x.proc is not None and x.proc.pid == pid), None)
            if known is not None:
                if known.standby and known.took_over is None and known.proc.poll() is None:
                    known.took_over = since
                    known.replaces_kill_at = killed_at.pop(name, None)
                continue
            try:
                proc = ForkedProc(pid)
            except psutil.NoSuchProcess:
                continue  # it ended already: the next one is read at the next call
            if not any(x.name == name and x.began is not None for x in self.lives):  # the node's first life:
                # under a --with-standby command it began with that command (its imports, the fork)
                since = next((x.started for x in self.lives if x.name == name and x.starts_node), since)
            life = Life(name, proc, since, standby=True, took_over=since, replaces_kill_at=killed_at.pop(name, None))
            self.lives.append(life)
            new.append(life)
        return new

    def waiting_standby(self, name: str) -> Life | None:
        """A running standby of node ``name`` that has not taken over, or None."""
        return next((x for x in self.lives if x.name == name and x.proc.poll() is None and x.standby
                     and x.took_over is None), None)

    def kill(self, life: Life, scheduled: bool = True) -> None:
        """SIGKILL the life's whole process group (its DHT, averager, p2pd and env server with it); ``scheduled``
        False: the bench's own cleanup at the end, not counted as a kill."""
        try:
            os.killpg(life.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        life.proc.wait(timeout=30)
        life.killed = scheduled

    def reap(self) -> list[Life]:
        """Record the end time of every life that has exited; returns the node lives (the node, not a standby still
        waiting) that ended on their own since the last call: not killed by the bench (an error, or the run's end)."""
        ended = []
        for life in self.lives:
            if life.ended is None and life.proc.poll() is not None:
                life.ended = time.time()
                if not life.killed and life.name != "coordinator" and life.began is not None:
                    ended.append(life)
        return ended


def coordinator_round(run_dir: Path) -> int:
    """The last round the coordinator recorded (-1: none yet)."""
    path = run_dir / "coordinator" / "metrics.jsonl"
    if not path.exists():
        return -1
    rounds = [json.loads(line)["round"] for line in path.read_text().splitlines() if line.strip()]
    return max(rounds, default=-1)


def session_processes(pids: set[int]) -> list[str]:
    """Processes still alive in the sessions (process groups) the run started: ``pid cmd`` each."""
    out = subprocess.run(["ps", "-eo", "pid,sid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    alive = []
    for line in out:
        parts = line.split(None, 2)
        if len(parts) >= 2 and int(parts[1]) in pids:
            alive.append(f"{parts[0]} {parts[2][:80] if len(parts) > 2 else ''}")
    return alive


def _stood_still(record: dict) -> float:
    """Seconds a node's inner loop stood still for the round's sync: ``blocked_seconds`` (with ``[outer] overlap``
    the sync runs under the next inner phase and only the wait for its theta stops the loop), else ``sync_seconds``
    (the metrics of a checkout older than ``blocked_seconds``)."""
    return float(record.get("blocked_seconds", record["sync_seconds"]))


def _inner_started(record: dict) -> float:
    """Wall time a node round's inner phase began: ``inner_started`` (a checkout older than it: the line's time less
    its inner phase and its standstill, which with ``[outer] overlap`` is a round late)."""
    if "inner_started" in record:
        return float(record["inner_started"])
    return record["time"] - record["inner_seconds"] - _stood_still(record)


def _inner_ended(record: dict) -> float:
    """Wall time a node round's inner phase ended: its start plus ``inner_seconds``."""
    return _inner_started(record) + record["inner_seconds"]


def _trained(record: dict) -> int:
    """A node round line's episodes in the all-reduce: its own and a resumed journal's (``resumed_samples``, and
    ``resent_samples``: a handed-off phase the round went on without, re-sent)."""
    return int(record["samples"]) + int(record.get("resumed_samples", 0)) + int(record.get("resent_samples", 0))


def _reached(record: dict) -> int:
    """A node round line's episodes that reached a model: `_trained`'s, and a landed phase's (``landed_samples``: of
    an earlier round, averaged in by its group with no line of its own)."""
    return _trained(record) + int(record.get("landed_samples", 0))


def _worked(record: dict) -> float:
    """A node round line's inner-loop seconds: its own phase's and a resumed journal's (spent by the life before: the
    cut phase's ``resumed_inner_seconds``, the re-sent phase's ``resent_inner_seconds``, and ``landed_inner_seconds``:
    a handed-off phase of an earlier round that its group averaged in, whose own line was lost with that life)."""
    return float(record["inner_seconds"]) + float(record.get("resumed_inner_seconds", 0.0)) + \
        float(record.get("resent_inner_seconds", 0.0)) + float(record.get("landed_inner_seconds", 0.0))


def _phase_ended(record: dict) -> float:
    """Wall time a node round's inner phase and its standstill ended: its inner phase's start, plus ``inner_seconds``,
    plus the seconds its sync stopped the loop. Not the line's ``time``: with ``[outer] overlap`` a round's line is
    written once its sync is done, under the next round's inner phase (at its fold, one phase later, before 7314e18),
    so a life's last line is later than the last work it records."""
    return _inner_ended(record) + _stood_still(record)


def summarize(churn: Churn, rounds: int) -> dict:
    """The report of the module docstring, from the lives and every peer's metrics lines."""
    from composer_diloco.metrics import read_metrics, replicas_agree, thetas_by_round

    records = read_metrics(churn.run_dir)
    canonical = _reached_model(records)  # the coordinator's rounds, and those it missed whose work it took on
    alive = inner = kept = sync = startup = tail = resumed = resent = landed = 0.0
    lives = [x for x in churn.lives if x.name != "coordinator" and x.began is not None]
    back_after: list[float] = []  # per kill: seconds from the kill to the first inner phase of the life after it
    joins: dict[str, list[dict]] = {}  # how a life joined -> the join's parts of each such life (`JOIN_PHASES`)
    for life in lives:
        end = life.ended or time.time()
        began = life.began
        alive += end - began
        mine = [r for r in records.get(life.name, []) if began <= r["time"] <= end + 1]
        inner += sum(_worked(r) for r in mine)
        resumed += sum(_worked(r) - r["inner_seconds"] for r in mine)
        resent += sum(float(r.get("resent_inner_seconds", 0.0)) for r in mine)
        landed += sum(float(r.get("landed_inner_seconds", 0.0)) for r in mine)
        kept += sum(_worked(r) for r in mine if canonical.get(r["round"]) == r["global_sha256"])
        sync += sum(_stood_still(r) for r in mine)
        if mine:
            first = min(_inner_started(r) for r in mine)
            opening = next((r for r in mine if "join_seconds" in r), None)
            if opening is not None:
                joins.setdefault(opening["joined_as"], []).append(opening["join_seconds"])
            startup += max(0.0, first - began)
            tail += max(0.0, end - max(_phase_ended(r) for r in mine))
            if life.replaces_kill_at is not None:
                back_after.append(first - life.replaces_kill_at)
        else:
            startup += end - began
    by_round = thetas_by_round(records)
    share = (lambda x: round(x / alive, 3)) if alive else (lambda x: None)
    blocked = _blocked(records, lives)
    unrecorded = _unrecorded_samples(records)
    return {
        "goodput": share(inner), "goodput_kept": share(kept),
        "node_seconds_alive": round(alive, 1), "inner_s": round(inner, 1),
        "where": {"inner": share(inner), "startup": share(startup), "sync": share(sync),
                  "lost": share(alive - inner - startup - sync), "resumed": share(resumed),
                  "resent": share(resent), "landed": share(landed)},
        # lost, split: after a life's last round line (the phases a kill cut, the run's shutdown; less what the next
        # life resumed of them, which lies there and is counted in inner) and the rest (the seconds between a life's
        # rounds that are neither inner phase nor blocked sync)
        "lost_after_last_round": share(tail - resumed),
        "lost_between_rounds": share(alive - inner - startup - sync - (tail - resumed)),
        "blocked_s": blocked,
        # the same goodput from the moment the last node began training (`_steady`): the run's first starts left out
        "steady": _steady(records, canonical, lives, time.time()),
        # sample weight the coordinator averaged in with no node line of that round: a life's overlapped phase whose
        # sync ended before a kill cut the next phase, when the line would have been written (`_unrecorded_samples`)
        "contributed_unrecorded_samples": unrecorded,
        "rounds": len(by_round), "coordinator_rounds": len({r["round"] for r in records.get("coordinator", [])}),
        "of": rounds,
        "agree": replicas_agree(records),
        "split_rounds": _split_rounds(records, by_round),
        "node_lives": len(lives),
        "node_kills": sum(1 for x in lives if x.killed),
        "standby_takeovers": sum(1 for x in lives if x.standby and x.took_over is not None),
        # kill -> the next life's first inner phase (a restart: + --restart-after-s and its whole start)
        "back_after_kill_s": sorted(round(x, 1) for x in back_after),
        "coordinator_kills": sum(1 for x in churn.lives if x.name == "coordinator" and x.killed),
        # where the joins went: per way of joining, how many lives and the median seconds of each part
        "join_seconds_median": {how: {"lives": len(parts), **_medians(parts)} for how, parts in sorted(joins.items())},
    }


def _split_rounds(records: dict[str, list[dict]], by_round: dict[int, set]) -> list[dict]:
    """The rounds whose records name more than one theta (``by_round``: `thetas_by_round`; what makes ``agree``
    false): each as ``{"round", "thetas", "healed"}``, ``healed`` being `round_table`'s ``sha_agree`` (every peer's
    last record of the round names one theta)."""
    from composer_diloco.metrics import round_table

    split = {r: len(shas) for r, shas in by_round.items() if len(shas) > 1}
    if not split:
        return []
    return [{"round": row["round"], "thetas": split[row["round"]], "healed": row["sha_agree"]}
            for row in round_table(records) if row["round"] in split]


def _blocked(records: dict[str, list[dict]], lives: list[Life], near_s: float = 15.0) -> dict:
    """The nodes' blocked sync seconds (`_stood_still`) over every round line: ``total``, ``over_2s`` (in lines blocked
    more than 2 s) and ``near_a_new_life`` (in lines whose inner phase ended within ``near_s`` seconds after another
    node's life began: the barrier waiting for a restart or a takeover)."""
    starts = [(x.name, x.began) for x in lives]
    total = over = near = 0.0
    for name, mine in records.items():
        for r in mine:
            if r.get("role") != "node":
                continue
            b = _stood_still(r)
            ended = _inner_ended(r)
            total += b
            over += b if b > 2.0 else 0.0
            near += b if any(n != name and 0.0 <= ended - t <= near_s for n, t in starts) else 0.0
    return {"total": round(total, 1), "over_2s": round(over, 1), "near_a_new_life": round(near, 1)}


def _steady(records: dict[str, list[dict]], canonical: dict[int, str], lives: list[Life], end: float) -> dict:
    """Goodput once the run is under way: from ``from`` (wall time, seconds since the epoch), the moment the last node
    began its first inner phase, to ``end``; inner-loop seconds of the phases that began after it over node-seconds
    alive after it. The first start of every node (its imports, its memory plan, its first join: a one-time cost of
    tens of seconds on this box, a share that depends only on how long the run is) is left out; every kill, takeover,
    restart and sync after it is in. ``{"from": None, ...}`` when some node never trained.

    Beside it the swarm's throughput over the same window (``from`` to the end of the last recorded inner phase):
    ``samples_per_s`` (episodes trained, every node together) and ``kept_samples_per_s`` (those of rounds whose theta
    reached the coordinator's model, ``canonical``: round -> that ``global_sha256``, `_reached_model`). On a box whose cores the nodes share, goodput alone misleads: a node waiting at the barrier
    leaves its core to the others, so a change that removes waits raises goodput while every step gets slower."""
    firsts = [min((_inner_started(r) for r in mine if r.get("role") == "node"), default=None)
              for name, mine in records.items() if name != "coordinator"]
    if not firsts or None in firsts:
        return {"from": None, "goodput": None, "node_seconds_alive": 0.0, "samples_per_s": None,
                "kept_samples_per_s": None}
    start = max(firsts)
    phases = [r for mine in records.values() for r in mine if r.get("role") == "node" and _inner_started(r) >= start]
    alive = sum(max(0.0, (x.ended or end) - max(x.began, start)) for x in lives)
    inner = sum(_worked(r) for r in phases)
    window = max((_inner_ended(r) for r in phases), default=start) - start
    samples = sum(_reached(r) for r in phases)
    kept = sum(_reached(r) for r in phases if canonical.get(r["round"]) == r["global_sha256"])
    per_s = (lambda x: round(x / window, 2)) if window > 0 else (lambda x: None)
    return {"from": round(start, 3), "goodput": round(inner / alive, 3) if alive else None,
            "node_seconds_alive": round(alive, 1), "samples_per_s": per_s(samples), "kept_samples_per_s": per_s(kept)}


def _reached_model(records: dict[str, list[dict]]) -> dict[int, str]:
    """Round -> the theta (``global_sha256``) whose work reached the coordinator's model: the coordinator's own lines,
    and a round it did not record (it was down) when the nodes' theta of that round is an ancestor of the theta the
    coordinator next recorded. That holds when, from that round to the coordinator's next round K, the node lines of
    each round name one theta, each round after it has a node line that says ``averaged`` (that theta is the outer
    step of the one before; a line that says ``resynced`` with the same theta is a node that took it from a peer),
    and the nodes' theta of round K is the coordinator's: it began round K from theirs (a restarted coordinator that
    resumes from a live node). A coordinator that came back with an older theta and made the nodes heal to it leaves
    no such chain, and their rounds meanwhile are not counted. (Before 2026-12-06 every node line of those rounds had
    to say ``averaged``: a resynced node with the group's theta broke the chain.)"""
    reached = {r["round"]: r["global_sha256"] for r in records.get("coordinator", [])}
    nodes: dict[int, list[dict]] = {}
    for r in (r for mine in records.values() for r in mine if r.get("role") == "node"):
        nodes.setdefault(r["round"], []).append(r)
    later = sorted(reached)
    for round_ in sorted(set(nodes) - set(reached)):
        k = next((x for x in later if x > round_), None)
        if k is None:
            continue
        chain = [nodes.get(j, []) for j in range(round_, k + 1)]
        if any(len({r["global_sha256"] for r in lines}) != 1 for lines in chain):
            continue  # a round no node recorded, or recorded with two thetas
        if not all(any(r.get("status") == "averaged" for r in lines) for lines in chain[1:]):
            continue  # a round no group averaged (all resynced, healed): the theta may come from elsewhere
        if chain[-1][0]["global_sha256"] == reached[k]:
            reached[round_] = chain[0][0]["global_sha256"]
    return reached


def _unrecorded_samples(records: dict[str, list[dict]]) -> int:
    """Samples the coordinator's rounds averaged in (``weight_total``) beyond those of the node lines that hold the
    same theta: the pseudo-gradients that reached the model from a phase no line records (with ``[outer] overlap`` a
    node writes a round's line at the first inner step after its sync landed, before 7314e18 at the end of the next
    phase: a kill in between leaves the phase unrecorded). A phase that a later life recorded as landed in round T
    (``landed_round``, ``landed_samples``: its journal's handed-off phase, which round T's group counted) is
    recorded."""
    nodes: dict[tuple[int, str], float] = {}
    landed: dict[int, int] = {}
    for name, mine in records.items():
        for r in mine:
            if r.get("role") == "node":
                nodes[(r["round"], r["global_sha256"])] = nodes.get((r["round"], r["global_sha256"]), 0) + _trained(r)
                if r.get("landed_round") is not None:
                    landed[r["landed_round"]] = landed.get(r["landed_round"], 0) + int(r.get("landed_samples", 0))
    return round(sum(max(0.0, c.get("weight_total", 0.0) - nodes.get((c["round"], c["global_sha256"]), 0.0)
                         - landed.get(c["round"], 0))
                     for c in records.get("coordinator", [])))


def _report_again(out: Path, rounds: int | None) -> int:
    """``--report``: summarize a finished run again from its ``churn.json`` (every life's times) and its metrics, with
    this checkout's `summarize`; prints the new summary's line, writes nothing."""
    saved = json.loads((out / "churn.json").read_text())
    churn = Churn(out.resolve(), rounds or saved["of"], "")
    for x in saved["lives"]:
        churn.lives.append(Life(x["name"], None, x["started"], x["ended"], x["killed"], x["standby"],
                                took_over=x["began"] if x["standby"] else None,
                                replaces_kill_at=x["replaces_kill_at"]))
    print(json.dumps(summarize(churn, churn.rounds)))
    return 0


def _medians(parts: list[dict]) -> dict:
    """The median seconds of each join part over ``parts`` (a part a life did not have counts as 0) and of their
    total, ``total``."""
    from statistics import median

    keys = sorted({k for p in parts for k in p})
    out = {k: round(median(p.get(k, 0.0) for p in parts), 2) for k in keys}
    out["total"] = round(median(sum(p.values()) for p in parts), 2)
    return out


def main() -> int:
    """The command line (module docstring); returns the exit code (1: the run did not complete or agree)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="run dir and churn.json")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--kill-every-s", type=float, default=25.0, help="0: no node is killed")
    ap.add_argument("--restart-after-s", type=float, default=2.0)
    ap.add_argument("--coordinator-kill-at-s", type=float, default=60.0, help="0: the coordinator is not killed")
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    ap.add_argument("--stall-s", type=float, default=90.0,
                    help="end the run when no node has been alive (and none is due to restart) for this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose code the peers run (default: this one)")
    ap.add_argument("--config", type=Path, default=None,
                    help="the run's TOML (default: the embedded default), e.g. one with [outer] overlap = true")
    ap.add_argument("--standby", action="store_true",
                    help="give each node a warm standby (module docstring); a kill takes the node's process only")
    ap.add_argument("--with-standby", action="store_true",
                    help="start each node under its warm standby, one command (`composer-node join --with-standby`: "
                         "the standby forks the first life too; that life counts from the command's start); implies "
                         "--standby")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: summarize the finished run in --out again (its churn.json and metrics)")
    a = ap.parse_args()
    a.standby = a.standby or a.with_standby
    if a.report:
        if not (a.out / "churn.json").is_file():
            ap.error(f"--report: {str(a.out / 'churn.json')!r} does not exist: --out must be a finished churn run")
        return _report_again(a.out, None)
    if a.out.exists() and any(a.out.iterdir()):
        ap.error(f"--out {str(a.out)!r} is not empty: pick a new folder (a run dir continues the run it holds)")
    a.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        listen = f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"
    if a.config is not None and not a.config.is_file():
        ap.error(f"--config {str(a.config)!r} is not a file")
    churn = Churn(a.out.resolve(), a.rounds, listen, a.code.resolve(),
                  a.config.resolve() if a.config is not None else None)
    rng = random.Random(a.seed)
    # the code under test's standby forks each life of its node (`nodes/fork.py`, 2026-12-06), or becomes the node
    forking = a.standby and (churn.code / "nodes" / "fork.py").is_file()
    names = [f"node-{i}" for i in range(a.nodes)]
    t0 = time.time()
    try:
        churn.peer = churn.start_coordinator()
        print(f"coordinator at {churn.peer}", flush=True)
        for name in names:
            if a.with_standby:
                churn.start_node(name, starts_node=True)
                continue
            churn.start_node(name)
            if a.standby:
                churn.start_node(name, standby=True)
        next_kill = t0 + a.kill_every_s if a.kill_every_s > 0 else float("inf")
        coordinator_kill = t0 + a.coordinator_kill_at_s if a.coordinator_kill_at_s > 0 else float("inf")
        pending: list[tuple[float, str]] = []  # (when, name) restarts
        killed_at: dict[str, float] = {}  # node -> when its last life was killed (no standby took over)
        nodes_seen = time.time()
        stalled = False
        unscheduled = 0  # node lives that ended on their own, not by the schedule (taken over by a standby, or left)
        while time.time() - t0 < a.timeout_s:
            time.sleep(0.5)
            exited = churn.reap()
            if a.standby:  # lives a standby forked (`nodes.standby.Standby.run_lives`), from node.pid
                churn.adopt_forked_lives(names, killed_at)
            coordinator = churn.live("coordinator")
            over = coordinator_round(a.out) >= a.rounds - 1
            for life in exited:  # a node that ended on its own (an error): with --standby, its standby takes over
                code = life.proc.returncode
                if code == 0 or over:
                    continue  # its run is over
                unscheduled += 1
                if a.standby and forking:  # its standby forks the next life itself
                    print(f"{time.time() - t0:6.1f} s  {life.name} ended on its own: its standby forks the next life",
                          flush=True)
                    continue
                spare = churn.waiting_standby(life.name) if a.standby else None
                if spare is not None:  # it holds the node's lock within LOCK_POLL_S, as after a kill; and the
                    spare.took_over = life.ended  # standby's supervisor starts a new one, as after a kill
                    pending.append((time.time() + a.restart_after_s, life.name))
                print(f"{time.time() - t0:6.1f} s  {life.name} exited {code} on its own"
                      f"{': its standby takes over' if spare else ' (not restarted: only kills are)'}", flush=True)
            if coordinator is None and not any(n == "coordinator" for _, n in pending):
                break  # the coordinator finished (or failed): the run is over
            now = time.time()
            if any(churn.live(n) for n in names) or any(n != "coordinator" for _, n in pending):
                nodes_seen = now
            elif now - nodes_seen > a.stall_s:  # every node exited on its own (e.g. no peer answered its --peer)
                print(f"{now - t0:6.1f} s  stalled: no node alive for {a.stall_s:.0f} s", flush=True)
                stalled = True
                break
            if not over and now >= coordinator_kill and coordinator is not None:
                churn.kill(coordinator)
                print(f"{now - t0:6.1f} s  killed the coordinator", flush=True)
                pending.append((now + a.restart_after_s, "coordinator"))
                coordinator_kill = float("inf")
            if not over and now >= next_kill:
                victims = [n for n in names if churn.live(n) is not None]
                if victims:
                    victim = rng.choice(victims)
                    churn.kill(churn.live(victim))
                    spare = churn.waiting_standby(victim) if a.standby else None
                    if spare is not None and not forking:  # it holds the node's lock within LOCK_POLL_S: its life
                        spare.took_over = spare.replaces_kill_at = time.time()  # starts now
                    else:  # a restart's, or the life the standby forks (`adopt_forked_lives`)
                        killed_at[victim] = time.time()
                    how = "" if spare is None else ": its standby forks its next life" if forking else \
                        ": its standby takes over"
                    print(f"{now - t0:6.1f} s  killed {victim}{how}", flush=True)
                    if spare is None or not forking:  # a restart, or the next standby of one that became the node
                        pending.append((now + a.restart_after_s, victim))
                next_kill = now + a.kill_every_s
            for when, name in [p for p in pending if p[0] <= now]:
                pending.remove((when, name))
                if name == "coordinator":
                    line = churn.start_coordinator()
                    print(f"{time.time() - t0:6.1f} s  restarted the coordinator: "
                          f"{'the same' if line == churn.peer else 'ANOTHER'} peer line", flush=True)
                elif not over:
                    spare = a.standby and churn.live(name) is not None  # a standby took over: start the next one
                    life = churn.start_node(name, standby=spare)
                    if not spare:
                        life.replaces_kill_at = killed_at.pop(name, None)
                    print(f"{time.time() - t0:6.1f} s  {'started a new standby of' if spare else 'restarted'} {name}",
                          flush=True)
        end_by = time.time() + (0 if stalled else 120)  # nodes still finishing their last round end on their own
        for life in churn.lives:
            try:
                life.proc.wait(timeout=max(0.1, end_by - time.time()))
            except subprocess.TimeoutExpired:
                pass
        churn.reap()
    finally:
        sessions = {x.proc.pid for x in churn.lives}
        for life in churn.lives:
            if life.proc.poll() is None:
                churn.kill(life, scheduled=False)
        churn.reap()
    time.sleep(2)
    report = {**summarize(churn, a.rounds), "stalled": stalled, "exits_on_their_own": unscheduled, "orphans": session_processes(sessions),
              "seconds": round(time.time() - t0, 1), "kill_every_s": a.kill_every_s,
              "coordinator_kill_at_s": a.coordinator_kill_at_s, "nodes": a.nodes, "code": str(a.code),
              "config": str(a.config) if a.config else None, "standby": a.standby, "with_standby": a.with_standby,
              "exit_codes": [(x.name, x.proc.returncode, x.killed) for x in churn.lives],
              # every life, wall times (seconds since the epoch): the report can be read again against the metrics
              "lives": [{"name": x.name, "started": x.started, "began": x.began, "ended": x.ended, "killed": x.killed,
                         "standby": x.standby, "replaces_kill_at": x.replaces_kill_at} for x in churn.lives]}
    (a.out / "churn.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("exit_codes", "lives")}))
    return 0 if report["rounds"] >= a.rounds and report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
