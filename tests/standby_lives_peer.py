"""A standby that forks its node's lives (`nodes.standby.Standby.run_lives`), run as its own process by
tests/test_standby.py, with a life that does not train: each life writes what it saw to ``OWN/lives.jsonl`` and ends
the way ``--ending`` says, so the standby's own part (the fork, the lock's hand-over, the next life, its exit code) is
checked in seconds.

    python tests/standby_lives_peer.py OWN_DIR --ending killed,killed,finished
    python tests/standby_lives_peer.py OWN_DIR --ending failed          (every life exits 1 before any round line)
    python tests/standby_lives_peer.py OWN_DIR --ending wait           (every life waits for its stop: exits 130)
    python tests/standby_lives_peer.py OWN_DIR --starts-node ...       (``--with-standby``: the process takes the
                                                                        folder and forks the first life at once)

Endings, one per life (the last one repeats): ``killed`` (SIGKILL of its own process group), ``finished`` (the run's
end: `nodes.standby.mark_finished`, exit 0), ``nothing`` (the run's end with "trained on nothing": marked finished with
that error, exit 1), ``failed`` (exit 1), ``wait`` (until its SIGTERM, then 130). No node runs
under the name, so the standby takes the folder after ``--alone-after-s`` and forks the first life (with
``--starts-node``, at once: ``--alone-after-s`` is then 60 s, which the test would notice).
"""

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from composer_diloco.lifecycle import GracefulStop
from composer_diloco.outer.identity import try_lock
from nodes.folder_lock import LOCK_FILE
from nodes.standby import Standby, mark_finished


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("own_dir", type=Path)
    ap.add_argument("--ending", default="finished")
    ap.add_argument("--alone-after-s", type=float, default=0.5)
    ap.add_argument("--starts-node", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(process)d %(message)s")
    endings = a.ending.split(",")
    a.own_dir.mkdir(parents=True, exist_ok=True)

    def life(lock, prepared, stop: GracefulStop) -> int:
        n = sum(1 for _ in open(a.own_dir / "lives.jsonl")) if (a.own_dir / "lives.jsonl").exists() else 0
        ending = endings[min(n, len(endings) - 1)]
        import torch

        seen = {"life": n + 1, "pid": os.getpid(), "parent": os.getppid(), "own_session": os.getsid(0) == os.getpid(),
                "holds_lock": lock.held, "another_open_file_can_lock": try_lock(a.own_dir / LOCK_FILE) is not None,
                "torch_threads": torch.get_num_threads(), "prepared": prepared is not None, "ending": ending,
                "first_life": standby.starting_first_life}
        # close this life's descriptor without unlocking: the lock is free only once the standby closed its own
        # descriptor of the same open file too (`FileLockHeld.hand_over` right after the fork)
        lock.hand_over()
        deadline, again = time.monotonic() + 5.0, None
        while again is None and time.monotonic() < deadline:
            again = try_lock(a.own_dir / LOCK_FILE)
            time.sleep(0.02)
        seen["standby_let_go"] = again is not None  # and this life holds the folder again, for the rest of it
        with open(a.own_dir / "lives.jsonl", "a") as f:
            f.write(json.dumps(seen) + "\n")
        if ending == "killed":
            os.killpg(os.getpid(), signal.SIGKILL)
        if ending == "finished":
            mark_finished(a.own_dir, 1)
            return 0
        if ending == "nothing":
            mark_finished(a.own_dir, 1, error="trained on nothing: no episode of 1 round(s) produced a parsed tool call")
            return 1
        if ending == "wait":
            stop.event.wait(60)
            return 130
        return 1

    import torch

    torch.set_num_threads(2)  # what each life must get back: the standby itself waits at 1 (`nodes.fork`)
    first_life_lock = try_lock(a.own_dir / LOCK_FILE) if a.starts_node else None
    standby = Standby(a.own_dir, GracefulStop().install(), own_env_server=False,
                      alone_after_s=60.0 if a.starts_node else a.alone_after_s, first_life_lock=first_life_lock)
    code = standby.run_lives(life)
    print(json.dumps({"standby_exit": code, "standby_torch_threads": torch.get_num_threads()}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
