"""Closed runs: a shared run secret that every peer must hold to read or write the run's DHT records and to average.

A run is closed when the coordinator and every node are given the same secret (``--secret-file PATH`` or the
``COMPOSER_DILOCO_SECRET`` environment variable); without one the run is open, as before. What the secret gates:

- **The DHT.** `HMACAuthorizer` signs every hivemind DHT RPC (ping, store, find) and its reply with HMAC-SHA256
  under a key derived from the secret, and refuses unsigned, wrongly signed, stale (clock off by more than
  ``max_clock_skew_s``) or replayed requests. A peer without the secret cannot bootstrap into the run, read the
  run config, store or overwrite a record (run config, heartbeats, barrier, averager declarations), and insiders
  ignore anything it answers. So every record in the run's DHT was written by a holder of the secret.
- **The averaging.** The averager's prefix (`averaging_prefix`) carries an HMAC of the run name: its DHT keys
  and its RPC handler names (``{prefix}::MembersOnlyAverager.rpc_join_group`` ...) differ from an open run's.
  The prefix is not a secret, though: libp2p's identify protocol tells any connected peer which protocols a
  host serves. What actually gates the averager is `MembersOnlyAverager`: it serves ``rpc_join_group``,
  ``rpc_aggregate_part`` and ``rpc_download_state`` only to peers whose libp2p peer ID (authenticated by the
  libp2p handshake) is declared under the averager's ``.all_averagers`` DHT key, which only holders of the
  secret can write. An outsider can therefore neither join a group (and change the model) nor download it.

Limits: libp2p connections themselves are not authenticated (hivemind's p2pd has no private-network key), so an
outsider can still connect and learn the peer IDs and protocol names; the secret gates every RPC we serve, not the
transport. Traffic is encrypted by libp2p (Noise/TLS) but not hidden. The secret is never logged, stored in the DHT
or written to the run dir; a peer that leaked it must be treated as an insider (change the secret, restart the run).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, AsyncIterator  # typing's: hivemind recognizes streaming RPCs by it

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from composer_diloco.outer.averaging import ExactAverager

log = logging.getLogger(__name__)

SECRET_ENV = "COMPOSER_DILOCO_SECRET"
MIN_SECRET_CHARS = 16


class SecretError(ValueError):
    """The run secret is unreadable, empty or too short (the message names the file or the variable)."""


class RunSecretRefused(PermissionError):
    """A DHT request or reply was not signed with this run's secret."""


def load_secret(secret_file: Path | None) -> bytes | None:
    """The run secret: the content of ``secret_file`` (stripped), else ``$COMPOSER_DILOCO_SECRET``, else None.

    Args:
        secret_file: path of a UTF-8 text file holding the secret (``--secret-file``); None to use the variable.
    Returns:
        The secret as bytes, or None for an open run (no file given and the variable unset).
    Raises:
        SecretError: the file cannot be read or is not UTF-8 text, or the secret is empty or shorter than
            ``MIN_SECRET_CHARS`` characters. The message names the file or the variable, never the secret.
    """
    if secret_file is not None:
        where = f"--secret-file {str(secret_file)!r}"
        try:
            text = Path(secret_file).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SecretError(f"{where} is not UTF-8 text") from None
        except OSError as e:
            raise SecretError(f"{where} cannot be read: {e.strerror or e}") from None
    elif SECRET_ENV in os.environ:
        where, text = SECRET_ENV, os.environ[SECRET_ENV]
    else:
        return None
    secret = text.strip()
    if not secret:
        raise SecretError(f"{where} holds an empty run secret (unset it for an open run)")
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"{where} holds a run secret shorter than {MIN_SECRET_CHARS} characters "
                          "(make one with: openssl rand -hex 16)")
    return secret.encode()


def _derive(secret: bytes, purpose: bytes) -> bytes:
    """A key for one purpose, so that no two uses of the secret share an HMAC key."""
    return hmac.new(secret, b"composer-diloco:" + purpose, hashlib.sha256).digest()


def averaging_prefix(run_name: str, secret: bytes | None) -> str:
    """The hivemind averager prefix of a run: its DHT keys and RPC handler names derive from it.

    Args:
        run_name: the run's name (``RunConfig.run_name``).
        secret: the run secret, or None for an open run.
    Returns:
        ``"{run_name}_diloco"`` for an open run, else ``"{run_name}_diloco_{16 hex digits}"``, the digits an
        HMAC-SHA256 of the run name under the secret (so closed and open runs, and runs with different secrets,
        never share averaging keys).
    """
    if secret is None:
        return f"{run_name}_diloco"
    tag = hmac.new(_derive(secret, b"averaging"), run_name.encode(), hashlib.sha256).hexdigest()[:16]
    return f"{run_name}_diloco_{tag}"


class HMACAuthorizer(AuthorizerBase):
    """Signs and checks hivemind DHT RPCs with HMAC-SHA256 of a shared run secret.

    Pass it as ``hivemind.DHT(..., authorizer=HMACAuthorizer(secret))``. hivemind calls it around every DHT RPC
    (`hivemind.utils.auth.AuthRPCWrapper`): the client signs the request, the server validates it, signs its reply
    and the client validates the reply. Fields of the protobufs' ``auth`` part that are used: the request's
    ``time`` (DHT time, seconds), ``nonce`` (8 random bytes) and ``signature``; the reply's ``nonce`` (the
    request's, binding the reply to it) and ``signature``. A signature covers the whole serialized message with
    the signature field empty, as hivemind's own `TokenAuthorizerBase` does.

    Failures raise `RunSecretRefused` instead of returning False: on the server hivemind sends the exception's
    text back to the caller (``P2PHandlerError: ... RunSecretRefused(...)``), which is clearer than the
    ``'NoneType' object has no attribute ...`` that returning False produces; on a client the DHT treats it as
    no answer from that peer.

    Args:
        secret: the run secret (non-empty bytes).
        max_clock_skew_s: requests whose ``time`` differs from ours by more (seconds) are refused.
    Raises:
        ValueError: ``secret`` is empty.
    """

    def __init__(self, secret: bytes, *, max_clock_skew_s: float = 300.0):
        if not secret:
            raise ValueError("HMACAuthorizer needs a non-empty secret")
        self._key = _derive(secret, b"dht-rpc")
        self.max_clock_skew_s = max_clock_skew_s
        self._recent_nonces = TimedStorage()  # nonce -> None, kept 2 x max_clock_skew_s
        self._last_warning = 0.0

    def _sign(self, kind: bytes, message: Any) -> bytes:
        return hmac.new(self._key, kind + message.SerializeToString(deterministic=True), hashlib.sha256).digest()

    def _signature_ok(self, kind: bytes, message: Any) -> bool:
        signature = message.auth.signature
        message.auth.signature = b""
        try:
            return hmac.compare_digest(signature, self._sign(kind, message))
        finally:
            message.auth.signature = signature

    def _refuse(self, why: str) -> RunSecretRefused:
        now = time.monotonic()
        if now - self._last_warning > 60.0:  # one line a minute, however hard an outsider knocks
            self._last_warning = now
            log.warning("refused a DHT request: %s", why)
        return RunSecretRefused(f"refused by a closed composer-diloco run: {why}")

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: Any = None) -> None:
        """Fill ``request.auth`` (time, nonce, signature). ``service_public_key`` is unused (no RSA keys here)."""
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(8)
        auth.signature = b""
        auth.signature = self._sign(b"request:", request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        """True if ``request`` is signed with the secret, recent and not a replay.

        Raises:
            RunSecretRefused: it is not (the message says which check failed).
        """
        auth = request.auth
        if not auth.signature or not self._signature_ok(b"request:", request):
            raise self._refuse("the request is not signed with this run's secret")
        now = get_dht_time()
        if abs(auth.time - now) > self.max_clock_skew_s:
            raise self._refuse(f"the request's time is {auth.time - now:+.0f} s off (clock skew or a replay)")
        with self._recent_nonces.freeze():
            replayed = not auth.nonce or auth.nonce in self._recent_nonces
        if replayed:
            raise self._refuse("the request replays an earlier one")
        self._recent_nonces.store(auth.nonce, None, now + 2 * self.max_clock_skew_s)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        """Fill ``response.auth``: the request's nonce and the signature."""
        response.auth.nonce = request.auth.nonce
        response.auth.signature = b""
        response.auth.signature = self._sign(b"response:", response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        """True if ``response`` is signed with the secret and answers ``request``.

        Raises:
            RunSecretRefused: it does not (the peer does not hold this run's secret, or the reply was tampered).
        """
        auth = response.auth
        if not auth.signature or not self._signature_ok(b"response:", response):
            raise RunSecretRefused("the peer's reply is not signed with this run's secret")
        if auth.nonce != request.auth.nonce:
            raise RunSecretRefused("the peer's reply answers another request")
        return True


class MembersOnlyAverager(ExactAverager):
    """An `ExactAverager` that serves its RPCs only to members of a closed run.

    A member is a peer whose libp2p peer ID is declared under ``{prefix}.all_averagers`` in the DHT (every
    averager declares itself there every ``declare_state_period`` seconds). With `HMACAuthorizer` on the DHT only
    holders of the run secret can write that key, and libp2p authenticates the caller's peer ID, so a peer without
    the secret is refused: ``rpc_join_group`` answers ``PROTOCOL_VIOLATION``, ``rpc_aggregate_part`` the same,
    ``rpc_download_state`` an empty stream (hivemind's own "no state here" answer). Members found once are
    remembered; an unknown caller is looked up again for up to ``member_lookup_s`` seconds, so a peer whose first
    declaration is still on its way (or whose declaration is being renewed) is not refused.

    Args: as `ExactAverager`, plus ``member_lookup_s`` (seconds, default 1.5).
    """

    _rpc_handlers = None  # hivemind caches these per class: ours must not inherit ExactAverager's handler names
    _stub_type = None

    def __init__(self, *args: Any, member_lookup_s: float = 1.5, **kwargs: Any):
        self._members: set[bytes] = set()
        self._warned: set[bytes] = set()
        self.member_lookup_s = member_lookup_s
        super().__init__(*args, **kwargs)

    async def _is_member(self, peer_id: PeerID, rpc: str) -> bool:
        """Whether ``peer_id`` is declared in this averager's DHT records (runs in the averager process)."""
        wanted = peer_id.to_bytes()
        deadline = time.monotonic() + self.member_lookup_s
        while wanted not in self._members:
            found = await self.dht.get(f"{self.prefix}.all_averagers", latest=True, return_future=True)
            if found is not None and isinstance(found.value, dict):
                self._members.update(k for k in found.value if isinstance(k, bytes))
            if wanted in self._members:
                break
            if time.monotonic() > deadline:
                if wanted not in self._warned:
                    self._warned.add(wanted)
                    log.warning("refused %s from %s: not a member of this closed run (no run secret)", rpc, peer_id)
                return False
            await asyncio.sleep(0.25)
        return True

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's ``rpc_join_group`` for members; ``PROTOCOL_VIOLATION`` for anyone else."""
        if not await self._is_member(context.remote_id, "rpc_join_group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's ``rpc_aggregate_part`` for members; ``PROTOCOL_VIOLATION`` for anyone else."""
        if not await self._is_member(context.remote_id, "rpc_aggregate_part"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's ``rpc_download_state`` for members; an empty stream for anyone else."""
        if not await self._is_member(context.remote_id, "rpc_download_state"):
            return
        async for message in super().rpc_download_state(request, context):
            yield message


__all__ = ["HMACAuthorizer", "MembersOnlyAverager", "RunSecretRefused", "SECRET_ENV", "SecretError",
           "averaging_prefix", "load_secret"]
