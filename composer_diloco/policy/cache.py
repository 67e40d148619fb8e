"""The per-user cache folder, and a get-or-build of one entry in it that is safe for concurrent processes and
crashes (the embedded default's warm start is paid once per machine, not once per run dir).

Where: ``$COMPOSER_DILOCO_CACHE`` if set, else ``$XDG_CACHE_HOME/composer_diloco``, else
``~/.cache/composer_diloco`` (the layout Hugging Face uses for ``~/.cache/huggingface``). Deleting the folder, or
any entry in it, is always safe: what is missing is computed again.

Safety (:func:`get_or_build`):

- one builder per entry: a file lock (``filelock``: an OS ``flock``, released by the kernel when its holder
  dies) beside the entry, ``.<name>.lock``; other processes asking for the entry wait for it, then reuse it;
- no half entry: the builder writes a temporary folder in the same parent and renames it to the entry (atomic), so
  a builder killed midway leaves a ``.<name>.tmp-*`` folder and no entry; the next builder removes such leftovers;
- a damaged entry (a missing or truncated file, unreadable JSON) is detected, logged as a WARNING, removed and
  built again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_root", "entry_problem", "get_or_build"]

logger = logging.getLogger(__name__)

CACHE_ENV = "COMPOSER_DILOCO_CACHE"
"""Environment variable naming the cache folder (overrides ``$XDG_CACHE_HOME/composer_diloco``)."""


def cache_root() -> Path:
    """The per-user cache folder (not created here).

    Returns:
        ``$COMPOSER_DILOCO_CACHE`` if set and non-empty, else ``$XDG_CACHE_HOME/composer_diloco`` if
        ``XDG_CACHE_HOME`` is set and non-empty, else ``~/.cache/composer_diloco``; ``~`` expanded, made absolute.
    """
    explicit = os.environ.get(CACHE_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "composer_diloco").absolute()


def entry_problem(entry: Path, required: Iterable[str]) -> str | None:
    """What is wrong with a cache entry, or None if it looks whole.

    Checks that ``entry`` is a directory holding every name of ``required`` as a non-empty file, that its
    ``*.json`` files parse and that its ``*.safetensors`` files are as long as their headers say (a truncated
    copy is caught without reading the tensors).

    Args:
        entry: the entry's directory.
        required: file names that must be there.

    Returns:
        None, or a short description of the first problem found (``"missing model.safetensors"``).
    """
    if not entry.is_dir():
        return "not a directory"
    for name in required:
        path = entry / name
        if not path.is_file() or path.stat().st_size == 0:
            return f"missing {name}" if not path.is_file() else f"empty {name}"
    for path in sorted(entry.glob("*.json")):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"unreadable {path.name} ({exc})"
    for path in sorted(entry.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path.name}: {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """None if ``path``'s length matches its safetensors header (8-byte length, JSON header, tensor data)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if 8 + header_len > size:
                return "truncated header"
            header = json.loads(f.read(header_len))
    except (OSError, ValueError) as exc:
        return f"unreadable header ({exc})"
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        return f"{size} bytes, the header describes {8 + header_len + end}"
    return None


def _remove(path: Path) -> None:
    """Remove a damaged entry: renamed aside first (atomic), so its name never holds a half-removed folder."""
    aside = path.with_name(f".{path.name}.broken-{os.getpid()}-{time.monotonic_ns()}")
    try:
        path.rename(aside)
    except OSError:
        aside = path
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def get_or_build(entry: str | os.PathLike[str], build: Callable[[Path], object], *,
                 required: Iterable[str] = ()) -> tuple[Path, bool]:
    """Return a whole cache entry, building it first if it is missing or damaged; one builder at a time.

    A whole entry is returned at once, without locking. Otherwise the caller takes the entry's file lock
    (``<parent>/.<name>.lock``, waiting as long as another process holds it, logged at INFO), looks again (the
    other process may have built it), removes a damaged entry with a WARNING and leftovers of killed builders
    (``.<name>.tmp-*``), then calls ``build(entry)``. ``build`` must create ``entry`` atomically: write a
    temporary folder named ``.<name>.tmp-*`` in the same parent and ``os.rename`` it to ``entry`` at the end (as
    ``composer_diloco.policy.warm_start`` does), and raise on failure.

    Args:
        entry: the entry's directory; its parent is created if needed.
        build: called with ``entry`` (a ``Path``) to create it.
        required: file names a whole entry holds (see :func:`entry_problem`).

    Returns:
        ``(entry, built)``: ``built`` is True if this call built the entry.

    Raises:
        RuntimeError: ``build`` returned but the entry is still missing or damaged.
        OSError: the parent or the lock file cannot be created.
        Exception: whatever ``build`` raises (the lock is released, no entry is left).
    """
    from filelock import FileLock, Timeout

    entry = Path(entry)
    required = tuple(required)
    if entry_problem(entry, required) is None:
        return entry, False
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(entry.parent / f".{entry.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("another process is building %s: waiting for it", entry)
        t0 = time.monotonic()
        lock.acquire()
        logger.info("waited %.1f s for %s", time.monotonic() - t0, entry)
    try:
        if entry.exists() or entry.is_symlink():
            problem = entry_problem(entry, required)
            if problem is None:
                return entry, False
            logger.warning("cache entry %s is damaged (%s): removing it and building it again", entry, problem)
            _remove(entry)
        for stale in entry.parent.glob(f".{entry.name}.tmp-*"):  # a killed builder's; we hold the lock
            logger.info("removing %s, left by an interrupted build", stale)
            shutil.rmtree(stale, ignore_errors=True)
        build(entry)
        problem = entry_problem(entry, required)
        if problem is not None:
            raise RuntimeError(f"building cache entry {entry} left it damaged: {problem}")
        return entry, True
    finally:
        lock.release()
