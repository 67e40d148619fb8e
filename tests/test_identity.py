"""Identities across restarts (issue 37): a key file in the coordinator's run dir and in each node's folder, checked
before any network; one coordinator per run dir, one node per folder. The restarts themselves (same command, same
peer ID; a node joining on the line printed before the kill) run in ``tests/test_faults.py``
(``test_coordinator_killed_nodes_go_on_and_it_reloads_from_a_live_node``) and ``tests/test_reaper.py`` (a node
restarted after a SIGKILL).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import prefork
from tests_support import error_line

from composer_diloco.outer.identity import IDENTITY_FILE, IdentityError, load_or_create_identity, try_lock

ROOT = Path(__file__).resolve().parents[1]


def test_an_identity_is_made_once_owner_only_and_read_back(tmp_path):
    path = tmp_path / IDENTITY_FILE
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert load_or_create_identity(path) == first  # the same key, the same peer ID
    assert sorted(p.name for p in tmp_path.iterdir()) == [IDENTITY_FILE]  # no temporary file left behind
    assert load_or_create_identity(tmp_path / "none.key", create=False) is None  # a check alone writes nothing
    assert not (tmp_path / "none.key").exists()
    from hivemind.p2p import PeerID

    assert PeerID.from_identity(path.read_bytes()).to_base58() == first  # what hivemind's daemon will announce


def test_a_bad_identity_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / IDENTITY_FILE
    load_or_create_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match=r"has mode 0644: a private key must be readable by its owner only "
                                            r"\(chmod 400 "):
        load_or_create_identity(path)
    os.chmod(path, 0o600)
    path.write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="is not a libp2p private key .*delete it to make a new identity"):
        load_or_create_identity(path)


@pytest.mark.timeout(120)
def test_the_coordinator_refuses_a_bad_identity_before_the_network(tmp_path):
    """A key readable by others: `composer-coordinator start` exits 1 with one line, before the DHT (no ``peer:``
    line) and before the model."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / IDENTITY_FILE).write_bytes(b"x")
    os.chmod(run_dir / IDENTITY_FILE, 0o644)
    r = prefork.run([sys.executable, "-m", "coordinator", "start", "--run-dir", str(run_dir)], cwd=ROOT,
                    capture_output=True, text=True, timeout=110)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "has mode 0644: a private key must be readable by its owner only" in error_line(r)
    assert "peer:" not in r.stdout and not (run_dir / "config.json").exists()


def test_one_coordinator_per_run_dir(tmp_path):
    """The run dir's lock: a second coordinator on it (so on its identity) is refused in one line; once the first
    lets go (its process ends: the OS drops the lock, even after SIGKILL) the next one takes it."""
    from composer_diloco.config import RunConfig
    from composer_diloco.lifecycle import GracefulStop
    from coordinator.coordinator import Coordinator, CoordinatorBusy, CoordinatorOptions

    first, second = (Coordinator(CoordinatorOptions(RunConfig(), tmp_path), GracefulStop()) for _ in range(2))
    first._lock_run_dir()
    with pytest.raises(CoordinatorBusy, match=f"--run-dir '{tmp_path}' is in use by another coordinator"):
        second._lock_run_dir()
    first.stop.run_cleanups()  # what its exit does
    second._lock_run_dir()
    second.stop.run_cleanups()


@pytest.mark.timeout(120)
def test_a_node_refuses_a_bad_identity_before_the_network(tmp_path):
    """A node's key that is not a key: `composer-node join` exits 1 with one line naming it, before the DHT (its
    ``--peer`` points at a port nobody listens on, so a dial would show as "no peer answered")."""
    own = tmp_path / "run" / "node-a"
    own.mkdir(parents=True)
    (own / IDENTITY_FILE).write_bytes(b"not a key")
    os.chmod(own / IDENTITY_FILE, 0o400)
    peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    r = prefork.run([sys.executable, "-m", "nodes", "join", "--peer", peer, "--run-dir", str(tmp_path / "run"),
                     "--name", "node-a", "--join-timeout", "5"], cwd=ROOT, capture_output=True, text=True,
                    timeout=110)
    assert r.returncode == 1, r.stderr[-2000:]
    line = error_line(r)
    assert f"identity file '{own / IDENTITY_FILE}' is not a libp2p private key" in line, line
    assert "no peer answered" not in r.stderr
    assert try_lock(own / "node.lock") is not None  # the folder it took first (nodes.folder_lock) is free again


def test_one_node_per_folder(tmp_path):
    """A second node with the same --run-dir and --name (so the same key) is refused in one line while the first
    holds the folder's lock; another --name is not."""
    from composer_diloco.lifecycle import GracefulStop
    from nodes.node import Node, NodeBusy
    from nodes.options import NodeOptions

    def node(name: str) -> Node:
        return Node(NodeOptions(peer="/ip4/127.0.0.1/tcp/9", run_dir=tmp_path, name=name), GracefulStop())

    first, second, other = node("node-a"), node("node-a"), node("node-b")
    first._lock_own_dir()
    with pytest.raises(NodeBusy, match=f"--name 'node-a' is in use in --run-dir '{tmp_path}' by another node"):
        second._lock_own_dir()
    other._lock_own_dir()
    for n in (first, other):
        n.stop.run_cleanups()
    second._lock_own_dir()
    second.stop.run_cleanups()
