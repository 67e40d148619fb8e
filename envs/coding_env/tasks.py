"""Coding tasks: write or fix one small Python function in ``solution.py`` (pure, no server, no sandbox).

Two sources:

- **hand-written**: `HANDWRITTEN`, loaded from ``tasks_data/handwritten.toml`` (61 tasks, "write" and "fix");
- **generated**: `FAMILIES`, five procedural families (``affine_fix``, ``filter_write``, ``string_write``,
  ``range_fix``, ``clamp_fix``) drawn from ``(seed, episode_id)``.

A task holds a correct reference ``solution.py``; every test's expected value is computed by running that reference
in this process (trusted code of the project, never the model's), and JSON-normalized (`normalize`). The visible
tests are rendered into ``test_solution.py``; the hidden tests are argument lists only: the sandbox returns the
model's outputs and `same_value` compares them here, so no expected output ever reaches the sandbox.

Everything is a pure function of ``(seed, episode_id)`` or of an explicit ``random.Random``.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "FUNCTION_NAMES",
    "HANDWRITTEN",
    "SOLUTION_FILE",
    "SOURCES",
    "TEST_FILE",
    "CodingTask",
    "load_handwritten",
    "make_task",
    "normalize",
    "render_tests",
    "same_value",
    "solve",
]

SOLUTION_FILE = "solution.py"
TEST_FILE = "test_solution.py"
SOURCES: tuple[str, ...] = ("mixed", "handwritten", "generated")
"""Where `make_task` draws from: both (half and half), the hand-written set only, or the families only."""

TASKS_FILE = Path(__file__).resolve().with_name("tasks_data") / "handwritten.toml"


def _set_default(obj: Any) -> Any:
    """JSON fallback: sets become sorted lists (as in ``sandbox_runner._to_json``)."""
    if isinstance(obj, (set, frozenset)):
        try:
            return sorted(obj)
        except TypeError:
            return sorted(obj, key=repr)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def normalize(value: Any) -> Any:
    """``value`` as it comes back from JSON: tuples become lists, dict keys strings, sets sorted lists.

    Raises:
        TypeError: for values JSON cannot hold (objects, functions).
    """
    return json.loads(json.dumps(value, default=_set_default, allow_nan=True))


def same_value(got: Any, expected: Any, rel_tol: float = 1e-6) -> bool:
    """Whether a JSON-normalized result equals the expected one.

    Floats (and int/float mixes) match within ``rel_tol`` relative (1e-9 absolute) tolerance; booleans match only
    booleans; lists and dicts match element-wise.
    """
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=rel_tol, abs_tol=1e-9)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(same_value(g, e, rel_tol) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k], rel_tol) for k in expected)
    return type(got) is type(expected) and got == expected


@dataclass(frozen=True)
class CodingTask:
    """One episode's task.

    Attributes:
        task_id: ``"hw/<id>"`` for a hand-written task, ``"gen/<family>/<hex>"`` for a generated one.
        family: ``"handwritten"`` or the generated family's name.
        kind: ``"write"`` (solution.py starts as a stub) or ``"fix"`` (it starts as buggy code).
        function: name of the function to write or fix.
        signature: its call signature, e.g. ``"slugify(text)"``.
        prompt: what the function must do.
        starter: the initial ``solution.py``.
        reference: a correct ``solution.py``.
        visible_args, hidden_args: argument lists of the visible and hidden tests.
        visible_expected, hidden_expected: the reference's results on them (raw; `normalize` before comparing).
    """

    task_id: str
    family: str
    kind: Literal["write", "fix"]
    function: str
    signature: str
    prompt: str
    starter: str
    reference: str
    visible_args: tuple[tuple[Any, ...], ...] = field(hash=False)
    hidden_args: tuple[tuple[Any, ...], ...] = field(hash=False)
    visible_expected: tuple[Any, ...] = field(hash=False)
    hidden_expected: tuple[Any, ...] = field(hash=False)

    @property
    def question(self) -> str:
        """The episode's user prompt: the task and how to work on it."""
        return (f"{self.prompt}\nFiles: {SOLUTION_FILE} (your code) and {TEST_FILE} (visible tests). "
                f"Check with run_tests, then submit; hidden tests decide the reward.")

    def files(self) -> dict[str, str]:
        """The initial workspace: path -> text."""
        return {SOLUTION_FILE: self.starter, TEST_FILE: render_tests(self)}


def _call_text(function: str, args: Sequence[Any]) -> str:
    return f"{function}({', '.join(repr(a) for a in args)})"


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_float(v) for v in value)
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    return False


_CLOSE_HELPER = '''

def _close(got, expected):
    """Equal, with floats compared to a relative tolerance of 1e-6."""
    if isinstance(expected, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and abs(got - expected) <= 1e-6 * max(1.0, abs(expected))
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(
            _close(g, e) for g, e in zip(got, expected))
    return got == expected
'''


def render_tests(task: CodingTask) -> str:
    """``test_solution.py``: one ``test_<n>`` function per visible case, with a message naming call and values."""
    floats = any(_has_float(e) for e in task.visible_expected)
    lines = ['"""Visible tests (run them with run_tests). Hidden tests check more cases at submit."""',
             f"from solution import {task.function}"]
    if floats:
        lines.append(_CLOSE_HELPER.rstrip("\n"))
    for index, (args, expected) in enumerate(zip(task.visible_args, task.visible_expected), start=1):
        call = _call_text(task.function, args)
        check = f"_close(got, {expected!r})" if floats else f"got == {expected!r}"
        lines += ["", "", f"def test_{index}():", f"    got = {call}",
                  f"    assert {check}, {call + ' returned '!r} + repr(got) + {', expected ' + repr(expected)!r}"]
    return "\n".join(lines) + "\n"


def _run_reference(source: str, function: str, cases: Sequence[Sequence[Any]]) -> tuple[Any, ...]:
    """Results of the reference solution on each case (our own code, run in this process)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reference {function}>", "exec"), namespace)  # noqa: S102 - the project's own code
    fn = namespace[function]
    return tuple(fn(*json.loads(json.dumps(list(args)))) for args in cases)


def _build(task_id: str, family: str, kind: str, signature: str, prompt: str, starter: str | None,
           reference: str, visible: Sequence[Sequence[Any]], hidden: Sequence[Sequence[Any]]) -> CodingTask:
    """A `CodingTask` with expected values computed from ``reference``; a stub starter for "write" tasks."""
    function = signature.split("(", 1)[0].strip()
    if kind not in ("write", "fix"):
        raise ValueError(f"task {task_id}: kind must be 'write' or 'fix', got {kind!r}")
    if kind == "fix" and not starter:
        raise ValueError(f"task {task_id}: a 'fix' task needs a starter")
    if starter is None or kind == "write":
        starter = f"def {signature}:\n    # TODO: {prompt.split(': ', 1)[-1]}\n    raise NotImplementedError\n"
    if not visible or not hidden:
        raise ValueError(f"task {task_id}: needs visible and hidden tests")
    visible_args = tuple(tuple(a) for a in visible)
    hidden_args = tuple(tuple(a) for a in hidden)
    return CodingTask(
        task_id=task_id, family=family, kind=kind, function=function, signature=signature, prompt=prompt,
        starter=starter.lstrip("\n"), reference=reference.lstrip("\n"),
        visible_args=visible_args, hidden_args=hidden_args,
        visible_expected=_run_reference(reference, function, visible_args),
        hidden_expected=_run_reference(reference, function, hidden_args),
    )


def load_handwritten(path: Path = TASKS_FILE) -> tuple[CodingTask, ...]:
    """Load the hand-written tasks (see the header of ``tasks_data/handwritten.toml`` for the format).

    Raises:
        ValueError: naming the task, for a missing field, a duplicate id, a bad kind, or a reference that fails.
    """
    with open(path, "rb") as fh:
        entries = tomllib.load(fh).get("task", [])
    tasks, seen = [], set()
    for number, entry in enumerate(entries):
        task_id = entry.get("id", f"#{number}")
        if task_id in seen:
            raise ValueError(f"{path.name}: duplicate task id {task_id!r}")
        seen.add(task_id)
        try:
            tasks.append(_build(f"hw/{task_id}", "handwritten", entry["kind"], entry["signature"],
                                entry["prompt"], entry.get("starter"), entry["solution"], entry["visible"],
                                entry["hidden"]))
        except KeyError as exc:
            raise ValueError(f"{path.name}: task {task_id!r} lacks field {exc}") from None
        except Exception as exc:
            raise ValueError(f"{path.name}: task {task_id!r}: {type(exc).__name__}: {exc}") from exc
    return tuple(tasks)


HANDWRITTEN: tuple[CodingTask, ...] = load_handwritten()
"""The hand-written tasks shipped with the project, in file order."""
_BY_ID = {t.task_id: t for t in HANDWRITTEN}


# ------------------------------------------------------------------------------------------- generated families


_AFFINE_NAMES = ("scale", "score", "price", "adjust")
_FILTER_NAMES = ("keep", "select", "pick")
_STRING_NAMES = ("transform", "convert", "encode")
FUNCTION_NAMES: tuple[str, ...] = _AFFINE_NAMES + _FILTER_NAMES + _STRING_NAMES + ("total", "count_multiples", "clamp")
"""Every function name the generated families use (the embedded policy's tokenizer has each as one token)."""


def _ints(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randint(lo, hi)] for _ in range(n)]


def _affine_fix(rng: random.Random, tag: str) -> CodingTask:
    a = rng.randint(2, 9)
    b = rng.choice([v for v in range(1, 10) if v != a])  # a != b: every bug below changes the result
    name = rng.choice(_AFFINE_NAMES)
    bug = rng.choice((f"{a} * x - {b}", f"{b} * x + {a}", f"{a} * x + {b + 1}", f"{a} + x * {b}"))
    return _build(
        f"gen/affine_fix/{tag}", "affine_fix", "fix", f"{name}(x)",
        f"Fix {name}(x): it must return {a} * x + {b}.",
        f"def {name}(x):\n    return {bug}\n", f"def {name}(x):\n    return {a} * x + {b}\n",
        _ints(rng, 3, -5, 10), _ints(rng, 8, -50, 50),
    )


_CONDITIONS: list[tuple[str, str]] = [
    ("divisible by {k}", "x % {k} == 0"),
    ("greater than {t}", "x > {t}"),
    ("odd", "x % 2 == 1"),
    ("even", "x % 2 == 0"),
    ("negative", "x < 0"),
    ("at most {t}", "x <= {t}"),
]


def _int_lists(rng: random.Random, n: int) -> list[list[list[int]]]:
    return [[[rng.randint(-10, 20) for _ in range(rng.randint(0, 8))]] for _ in range(n)]


def _filter_write(rng: random.Random, tag: str) -> CodingTask:
    words, test = rng.choice(_CONDITIONS)
    k, t = rng.randint(2, 5), rng.randint(-3, 6)
    words, test = words.format(k=k, t=t), test.format(k=k, t=t)
    name = rng.choice(_FILTER_NAMES)
    return _build(
        f"gen/filter_write/{tag}", "filter_write", "write", f"{name}(xs)",
        f"Write {name}(xs): the items of the list of integers xs that are {words}, in order.", None,
        f"def {name}(xs):\n    return [x for x in xs if {test}]\n",
        [[[rng.randint(-10, 20) for _ in range(5)]] for _ in range(3)], _int_lists(rng, 8),
    )


_WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "quiet", "zebra", "hello", "world", "ocean", "pixel")


def _strings(rng: random.Random, n: int) -> list[list[str]]:
    return [[" ".join(rng.sample(_WORDS, rng.randint(1, 3)))] for _ in range(n)]


def _string_write(rng: random.Random, tag: str) -> CodingTask:
    k = rng.randint(2, 3)
    c = rng.choice("*#_")
    shift = rng.randint(1, 5)
    ops = [
        (f"every character of s repeated {k} times, e.g. 'ab' -> '{'a' * k}{'b' * k}'",
         f"    return ''.join(ch * {k} for ch in s)\n"),
        ("the words of s (split on spaces) in reverse order, joined by single spaces",
         "    return ' '.join(reversed(s.split()))\n"),
        (f"s with every vowel (a, e, i, o, u) replaced by '{c}'",
         f"    return ''.join('{c}' if ch in 'aeiou' else ch for ch in s)\n"),
        (f"every {('second', 'third')[k - 2]} character of s, starting with the first",
         f"    return s[::{k}]\n"),
        (f"s with each lowercase letter shifted {shift} places forward in the alphabet (z wraps to a); other "
         "characters unchanged",
         f"    return ''.join(chr((ord(ch) - 97 + {shift}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in s)\n"),
    ]
    words, body = rng.choice(ops)
    name = rng.choice(_STRING_NAMES)
    return _build(
        f"gen/string_write/{tag}", "string_write", "write", f"{name}(s)", f"Write {name}(s): {words}.", None,
        f"def {name}(s):\n{body}", _strings(rng, 3), _strings(rng, 7) + [[""]],
    )


def _range_fix(rng: random.Random, tag: str) -> CodingTask:
    lo, k = rng.randint(0, 3), rng.randint(2, 5)
    if rng.random() < 0.5:
        return _build(
            f"gen/range_fix/{tag}", "range_fix", "fix", "total(n)",
            f"Fix total(n): the sum of the integers from {lo} to n inclusive (0 when n < {lo}).",
            f"def total(n):\n    return sum(range({lo}, n))\n", f"def total(n):\n    return sum(range({lo}, n + 1))\n",
            _ints(rng, 3, lo + 1, 12), _ints(rng, 7, lo, 60) + [[lo - 1]],
        )
    return _build(
        f"gen/range_fix/{tag}", "range_fix", "fix", "count_multiples(n)",
        f"Fix count_multiples(n): how many multiples of {k} lie between 1 and n inclusive.",
        f"def count_multiples(n):\n    return len([i for i in range(1, n) if i % {k} == 0])\n",
        f"def count_multiples(n):\n    return len([i for i in range(1, n + 1) if i % {k} == 0])\n",
        [[k * rng.randint(1, 4)] for _ in range(3)], _ints(rng, 5, 0, 60) + [[k], [k * 7], [0]],
    )


def _clamp_fix(rng: random.Random, tag: str) -> CodingTask:
    lo = rng.randint(-10, 5)
    hi = lo + rng.randint(3, 15)
    return _build(
        f"gen/clamp_fix/{tag}", "clamp_fix", "fix", "clamp(x)",
        f"Fix clamp(x): x limited to the range [{lo}, {hi}].",
        f"def clamp(x):\n    return min({lo}, max({hi}, x))\n", f"def clamp(x):\n    return max({lo}, min({hi}, x))\n",
        [[lo - 3], [hi + 2], [(lo + hi) // 2]], _ints(rng, 6, lo - 20, hi + 20) + [[lo], [hi]],
    )


FAMILIES: dict[str, Callable[[random.Random, str], CodingTask]] = {
    "affine_fix": _affine_fix,
    "filter_write": _filter_write,
    "string_write": _string_write,
    "range_fix": _range_fix,
    "clamp_fix": _clamp_fix,
}
"""Generated task families: name -> ``(rng, tag) -> CodingTask``."""


def make_task(seed: int, episode_id: str, source: str = "mixed", task_id: str | None = None) -> CodingTask:
    """The task of episode ``(seed, episode_id)``; the same arguments always give the same task.

    Args:
        seed: run-level seed (any int).
        episode_id: episode identifier; combined with ``seed`` into a private RNG.
        source: one of `SOURCES`: ``"mixed"`` (a hand-written task or a generated one, half and half),
            ``"handwritten"`` or ``"generated"``; or ``"gen/<family>"`` for one family.
        task_id: a hand-written task's id (``"slugify"`` or ``"hw/slugify"``); overrides ``source``.

    Raises:
        ValueError: for an unknown ``source`` or ``task_id``.
    """
    if task_id is not None:
        key = task_id if task_id.startswith("hw/") else f"hw/{task_id}"
        if key not in _BY_ID:
            raise ValueError(f"unknown task_id {task_id!r}; hand-written ids are e.g. "
                             f"{', '.join(t.task_id[3:] for t in HANDWRITTEN[:5])}, ...")
        return _BY_ID[key]
    rng = random.Random(f"{seed}:{episode_id}")
    tag = f"{rng.getrandbits(32):08x}"
    if source.startswith("gen/"):
        family = source[4:]
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
        return FAMILIES[family](rng, tag)
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES} or gen/<family>")
    handwritten = source == "handwritten" or (source == "mixed" and rng.random() < 0.5)
    if handwritten:
        return rng.choice(HANDWRITTEN)
    return FAMILIES[rng.choice(sorted(FAMILIES))](rng, tag)


def solve(task: CodingTask) -> list[tuple[str, dict[str, Any]]]:
    """Scripted solver: read the code, write the reference solution, run the visible tests, submit."""
    return [
        ("read_file", {"path": SOLUTION_FILE}),
        ("write_file", {"path": SOLUTION_FILE, "content": task.reference}),
        ("run_tests", {}),
        ("submit", {}),
    ]
