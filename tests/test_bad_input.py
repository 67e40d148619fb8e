"""Bad input: one line naming the bad value, a non-zero exit, and nothing half-written."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import prefork
from tests_support import error_line, imported_modules

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout_s: float = 120, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return prefork.run([sys.executable, *python, "-m", *args], capture_output=True, text=True, timeout=timeout_s,
                       cwd=ROOT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["start", "simulate"])
def test_missing_config_file(tmp_path, command):
    r = run("coordinator", command, "--config", str(tmp_path / "nope.toml"), "--run-dir", str(tmp_path / "run"),
            python=("-X", "importtime"))
    assert r.returncode != 0 and "nope.toml" in error_line(r) and "does not exist" in error_line(r)
    assert not (tmp_path / "run").exists()
    assert not {"torch", "hivemind"} & imported_modules(r)  # refused before the heavy imports


@pytest.mark.timeout(120)
def test_invalid_config_names_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[outer]\nmomentum = 1.5\n")
    r = run("coordinator", "simulate", "--config", str(bad), "--run-dir", str(tmp_path / "run"),
            python=("-X", "importtime"))
    assert r.returncode != 0 and "outer.momentum" in error_line(r)
    assert not {"torch", "hivemind"} & imported_modules(r)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer, expected", [
    ("localhost:4000", "--peer 'localhost:4000' is not a multiaddr"),
    ("/ip4/127.0.0.1/tcp/4000", "has no /p2p/<peer id> part"),
])
def test_peer_that_is_not_a_multiaddr(tmp_path, peer, expected):
    r = run("nodes", "join", "--peer", peer, "--run-dir", str(tmp_path), python=("-X", "importtime"))
    assert r.returncode == 1 and expected in error_line(r), error_line(r)
    assert not {"torch", "hivemind"} & imported_modules(r)  # refused before the heavy imports


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command, option, value, expected", [
    ("nodes", "--listen", "0.0.0.0:4001", "--listen '0.0.0.0:4001' is not a multiaddr"),
    ("nodes", "--announce", "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
     "names a peer id"),
    ("coordinator", "--listen", "0.0.0.0:4001", "--listen '0.0.0.0:4001' is not a multiaddr"),
    ("coordinator", "--announce", "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
     "names a peer id"),
])
def test_listen_or_announce_that_is_not_an_address(tmp_path, command, option, value, expected):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    args = ["join", "--peer", dead] if command == "nodes" else ["start"]
    r = run(command, *args, option, value, "--run-dir", str(tmp_path / "run"), python=("-X", "importtime"))
    assert r.returncode == 1 and expected in error_line(r), error_line(r)
    assert not {"torch", "hivemind"} & imported_modules(r)  # refused before the heavy imports (and any network)
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option, value, expected", [
    ("--join-deadline", "ten", "--join-deadline 'ten': expected seconds > 0 (e.g. 900), or auto"),
    ("--join-deadline", "-5", "--join-deadline '-5': expected seconds > 0"),
    ("--state-chunk-size", "8 MB/s", "--state-chunk-size '8 MB/s': expected a size such as 8MiB"),
    ("--state-chunk-size", "1KiB", "--state-chunk-size '1KiB' is 1024 bytes: expected 64KiB to 256MiB"),
])
def test_join_deadline_or_chunk_size_of_the_wrong_form(tmp_path, option, value, expected):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    r = run("nodes", "join", "--peer", dead, option, value, "--run-dir", str(tmp_path / "run"),
            python=("-X", "importtime"))
    assert r.returncode == 1 and expected in error_line(r), r.stderr[-2000:]
    assert not {"torch", "hivemind"} & imported_modules(r)  # refused before the heavy imports (and any network)
    assert not (tmp_path / "run").exists()


def test_join_deadline_and_chunk_size_forms_that_parse():
    from nodes.options import parse_chunk_size, parse_join_deadline

    assert parse_join_deadline("auto") is None and parse_join_deadline("900") == 900.0
    assert parse_chunk_size("8MiB") == 8 * 2**20 and parse_chunk_size("4 MB") == 4_000_000
    assert parse_chunk_size("65536") == 65536 and parse_chunk_size("256MiB") == 256 * 2**20


def test_swarm_parses_what_the_form_check_lets_through():
    """The form check (no hivemind) and hivemind's parser together: a well-formed --peer parses; one that passes
    the form check but is not a multiaddr is still refused, by the parser, in one line."""
    from composer_diloco.outer.swarm import SwarmError, parse_multiaddr

    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    assert str(parse_multiaddr(dead)) == dead
    with pytest.raises(SwarmError, match=r"--peer '/ip4/not-an-ip/tcp/9/p2p/12D3KooW.*' is not a multiaddr"):
        parse_multiaddr("/ip4/not-an-ip/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN")


@pytest.mark.timeout(120)
def test_peer_where_no_one_answers(tmp_path):
    """Two ``--peer``s, neither answering: the node re-dials them (a WARNING saying so) until ``--join-timeout``,
    then exits 1 with one line naming both (issue 37: a node started before its coordinator waits for it)."""
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    dead2 = "/ip4/127.0.0.1/tcp/7/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    started = time.monotonic()
    r = run("nodes", "join", "--peer", dead, "--peer", dead2, "--run-dir", str(tmp_path), "--join-timeout", "5")
    assert r.returncode == 1 and "no peer answered" in error_line(r)
    assert "tcp/9" in error_line(r) and "tcp/7" in error_line(r)
    assert "dialing again for" in " ".join(r.stderr.split()), r.stderr
    assert time.monotonic() - started >= 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, expected", [
    (["--with-standby"], "--with-standby needs the --name"),
    (["--standby"], "--standby needs the --name"),
    (["--standby", "--with-standby", "--name", "node-a"], "--standby and --with-standby exclude each other"),
])
def test_standby_flags_without_a_name_or_together(tmp_path, flags, expected):
    """A standby's lives must be one peer (a stable ``--name``), and a process is a standby beside a node or the
    node's own launcher, not both: one line, exit 1, before the heavy imports and with nothing written."""
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    r = run("nodes", "join", "--peer", dead, "--run-dir", str(tmp_path / "run"), *flags, python=("-X", "importtime"))
    assert r.returncode == 1 and expected in error_line(r), r.stderr[-2000:]
    assert not {"torch", "hivemind"} & imported_modules(r) and not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["start", "simulate"])
def test_model_that_does_not_exist(tmp_path, command):
    r = run("coordinator", command, "--model", str(tmp_path / "no-such-model"), "--run-dir", str(tmp_path / "run"),
            python=("-X", "importtime"))
    assert r.returncode == 1 and "no-such-model" in error_line(r) and "no such directory" in error_line(r)
    assert not {"torch", "hivemind", "transformers"} & imported_modules(r)  # refused before the heavy imports
    assert not (tmp_path / "run").exists()




@pytest.mark.timeout(240)
def test_episodes_longer_than_the_model_s_context_are_refused_before_the_network(tmp_path, warm_cache):
    """``max_seq_len`` past the policy's positions (the embedded default's 2048): one line naming both, exit 1, before
    the DHT starts, nothing written in the run dir."""
    config = tmp_path / "long.toml"
    config.write_text("max_seq_len = 4096\n[warmstart]\nsteps = 200\n")
    r = run("coordinator", "start", "--config", str(config), "--run-dir", str(tmp_path / "run"), timeout_s=200)
    line = error_line(r)
    assert r.returncode == 1 and "max_seq_len = 4096" in line and "2048 positions" in line, r.stderr[-2000:]
    assert "peer:" not in r.stdout
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file()]  # no config.json, no checkpoint
