"""A peer's libp2p identity kept in a file, so that a restart prints the same ``peer:`` line.

hivemind takes a private key file as ``identity_path`` (``hivemind.DHT(..., identity_path=...)``, passed to
``hivemind.p2p.P2P.create``): the peer ID is the hash of its public key, so the same file gives the same peer ID, and
with the same ``--listen`` the same multiaddr. The coordinator keeps its key in its run dir (`IDENTITY_FILE`), made
on the first start with owner-only permissions (0400, as hivemind's own ``P2P.generate_identity``), written whole or
not at all; every later start with that run dir reads it. INTELLECT-1 and OpenDiLoCo keep a stable bootstrap address
the same way; torchft's Lighthouse is one fixed address every replica dials back. A node keeps its key in its own
folder, ``<run-dir>/<name>/``, so a node restarted with the same ``--name`` is the same peer to the others (a node
without ``--name`` is named after its pid, hence a new peer every start).

Rotating an identity on purpose: stop the coordinator, delete the file, start it again; it makes a new key and
prints a new ``peer:`` line, which every node must then be given. Two processes on one identity: a second
coordinator on the same run dir is refused while the first holds the run dir's lock (``coordinator.lock``), a second
node with the same run dir and name while the first holds ``<name>/node.lock``; a copied key used elsewhere is refused by hivemind when the first peer is reachable from the second's initial peers ("identity
... is already taken").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["IDENTITY_FILE", "FileLockHeld", "IdentityError", "load_or_create_identity", "try_lock"]

IDENTITY_FILE = "identity.key"
"""A peer's private key file: the coordinator's in its run dir, a node's in ``<run-dir>/<name>/``."""


class IdentityError(RuntimeError):
    """An identity file that cannot be used: readable by others, not a libp2p private key, or not writable."""


def _peer_id(data: bytes, path: Path) -> str:
    """The base58 peer ID of a serialized libp2p private key; IdentityError when the bytes are not one."""
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_identity(data).to_base58()
    except Exception as e:  # protobuf's DecodeError, cryptography's ValueError, ...
        raise IdentityError(f"identity file {str(path)!r} is not a libp2p private key ({type(e).__name__}): delete "
                            f"it to make a new identity (the peer: line changes), or restore the original") from None


def load_or_create_identity(path: str | os.PathLike[str], *, create: bool = True) -> str | None:
    """Check the identity file at ``path``, or make one; returns its peer ID (base58, ``12D3KooW...`` or ``Qm...``).

    A new key is hivemind's (RSA, in libp2p's ``crypto_pb2.PrivateKey`` protobuf), written to a temporary file in
    the same folder with mode 0400 and renamed into place, so a crash leaves either no file or a whole one.
    ``create=False`` only checks a file that exists (None when there is none): a start that fails later writes
    nothing.

    Raises:
        IdentityError: the file exists and grants any permission to group or others (one line naming its mode and
            the ``chmod`` that fixes it), or is not a libp2p private key, or cannot be read or written.
    """
    path = Path(path)
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(f"identity file {str(path)!r} has mode {mode:04o}: a private key must be readable by "
                                f"its owner only (chmod 400 {str(path)!r})")
        try:
            return _peer_id(path.read_bytes(), path)
        except OSError as e:
            raise IdentityError(f"identity file {str(path)!r} cannot be read: {e.strerror}") from None
    if not create:
        return None
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise IdentityError(f"cannot write identity file {str(path)!r}: {e.strerror}") from None
    return _peer_id(key, path)


class FileLockHeld:
    """An exclusive ``flock(2)`` lock on a file, held through one open file description: the kernel drops it when
    `release` is called or when the last descriptor of that description closes, so a process's exit, SIGKILL and an
    OOM kill included, lets it go. A child forked while it is held shares the description, hence the lock
    (`hand_over`). Made by `try_lock`.

    (The project once held these locks with ``filelock.FileLock``, which takes the same ``flock``; a forked life of a
    standby, `nodes.standby`, needs the descriptor itself, which filelock keeps private.)

    Attributes:
        path: the lock file.
    """

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock (neither released nor handed over)."""
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close the descriptor; idempotent. (Unlocking a description a forked child shares unlocks it for
        the child too: a parent that handed the lock to a child calls `hand_over`, not this.)"""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def hand_over(self) -> None:
        """Close this process's descriptor without unlocking: a child forked while the lock was held keeps it, alone,
        until it releases it or ends. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # a lock nobody keeps is let go, as filelock's was
        try:
            self.release()
        except OSError:
            pass


def try_lock(path: str | os.PathLike[str]) -> FileLockHeld | None:
    """Take the OS file lock at ``path`` (an exclusive, non-blocking ``flock``; the file and its folders are made if
    missing, the file with mode 0644) without waiting: the held lock (`FileLockHeld`, to ``release()`` at exit; the OS
    drops it when the process ends, even on SIGKILL), or None when another open file holds it (another process, or
    another `try_lock` of this one).
    The coordinator's run dir and each node's folder are held this way, so one process owns each identity key.

    Raises:
        OSError: the file cannot be made or opened (no permission, a file where a folder should be).
    """
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec (PEP 446): an exec'd child never holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return FileLockHeld(path, fd)
