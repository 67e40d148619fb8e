"""One peer of tests/test_averaging.py's mute-sender test, run as its own process: `tests/stall_peer.py`'s trio,
peer 2 with the fault ``mute_sender`` (one part to each reducer of the several of its share, then an open stream and
nothing more; its reducer refuses every sender). hivemind's own timer on a sender is 20 s here, so only the early ban
of a sender whose reducer stream broke (`composer_diloco.outer.averaging.BROKEN_SENDER_S`) ends the others' wait
within seconds."""

from stall_peer import main

if __name__ == "__main__":
    main("mute_sender:*", next_chunk_timeout=20.0, faulty_step_timeout=15.0, part_size_bytes=1 << 16,
         allreduce_timeout=25.0)
