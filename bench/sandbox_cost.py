"""Time ``run_tests`` calls of an existing task in the coding sandbox (the cost of the sandbox per call).

Usage: ``PYTHONPATH=<tree> python bench/sandbox_cost.py [calls]``; prints the median and minimum wall-clock and CPU
milliseconds per call (CPU: this process and its children, user + system; steadier than the wall clock on a shared
machine) of the scripted solution of ``hw/slugify`` (passing tests) under the default limits and policy.
"""

from __future__ import annotations

import resource
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
    walls, cpus = [], []
    for _ in range(calls):
        cpu0, started = _cpu_s(), time.perf_counter()
        out = execute(task, files, "run_tests", {})
        walls.append(time.perf_counter() - started)
        cpus.append(_cpu_s() - cpu0)
        assert out.error_kind is None, out.content
    print(f"run_tests over {calls} calls: wall median {statistics.median(walls) * 1e3:.0f} ms, min "
          f"{min(walls) * 1e3:.0f} ms; CPU median {statistics.median(cpus) * 1e3:.0f} ms, min {min(cpus) * 1e3:.0f} ms")


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
