"""``peers.json`` (`composer_diloco.outer.known_peers`): what a restarted coordinator or node dials besides its
``--peer``s. A node's file counts only on the ``--peer`` line it was written under, so a run dir reused for another
run never merges the two runs' DHTs."""

from composer_diloco.outer.known_peers import read_known_peers, write_known_peers

LINE = "/ip4/127.0.0.1/tcp/4000/p2p/QmCoordinator"
NODE_0 = "/ip4/127.0.0.1/tcp/4001/p2p/QmNode0"
NODE_1 = "/ip4/127.0.0.1/tcp/4002/p2p/QmNode1"


def test_a_nodes_peers_are_dialed_only_on_the_line_it_was_started_on(tmp_path):
    path = tmp_path / "peers.json"
    write_known_peers(path, [NODE_1, NODE_0, NODE_0], started_on=[LINE])
    assert read_known_peers(path, started_on=[LINE]) == [NODE_0, NODE_1]
    assert read_known_peers(path, started_on=["/ip4/10.0.0.9/tcp/4000/p2p/QmAnotherRun"]) == []
    assert read_known_peers(path, started_on=["/ip4/10.0.0.9/tcp/4000/p2p/QmAnotherRun", LINE]) == [NODE_0, NODE_1]


def test_the_coordinators_list_and_a_missing_or_damaged_file(tmp_path):
    path = tmp_path / "peers.json"
    assert read_known_peers(path) == []
    write_known_peers(path, [NODE_0])
    assert read_known_peers(path) == [NODE_0]
    path.write_text("{not json")
    assert read_known_peers(path) == []
    path.write_text('[4, "' + NODE_1 + '"]')
    assert read_known_peers(path) == [NODE_1]


def test_threads_writing_one_file_never_rename_each_others_temporary_away(tmp_path):
    """The coordinator writes peers.json from its round loop and its idle watcher: with one temporary name per
    process, one thread's rename took the other's file and the other's rename failed (ENOENT; it ended a coordinator
    in CI). 4 threads x 300 writes here failed 491 times before."""
    import threading

    from composer_diloco.checkpoint import write_atomic

    errors: list[OSError] = []

    def write(i: int) -> None:
        for k in range(300):
            try:
                write_atomic(tmp_path / "peers.json", f"[{i}, {k}]")
            except OSError as e:
                errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and [p.name for p in tmp_path.iterdir()] == ["peers.json"]
