"""Time ``run_tests`` calls of an existing task in the coding sandbox (the cost of the sandbox per call).

Usage: ``PYTHONPATH=<tree> python tests/sandbox_cost.py [calls]``; prints the median and mean seconds per call of the
scripted solution of ``hw/slugify`` (passing tests) under the default limits and policy.
"""

from __future__ import annotations

import statistics
import sys
import time

from envs.coding_env import execute, make_task, solve
from envs.coding_env.sandbox import isolation


def main(calls: int = 10) -> None:
    """Run ``calls`` timed ``run_tests`` calls (after one untimed warm-up) and print the times."""
    task = make_task(0, "0", task_id="slugify")
    files = task.files()
    for tool, args in solve(task)[:2]:  # read_file, write_file: the reference solution
        execute(task, files, tool, args)
    print("isolation:", isolation())
    execute(task, files, "run_tests", {})
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        out = execute(task, files, "run_tests", {})
        times.append(time.perf_counter() - started)
        assert out.error_kind is None, out.content
    print(f"run_tests: median {statistics.median(times):.3f} s, mean {statistics.mean(times):.3f} s, "
          f"min {min(times):.3f} s over {calls} calls")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
