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

__all__ = ["IDENTITY_FILE", "IdentityError", "load_or_create_identity", "try_lock"]

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


def try_lock(path: str | os.PathLike[str]):
    """Take the OS file lock at ``path`` (``filelock.FileLock``; the OS drops it when the process ends, even on
    SIGKILL) without waiting: the lock, to ``release()`` at exit, or None when another process holds it. The
    coordinator's run dir and each node's folder are held this way, so one process owns each identity key."""
    from filelock import FileLock, Timeout

    lock = FileLock(Path(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock
