"""Closed runs: a shared run secret that every peer must hold to read or write the run's DHT records and to average.

A run is closed when the coordinator and every node are given the same secret (``--secret-file PATH`` or the
``COMPOSER_DILOCO_SECRET`` environment variable); without one the run is open, as before. What the secret gates:

- **The DHT.** `ClosedDHT` signs every hivemind DHT RPC (ping, store, find) and its reply with HMAC-SHA256
  under a key derived from the secret (`HMACAuthorizer`), over the message and both libp2p peer IDs of the
  connection, and refuses unsigned, wrongly signed, stale (clock off by more than ``max_clock_skew_s``) or
  replayed requests, and requests signed for another pair of peers: a request an outsider captured (an insider
  dialed it) is refused by every other peer, replayed or relayed, so it can neither read records through it nor
  move an insider's DHT identity (node_id) to its own address. A peer without the secret cannot bootstrap into the run, read the
  run config, store or overwrite a record (run config, heartbeats, barrier, averager declarations), and insiders
  ignore anything it answers. So every record in the run's DHT was written by a holder of the secret.
- **The averaging.** The averager's prefix (`averaging_prefix`) carries an HMAC of the run name: its DHT keys
  and its RPC handler names (``{prefix}::MembersOnlyAverager.rpc_join_group`` ...) differ from an open run's.
  The prefix is not a secret, though: libp2p's identify protocol tells any connected peer which protocols a
  host serves. What actually gates the averager is `MembersOnlyAverager`: it serves ``rpc_join_group``,
  ``rpc_aggregate_part`` and ``rpc_download_state`` only to peers whose libp2p peer ID (authenticated by the
  libp2p handshake) is declared under the averager's ``.all_averagers`` DHT key, which only holders of the
  secret can write (`RunMembers`). An outsider can therefore neither join a group (and change the model) nor
  download it: the run's state is served by `composer_diloco.outer.state_transfer` to `RunMembers` only.

Limits: libp2p connections themselves are not authenticated (hivemind's p2pd has no private-network key), so an
outsider can still connect and learn the peer IDs and protocol names; the secret gates every RPC we serve, not the
transport. A refused request still costs its trip through p2pd and hivemind's handler machinery (measured here: a few
hundred microseconds of CPU each, of which our checks are 1 to 3 us; `bench/refusal_flood.py`). Traffic is encrypted by libp2p (Noise/TLS) but not hidden. The secret is never logged, stored in the DHT
or written to the run dir; a peer that leaked it must be treated as an insider (change the secret, restart the run).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from typing import Any, AsyncIterator  # typing's: hivemind recognizes streaming RPCs by it

import hivemind
import hivemind.dht.node as hivemind_dht_node
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from composer_diloco.outer.averaging import ExactAverager
from composer_diloco.outer.secret import SECRET_ENV, SecretError, load_secret

log = logging.getLogger(__name__)

class RunSecretRefused(PermissionError):
    """A DHT request or reply was not signed with this run's secret."""


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


def _peer_bytes(peer: PeerID) -> bytes:
    return peer.to_bytes()


class HMACAuthorizer(AuthorizerBase):
    """Signs and checks hivemind DHT RPCs with HMAC-SHA256 of a shared run secret, bound to both libp2p peer IDs.

    Use it through `ClosedDHT` (``ClosedDHT(..., secret=secret)``), which calls the ``*_for`` / ``check_*`` methods
    below with the peer IDs of the actual libp2p connection: the caller's ID as libp2p authenticated it
    (``P2PContext.remote_id``) and our own. hivemind's own `AuthRPCWrapper` hands an authorizer the message only,
    so hivemind's four `AuthorizerBase` methods refuse every call here (fail closed) rather than sign or accept a
    request that is not bound to a connection.

    A request carries, in its ``auth`` part: ``client_access_token.public_key`` = the sender's peer ID (bytes),
    ``service_public_key`` = the receiver's peer ID, ``time`` (DHT time, seconds), ``nonce`` (8 random bytes) and
    ``signature`` = HMAC-SHA256 of the whole serialized message with the signature field empty. The server refuses
    it unless both peer IDs are those of the connection it came on, so a request captured by one peer (an outsider
    an insider dialed) is worthless at any other peer, whether replayed later or relayed live; a request replayed
    to its own receiver is refused by its nonce, one older than ``max_clock_skew_s`` by its time. A reply carries
    the request's nonce and a signature that also covers both peer IDs (responder, then requester), so a reply is
    accepted only from the peer the request was sent to.

    Refusals raise `RunSecretRefused`: on the server hivemind sends its one-line text back to the caller
    (``P2PHandlerError: ... RunSecretRefused(...)``); on a client the DHT treats it as no answer from that peer.
    The cheap checks (signature length, peer IDs, time) run before the HMAC and the nonce store.

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
        self._hmac = hmac.new(self._key, digestmod=hashlib.sha256)  # keyed once; .copy() per message
        self.max_clock_skew_s = max_clock_skew_s
        self._recent_nonces = TimedStorage()  # nonce -> None, kept 2 x max_clock_skew_s
        self._last_warning = 0.0

    def _sign(self, kind: bytes, message: Any, binding: bytes = b"") -> bytes:
        mac = self._hmac.copy()
        mac.update(kind)
        mac.update(binding)
        mac.update(message.SerializeToString(deterministic=True))
        return mac.digest()

    def _signature_ok(self, kind: bytes, message: Any, binding: bytes = b"") -> bool:
        signature = message.auth.signature
        message.auth.signature = b""
        try:
            return hmac.compare_digest(signature, self._sign(kind, message, binding))
        finally:
            message.auth.signature = signature

    @staticmethod
    def _response_binding(responder: PeerID, requester: PeerID) -> bytes:
        a, b = _peer_bytes(responder), _peer_bytes(requester)
        return len(a).to_bytes(2, "big") + a + len(b).to_bytes(2, "big") + b

    def _refuse(self, why: str) -> RunSecretRefused:
        now = time.monotonic()
        if now - self._last_warning > 60.0:  # one line a minute, however hard an outsider knocks
            self._last_warning = now
            log.warning("refused a DHT request: %s", why)
        return RunSecretRefused(f"refused by a closed composer-diloco run: {why}")

    # -- bound to the connection (what ClosedDHT calls) ----------------------------------------------------
    def sign_request_for(self, request: AuthorizedRequestBase, sender: PeerID, receiver: PeerID) -> None:
        """Fill ``request.auth`` for a request that ``sender`` (us) sends to ``receiver`` (libp2p peer IDs)."""
        auth = request.auth
        auth.client_access_token.public_key = _peer_bytes(sender)
        auth.service_public_key = _peer_bytes(receiver)
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(8)
        auth.signature = b""
        auth.signature = self._sign(b"request:", request)

    def check_request(self, request: AuthorizedRequestBase, sender: PeerID, receiver: PeerID) -> None:
        """Accept ``request`` if it is signed with the secret for this connection, recent, and not a replay.

        Args:
            sender: the caller's libp2p peer ID as the connection authenticated it (``P2PContext.remote_id``).
            receiver: our own libp2p peer ID (``P2PContext.local_id``).
        Raises:
            RunSecretRefused: it is not (the one-line message says which check failed).
        """
        auth = request.auth
        if len(auth.signature) != 32:
            raise self._refuse("the request is not signed with this run's secret")
        if auth.service_public_key != _peer_bytes(receiver) or \
                auth.client_access_token.public_key != _peer_bytes(sender):
            raise self._refuse(f"the request was signed for another peer, not for {sender} -> {receiver} "
                               "(a replay or a relay)")
        now = get_dht_time()
        if abs(auth.time - now) > self.max_clock_skew_s:
            raise self._refuse(f"the request's time is {auth.time - now:+.0f} s off (clock skew or a replay)")
        if not self._signature_ok(b"request:", request):
            raise self._refuse("the request is not signed with this run's secret")
        with self._recent_nonces.freeze():
            replayed = not auth.nonce or auth.nonce in self._recent_nonces
        if replayed:
            raise self._refuse("the request replays an earlier one")
        self._recent_nonces.store(auth.nonce, None, now + 2 * self.max_clock_skew_s)

    def sign_response_for(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase,
                          responder: PeerID, requester: PeerID) -> None:
        """Fill ``response.auth``: the request's nonce and a signature bound to ``responder`` (us) and
        ``requester`` (libp2p peer IDs)."""
        response.auth.nonce = request.auth.nonce
        response.auth.signature = b""
        response.auth.signature = self._sign(b"response:", response, self._response_binding(responder, requester))

    def check_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase,
                       responder: PeerID, requester: PeerID) -> None:
        """Accept ``response`` if ``responder`` (the peer we called) signed it with the secret for ``requester``
        (us), in answer to ``request``.

        Raises:
            RunSecretRefused: it did not (the peer does not hold this run's secret, the reply was tampered with or
                comes from another peer, or it answers another request).
        """
        auth = response.auth
        if not auth.signature or \
                not self._signature_ok(b"response:", response, self._response_binding(responder, requester)):
            raise RunSecretRefused("the peer's reply is not signed with this run's secret for this connection")
        if auth.nonce != request.auth.nonce:
            raise RunSecretRefused("the peer's reply answers another request")

    # -- hivemind's AuthorizerBase: not bound to a connection, so refused -----------------------------------
    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: Any = None) -> None:
        """Refused: a request must be bound to both peer IDs (start the DHT with `ClosedDHT`).

        Raises:
            RunSecretRefused: always.
        """
        raise RunSecretRefused("HMACAuthorizer signs only requests bound to a connection: start the DHT with ClosedDHT")

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        """Refused: without the connection the request's peer IDs cannot be checked (see `check_request`).

        Raises:
            RunSecretRefused: always.
        """
        raise self._refuse("this DHT peer cannot check which connection the request came on")

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        """Refused, as `sign_request`.

        Raises:
            RunSecretRefused: always.
        """
        raise RunSecretRefused("HMACAuthorizer signs only replies bound to a connection: start the DHT with ClosedDHT")

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        """Refused, as `validate_request`.

        Raises:
            RunSecretRefused: always.
        """
        raise RunSecretRefused("HMACAuthorizer checks only replies bound to a connection: start the DHT with ClosedDHT")


class BoundRPCClient:
    """A DHT stub whose ``rpc_*`` calls are signed for one connection, ``local`` -> ``remote`` (libp2p peer IDs).

    ``rpc_*(request, *args, **kwargs)`` signs ``request`` (`HMACAuthorizer.sign_request_for`), calls the stub,
    and returns the reply once `HMACAuthorizer.check_response` accepts it.

    Raises (from the calls): `RunSecretRefused` when the reply is refused; whatever the stub raises (the peer's
    refusal arrives as hivemind's ``P2PHandlerError``).
    """

    def __init__(self, stub: Any, authorizer: HMACAuthorizer, local: PeerID, remote: PeerID):
        self._stub, self._authorizer, self._local, self._remote = stub, authorizer, local, remote

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not name.startswith("rpc_"):
            return method

        async def call(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._authorizer.sign_request_for(request, self._local, self._remote)
            response = await method(request, *args, **kwargs)
            self._authorizer.check_response(response, request, self._remote, self._local)
            return response

        call.__name__ = name
        return call


class _BoundServicer:
    """What `BoundDHTProtocol` registers as its handlers: each ``rpc_*`` checks the request against the connection
    (`HMACAuthorizer.check_request`), runs the protocol's handler, and signs the reply for that connection."""

    def __init__(self, protocol: DHTProtocol, authorizer: HMACAuthorizer):
        self._protocol, self._authorizer = protocol, authorizer

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._protocol, name)

        async def handle(request: Any, context: P2PContext) -> Any:
            self._authorizer.check_request(request, context.remote_id, context.local_id)
            response = await method(request, context)
            self._authorizer.sign_response_for(response, request, context.local_id, context.remote_id)
            return response

        handle.__name__ = name
        return handle


class BoundDHTProtocol(DHTProtocol):
    """hivemind's `DHTProtocol` with every RPC bound to its libp2p connection (`HMACAuthorizer`).

    Served under hivemind's own handler names (``DHTProtocol.rpc_ping`` ...), so it speaks to the same peers;
    its ``authorizer`` must be an `HMACAuthorizer`. Created by hivemind's `DHTNode` inside a `ClosedDHT`'s process.

    Raises:
        TypeError: (at ``create``) the authorizer is not an `HMACAuthorizer`.
    """

    _rpc_handlers = None  # hivemind caches these per class
    _stub_type = None

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return DHTProtocol._get_handle_name(namespace, method_name)

    async def add_p2p_handlers(self, p2p: Any, wrapper: Any = None, *, namespace: str | None = None,
                               balanced: bool = False) -> None:
        """Register the handlers, each wrapped in `_BoundServicer` (hivemind's own ``wrapper`` is not used)."""
        if not isinstance(self.authorizer, HMACAuthorizer):
            raise TypeError(f"BoundDHTProtocol needs an HMACAuthorizer, got {type(self.authorizer).__name__}")
        await super().add_p2p_handlers(p2p, _BoundServicer(self, self.authorizer), namespace=namespace,
                                       balanced=balanced)

    def get_stub(self, peer: PeerID) -> BoundRPCClient:
        """A stub to ``peer`` whose requests are signed for the connection from us to ``peer``.

        Raises:
            TypeError: the authorizer is not an `HMACAuthorizer`.
        """
        if not isinstance(self.authorizer, HMACAuthorizer):
            raise TypeError(f"BoundDHTProtocol needs an HMACAuthorizer, got {type(self.authorizer).__name__}")
        stub = ServicerBase.get_stub.__func__(type(self), self.p2p, peer)
        return BoundRPCClient(stub, self.authorizer, self.p2p.peer_id, peer)


class ClosedDHT(hivemind.DHT):
    """A hivemind DHT peer of a closed run: every DHT RPC it sends or serves is signed with the run secret and bound
    to the libp2p connection (`HMACAuthorizer`, `BoundDHTProtocol`).

    Takes hivemind.DHT's arguments, plus ``secret`` (the run secret, bytes) and ``max_clock_skew_s`` (seconds).
    hivemind's `DHTNode` builds its protocol from the name ``hivemind.dht.node.DHTProtocol``; `run` points that
    name at `BoundDHTProtocol` in the DHT's own process only (it runs the DHT and nothing else), before the node
    is created, so no handler is ever served unbound.

    Raises:
        ValueError: ``secret`` is empty.
        Whatever hivemind.DHT raises (e.g. no initial peer answered).
    """

    def __init__(self, *args: Any, secret: bytes, max_clock_skew_s: float = 300.0, **kwargs: Any):
        super().__init__(*args, authorizer=HMACAuthorizer(secret, max_clock_skew_s=max_clock_skew_s), **kwargs)

    def run(self) -> None:
        """Serve the DHT (in its own process), its protocol bound to connections."""
        if hivemind_dht_node.DHTProtocol not in (DHTProtocol, BoundDHTProtocol):
            raise RuntimeError("hivemind.dht.node.DHTProtocol is not hivemind's: cannot bind the closed run's RPCs")
        hivemind_dht_node.DHTProtocol = BoundDHTProtocol
        super().run()


class RunMembers:
    """Who is a member of a closed run, as its averagers declare themselves: a peer whose libp2p peer ID is declared
    under ``{prefix}.all_averagers`` in the DHT (every averager declares itself there every ``declare_state_period``
    seconds). With `HMACAuthorizer` on the DHT only holders of the run secret can write that key, and libp2p
    authenticates a caller's peer ID, so a peer without the secret is never a member.

    Members found once are remembered; an unknown caller is looked up again for up to ``lookup_s`` seconds, so a peer
    whose first declaration is still on its way (or whose declaration is being renewed) is not refused. The lookups
    are shared: at most one DHT read of the declarations is in flight, and none starts within ``LOOKUP_PERIOD_S`` of
    the last, however many unknown callers wait, so a flood of outsiders' requests costs the DHT a few reads a second,
    not a few per request. Usable from any process that holds the DHT object and runs an asyncio loop (the averager's
    own process, or a peer's state server, `composer_diloco.outer.state_transfer`); its lock is made in the first loop
    that asks.

    Args:
        dht: the peer's hivemind DHT.
        prefix: the averager prefix (`averaging_prefix`).
        lookup_s: seconds an unknown caller is looked up for before it is refused.
    """

    LOOKUP_PERIOD_S = 0.25

    def __init__(self, dht: hivemind.DHT, prefix: str, *, lookup_s: float = 1.5):
        self.dht, self.prefix, self.lookup_s = dht, prefix, lookup_s
        self._members: set[bytes] = set()
        self._warned: set[bytes] = set()
        self._lookup_lock: asyncio.Lock | None = None
        self._last_lookup = float("-inf")

    async def _refresh(self) -> None:
        """Read the declared members from the DHT, unless another caller did less than ``LOOKUP_PERIOD_S`` ago."""
        if self._lookup_lock is None:
            self._lookup_lock = asyncio.Lock()
        async with self._lookup_lock:
            if time.monotonic() - self._last_lookup < self.LOOKUP_PERIOD_S:
                return
            try:
                found = await self.dht.get(f"{self.prefix}.all_averagers", latest=True, return_future=True)
            finally:
                self._last_lookup = time.monotonic()
            if found is not None and isinstance(found.value, dict):
                self._members.update(k for k in found.value if isinstance(k, bytes))

    async def allows(self, peer_id: PeerID, rpc: str) -> bool:
        """Whether ``peer_id`` is a member (declared in the DHT); a refusal is logged once per caller, naming
        ``rpc``."""
        wanted = peer_id.to_bytes()
        deadline = time.monotonic() + self.lookup_s
        while wanted not in self._members:
            await self._refresh()
            if wanted in self._members:
                break
            if time.monotonic() > deadline:
                if wanted not in self._warned:
                    self._warned.add(wanted)
                    log.warning("refused %s from %s: not a member of this closed run (no run secret)", rpc, peer_id)
                return False
            await asyncio.sleep(self.LOOKUP_PERIOD_S)
        return True


class MembersOnlyAverager(ExactAverager):
    """An `ExactAverager` that serves its RPCs only to members of a closed run (`RunMembers`): a peer without the
    secret is refused, ``rpc_join_group`` and ``rpc_aggregate_part`` answer ``PROTOCOL_VIOLATION``. (The run's state
    is served by `composer_diloco.outer.state_transfer`, gated by the same `RunMembers`.)

    Args: as `ExactAverager`, plus ``member_lookup_s`` (seconds, default 1.5; `RunMembers`'s ``lookup_s``).
    """

    _rpc_handlers = None  # hivemind caches these per class: ours must not inherit ExactAverager's handler names
    _stub_type = None

    def __init__(self, averaged_tensors: Any, dht: hivemind.DHT, *, prefix: str, member_lookup_s: float = 1.5,
                 **kwargs: Any):
        # before hivemind forks the averager process (in the constructor): the child serves the RPCs
        self._run_members = RunMembers(dht, prefix, lookup_s=member_lookup_s)
        super().__init__(averaged_tensors, dht, prefix=prefix, **kwargs)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's ``rpc_join_group`` for members; ``PROTOCOL_VIOLATION`` for anyone else."""
        if not await self._run_members.allows(context.remote_id, "rpc_join_group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's ``rpc_aggregate_part`` for members; ``PROTOCOL_VIOLATION`` for anyone else."""
        if not await self._run_members.allows(context.remote_id, "rpc_aggregate_part"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message


__all__ = ["BoundDHTProtocol", "BoundRPCClient", "ClosedDHT", "HMACAuthorizer", "MembersOnlyAverager", "RunMembers",
           "RunSecretRefused", "SECRET_ENV", "SecretError", "averaging_prefix", "load_secret"]
