"""The global model's state between peers: theta and the outer optimizer state, streamed in bounded chunks.

Who downloads: a node joining a run, a peer that failed a round or parted from the run
(`composer_diloco.outer.recovery`: resync, split heal, settle), a coordinator restarted behind the swarm. All of them go through
`DiLoCoPeer.load_state_from_peers`, which calls `StateTransfer.download`.

Why not hivemind's ``load_state_from_peers``: its server asks the peer's process for the whole state, ships it to
the averager process and serializes each tensor before the first byte leaves, and its client gives up on a peer whose
next chunk takes longer than ``next_chunk_timeout``: a full-fine-tuning state of Qwen3-0.6B's architecture (7.2 GB of
fp32 theta and Delayed Nesterov buffers) never arrived, on an H200 or on this CPU (DESIGN.md). torchft's HTTP
checkpoint transport (``torchft/checkpointing/http_transport.py``) serves the live state dict under a read/write lock
whose writer, the optimizer step, waits for the readers; this module does the same over the run's own libp2p daemon,
chunked and resumable, and sends only what the downloader does not hold already.

The protocol: two streaming RPCs, served in the peer's own process through a replica of its DHT's p2p daemon (as
`hivemind.DHT.replicate_p2p` makes), so every chunk is read from theta and the optimizer state themselves; the server
holds no copy of the state, however many downloads it serves (one chunk per stream in flight):

``{prefix}::StateTransfer.rpc_manifest``
    keepalives while the server hashes its state (once per change of the state, then cached), then the `Manifest`:
    round, theta's sha256, the run's base_sha256, the parameter layout, the outer optimizer's meta and scalars, and
    each state tensor's dtype, shape, bytes and sha256.
``{prefix}::StateTransfer.rpc_chunks``
    given a manifest's ``state_id``, tensor indices and the byte offset into the first: those tensors' bytes in order,
    ``chunk_bytes`` a message; ``{"moved": round}`` instead when the state changed under the stream.

A download, in order:
    1. the manifest of the best peer (newest round, the coordinator first among equals: the priorities hivemind's
       averagers declare under ``{prefix}.all_averagers``); its layout, base model and outer optimizer are checked
       (`ArchitectureMismatch`) before any byte of state moves, and a state older than ``min_round`` is not taken;
    2. what differs: only the tensors whose sha256 differs from this peer's own travel. A node that loaded the run's
       ``--model`` already holds round 0's theta, and every peer materialises the same initial optimizer state, so a
       round-0 join moves no byte at all;
    3. the rest streams, each chunk within ``chunk_timeout_s`` (a keepalive counts while the server hashes), with a
       progress line every `PROGRESS_S` seconds (bytes, MB/s, ETA). A failed stream is retried from the last byte
       received, from the same peer or from any other peer whose manifest has the same ``state_id`` (the peers of a
       round hold the same bytes); a state that moved is fetched again at its new round, keeping what still matches;
    4. each tensor's sha256 is checked as its last byte arrives and theta's sha256 at the end; only then does the
       caller load the state, all at once (a download that fails never leaves a partial theta behind).
The whole download has a deadline: the caller's, else ``start_timeout_s`` plus the bytes to move at
``min_rate_bytes_s`` (`download_deadline_s`).

Writes: `StateTransfer.hold_writes` makes the outer step wait (at most its ``timeout_s``) for the downloads in flight
from this peer, as torchft's step waits for its readers; a stream that the state moves under anyway ends "moved", and
its downloader starts over at the new round.

Closed runs: both RPCs serve `composer_diloco.outer.auth.RunMembers` only; anyone else gets an empty stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Iterator  # typing's AsyncIterator: hivemind reads streaming RPCs by it

import numpy as np
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.serializer import MSGPackSerializer

from composer_diloco import faults

log = logging.getLogger(__name__)

MANIFEST_RPC = "StateTransfer.rpc_manifest"
CHUNKS_RPC = "StateTransfer.rpc_chunks"
KEEPALIVE_S = 1.0
"""Seconds between two keepalives of a server that is still hashing its state for a manifest."""
PROGRESS_S = 10.0
"""Seconds between two progress lines of a download."""
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 256 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
"""Bytes per chunk message by default: 8 MiB (a per-message overhead of microseconds, a retry that repeats little)."""
_SERIALIZER = MSGPackSerializer


class StateTransferError(RuntimeError):
    """A state download did not complete: no peer sent its manifest in time, every peer holding the state failed,
    or the deadline passed. The message is one line naming how far it got."""


class _Moved(Exception):
    """The serving peer's state changed under a chunk stream (it reached round ``round``)."""

    def __init__(self, round_: int):
        super().__init__(f"the state moved to round {round_}")
        self.round = round_


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a peer's state, as its manifest lists it.

    Attributes:
        dtype: torch dtype name (``"torch.float32"``).
        shape: its shape.
        nbytes: its size in bytes (elements x element size).
        sha256: SHA-256 (hex) of its bytes.
    """

    dtype: str
    shape: list[int]
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a peer's state is, without its bytes (`StateTransfer`'s ``rpc_manifest``).

    Attributes:
        run: the run name.
        round: the round the state is at (theta_round).
        sha256: theta's SHA-256 (`GlobalModel.sha256`).
        base_sha256: the run's base model hash (`composer_diloco.policy.lora.base_sha256`: the LoRA base, or the
            ``--model`` weights a full-fine-tuning run started from), None when the peer does not know it.
        layout: ``[[name, shape], ...]`` of theta (`DiLoCoPeer.layout`).
        outer: the outer optimizer's meta (`GlobalModel.state`'s first element: class, keys, scalars).
        tensors: the state's tensors, theta's then the optimizer's (`GlobalModel.state` order).
        serves: False when the peer holds no theta to send (a joiner before its download).
        peer: the serving peer's name (for the downloader's log).
    """

    run: str
    round: int
    sha256: str
    base_sha256: str | None
    layout: list
    outer: dict
    tensors: list[TensorEntry]
    serves: bool = True
    peer: str = ""

    @property
    def state_id(self) -> str:
        """SHA-256 over the optimizer meta and every tensor's hash: equal for two peers holding the same state."""
        h = hashlib.sha256(json.dumps(self.outer, sort_keys=True, default=str).encode())
        for t in self.tensors:
            h.update(t.sha256.encode())
        return h.hexdigest()

    @property
    def nbytes(self) -> int:
        """Bytes of all the state's tensors."""
        return sum(t.nbytes for t in self.tensors)

    def to_wire(self) -> bytes:
        """msgpack bytes of this manifest (`from_wire` reads them)."""
        return _SERIALIZER.dumps({**asdict(self), "tensors": [asdict(t) for t in self.tensors]})

    @classmethod
    def from_wire(cls, data: bytes) -> Manifest:
        """Read `to_wire`'s bytes. Raises StateTransferError on a malformed manifest."""
        try:
            raw = _SERIALIZER.loads(data)
            return cls(**{**raw, "tensors": [TensorEntry(**t) for t in raw["tensors"]]})
        except Exception as e:
            raise StateTransferError(f"malformed state manifest: {e!r}") from None


@dataclass
class DownloadReport:
    """What a download moved.

    Attributes:
        round: the round of the state downloaded.
        sources: the peers (names) that sent bytes, in order.
        bytes_total: bytes of the whole state.
        bytes_moved: bytes received (a retried chunk counts again).
        bytes_kept: bytes of the tensors this peer held already (equal hashes): not moved.
        seconds: wall seconds from the first manifest request to the last byte checked.
        retries: chunk streams that failed and were resumed.
    """

    round: int = -1
    sources: list[str] = field(default_factory=list)
    bytes_total: int = 0
    bytes_moved: int = 0
    bytes_kept: int = 0
    seconds: float = 0.0
    retries: int = 0

    def describe(self) -> str:
        """One log phrase: ``7.20 GB of round 3 from coordinator: 7.20 GB moved (310 MB/s), 0 B kept, 23.2 s``."""
        rate = self.bytes_moved / self.seconds / 1e6 if self.seconds > 0 else 0.0
        return (f"state of round {self.round} ({_size(self.bytes_total)}) from {', '.join(self.sources) or 'nobody'}: "
                f"{_size(self.bytes_moved)} moved ({rate:.0f} MB/s), {_size(self.bytes_kept)} kept (already held), "
                f"{self.seconds:.1f} s, {self.retries} retries")


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{int(n)} B"


def download_deadline_s(bytes_to_move: int, *, start_timeout_s: float, min_rate_bytes_s: float) -> float:
    """The seconds a download may take when the caller gives no deadline: ``start_timeout_s`` (to find a peer and
    read its manifest) plus the bytes to move at the slowest rate the run accepts (``network.state_min_rate_mb_s``).
    E.g. Qwen3-0.6B's 7.2 GB at 10 MB/s: 30 + 720 s."""
    return start_timeout_s + bytes_to_move / max(min_rate_bytes_s, 1.0)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a writable uint8 numpy view (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class _Progress:
    """Logs a download's progress every `PROGRESS_S` seconds: bytes, MB/s, ETA."""

    def __init__(self, name: str, total: int, round_: int):
        self.name, self.total, self.round = name, total, round_
        self.done, self.started = 0, time.monotonic()
        self._next = self.started + PROGRESS_S

    def add(self, n: int, source: str) -> None:
        self.done += n
        now = time.monotonic()
        if now >= self._next and self.total:
            self._next = now + PROGRESS_S
            rate = self.done / max(now - self.started, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            log.info("%s: downloading the state of round %d from %s: %s of %s (%.0f %%), %.0f MB/s, ETA %.0f s",
                     self.name, self.round, source, _size(self.done), _size(self.total), 100 * self.done / self.total,
                     rate / 1e6, eta)


class StateTransfer:
    """One peer's end of state transfer: serves its state to others and downloads theirs (module docstring).

    Runs an asyncio loop in a daemon thread of this process, with a replica of ``dht``'s p2p daemon on which both RPCs
    are registered. Create it after hivemind forked the peer's averager (its threads and sockets stay out of the child).

    Args:
        dht: the peer's running hivemind DHT.
        prefix: the averager prefix (`composer_diloco.outer.auth.averaging_prefix`): the RPC names carry it.
        global_model: the state served (`GlobalModel`): its ``state()``, ``tensor_sha256()``, ``sha256()``,
            ``version``.
        lock: the lock every writer of ``global_model`` holds (`DiLoCoPeer`'s); held here per chunk read and per
            tensor hashed, never across a network wait.
        describe: returns ``{"run", "round", "serves", "base_sha256", "layout"}`` of the peer; called under ``lock``.
        members: a closed run's `RunMembers` (None: an open run, anyone may download).
        name: this peer's name, for the log.
    Raises:
        hivemind's P2P errors when the replica cannot reach the daemon (the DHT is not running).
    """

    def __init__(self, dht: Any, prefix: str, global_model: Any, lock: threading.Lock,
                 describe: Callable[[], dict], *, members: Any = None, name: str = "peer"):
        self.prefix, self.name = prefix, name
        self._gm, self._lock, self._describe, self._members = global_model, lock, describe, members
        self._manifest_lock = threading.Lock()  # one hashing pass at a time; the others wait for its result
        self._cached: tuple[tuple[int, int], Manifest, list[torch.Tensor]] | None = None  # (version, round) -> ...
        self._streams = 0  # chunk streams in flight (`hold_writes` waits for them)
        self._streams_done = threading.Condition()
        self._chunks_sent = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"state-transfer-{name}", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._p2p = self._run(self._start(dht), timeout=60.0)
        except BaseException:
            self._stop_loop()
            raise

    # -- the loop ---------------------------------------------------------------------------------------------
    def _run(self, coro, timeout: float | None = None):
        """Run ``coro`` on this transfer's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, dht: Any):
        # a replica of the DHT's daemon of our own, as `hivemind.DHT.replicate_p2p` makes one, without its per-process
        # cache: `close` shuts it down, and another `StateTransfer` on the same DHT gets a live one
        from hivemind import DHT
        from hivemind.p2p import P2P

        p2p = await P2P.replicate(dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr))
        await p2p.add_protobuf_handler(f"{self.prefix}::{MANIFEST_RPC}", self._rpc_manifest,
                                       averaging_pb2.DownloadData, stream_output=True)
        await p2p.add_protobuf_handler(f"{self.prefix}::{CHUNKS_RPC}", self._rpc_chunks, averaging_pb2.DownloadData,
                                       stream_output=True)
        return p2p

    def close(self) -> None:
        """Stop serving, close this process's replica of the p2p daemon and stop the loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._close(), timeout=10.0)
        except Exception as e:  # the daemon is already gone (the DHT shut down first)
            log.debug("state transfer: closing: %r", e)
        self._stop_loop()

    async def _close(self) -> None:
        for rpc in (MANIFEST_RPC, CHUNKS_RPC):
            try:
                await self._p2p.remove_protobuf_handler(f"{self.prefix}::{rpc}", stream_output=True)
            except Exception as e:
                log.debug("state transfer: removing %s: %r", rpc, e)
        await self._p2p.shutdown()  # its connections to the daemon close here, in their own loop

    def _stop_loop(self) -> None:
        """Cancel what still runs on the loop (streams in flight), stop it, close it."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(5.0)
        except Exception as e:
            log.debug("state transfer: cancelling: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()

    # -- serving --------------------------------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """This peer's `Manifest` now (hashing its state the first time after a change: seconds at 0.6B)."""
        return self._snapshot()[1]

    def _snapshot(self) -> tuple[tuple[int, int], Manifest, list[torch.Tensor]]:
        """``(key, manifest, tensors)``: the manifest of the current state and the live tensors it describes, cached
        per key = (`GlobalModel.version`, round)."""
        with self._manifest_lock:
            while True:
                with self._lock:
                    info = self._describe()
                    key = (self._gm.version, int(info["round"]))
                    if self._cached is not None and self._cached[0] == key:
                        return self._cached
                    outer, tensors = self._gm.state()
                    sha = self._gm.sha256()
                digests = []
                for t in tensors:  # one tensor at a time under the lock: a writer waits one tensor's hash at most
                    with self._lock:
                        if self._gm.version != key[0]:
                            break
                        digests.append(hashlib.sha256(_bytes_of(t)).hexdigest())
                if len(digests) < len(tensors):
                    continue  # the state changed while we hashed it: once more
                entries = [TensorEntry(str(t.dtype), list(t.shape), t.numel() * t.element_size(), d)
                           for t, d in zip(tensors, digests, strict=True)]
                manifest = Manifest(run=str(info["run"]), round=key[1], sha256=sha,
                                    base_sha256=info.get("base_sha256"), layout=info["layout"], outer=outer,
                                    tensors=entries, serves=bool(info["serves"]), peer=self.name)
                with self._lock:
                    if self._gm.version == key[0]:
                        self._cached = (key, manifest, tensors)
                        return self._cached

    async def _allowed(self, context: P2PContext, rpc: str) -> bool:
        return self._members is None or await self._members.allows(context.remote_id, rpc)

    async def _rpc_manifest(self, request: averaging_pb2.DownloadData,
                            context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Keepalives while hashing, then this peer's manifest; an empty stream for a non-member of a closed run."""
        if not await self._allowed(context, "rpc_manifest"):
            return
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self._snapshot)
        while True:
            try:
                _, manifest, _ = await asyncio.wait_for(asyncio.shield(future), KEEPALIVE_S)
                break
            except asyncio.TimeoutError:
                yield averaging_pb2.DownloadData(metadata=_SERIALIZER.dumps({"wait": "hashing"}))
        yield averaging_pb2.DownloadData(metadata=_SERIALIZER.dumps({"manifest": manifest.to_wire()}))

    def _read(self, key: tuple[int, int], state_id: str, index: int, offset: int, n: int) -> bytes | None:
        """Bytes ``[offset, offset + n)`` of state tensor ``index``; None when the state is no longer ``state_id``."""
        with self._lock:
            cached = self._cached
            if cached is None or cached[0] != key or self._gm.version != key[0] or not cached[1].serves or \
                    cached[1].state_id != state_id:
                return None
            return _bytes_of(cached[2][index])[offset:offset + n].tobytes()

    async def _rpc_chunks(self, request: averaging_pb2.DownloadData,
                          context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The asked tensors' bytes, chunk by chunk (module docstring); an empty stream for a non-member of a closed
        run or a malformed request."""
        if not await self._allowed(context, "rpc_chunks"):
            return
        try:
            ask = _SERIALIZER.loads(request.metadata)
            state_id, indices, offset = str(ask["state_id"]), [int(i) for i in ask["tensors"]], int(ask["offset"])
            chunk = min(max(int(ask["chunk_bytes"]), MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
        except Exception as e:
            log.warning("%s: malformed state chunk request from %s: %r", self.name, context.remote_id, e)
            return
        loop = asyncio.get_running_loop()
        key, manifest, _ = await loop.run_in_executor(None, self._snapshot)
        if manifest.state_id != state_id or not manifest.serves:
            yield averaging_pb2.DownloadData(metadata=_SERIALIZER.dumps({"moved": manifest.round}))
            return
        with self._streams_done:
            self._streams += 1
        try:
            delay = faults.state_serve_delay_s(manifest.round)
            if delay:
                await asyncio.sleep(delay)
            for index in indices:
                if not 0 <= index < len(manifest.tensors):
                    return
                nbytes = manifest.tensors[index].nbytes
                while offset < nbytes:
                    n = min(chunk, nbytes - offset)
                    data = await loop.run_in_executor(None, self._read, key, state_id, index, offset, n)
                    if data is None:
                        yield averaging_pb2.DownloadData(metadata=_SERIALIZER.dumps({"moved": self._round_now()}))
                        return
                    yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=data),
                                                     metadata=_SERIALIZER.dumps({"t": index, "o": offset}))
                    offset += n
                    self._chunks_sent += 1
                    faults.state_chunk_sent(manifest.round, self._chunks_sent)
                offset = 0
            yield averaging_pb2.DownloadData(metadata=_SERIALIZER.dumps({"end": True}))
        finally:
            with self._streams_done:
                self._streams -= 1
                self._streams_done.notify_all()

    def _round_now(self) -> int:
        with self._lock:
            return int(self._describe()["round"])

    @contextmanager
    def hold_writes(self, timeout_s: float) -> Iterator[int]:
        """Before a write of the state (the outer step): wait until no download from this peer is in flight, at most
        ``timeout_s`` seconds (torchft's checkpoint server makes its step wait for readers the same way); yields how
        many were still in flight when the wait ended (they end "moved" once the state changes)."""
        deadline = time.monotonic() + timeout_s
        with self._streams_done:
            waited = self._streams > 0
            while self._streams > 0 and time.monotonic() < deadline:
                self._streams_done.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            left = self._streams
        if waited:
            log.info("%s: the outer step waited for a state download in flight%s", self.name,
                     f" ({left} still running after {timeout_s:.0f} s: it starts over)" if left else "")
        yield left

    # -- downloading ----------------------------------------------------------------------------------------------
    def download(self, candidates: Callable[[], list[tuple[str, str]]], *, local: Sequence[torch.Tensor],
                 local_sha256: Callable[[], list[str]], check: Callable[[Manifest], None], min_round: int | None,
                 start_timeout_s: float, chunk_timeout_s: float, min_rate_bytes_s: float,
                 deadline_s: float | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 in_place: bool = False) -> tuple[Manifest, list[torch.Tensor], DownloadReport]:
        """Download the best peer's state (module docstring for the steps).

        Args:
            candidates: returns ``[(peer id base58, name), ...]``, best first (read again when a peer fails).
            local: this peer's own state tensors (`GlobalModel.state` order).
            local_sha256: returns their hashes (`GlobalModel.tensor_sha256` under the peer's lock); run in a worker
                thread while the first manifest is fetched (seconds each at 0.6B: they overlap).
            check: raises (`ArchitectureMismatch`) when a manifest does not fit this peer: called before any byte.
            min_round: a state older than this round is not taken (None: any).
            start_timeout_s: seconds to get a first manifest (keepalives of a hashing server keep it waiting).
            chunk_timeout_s: seconds a stream may stay silent before it is retried.
            min_rate_bytes_s: bytes/s the default deadline assumes (`download_deadline_s`).
            deadline_s: seconds for the whole download, overriding the default.
            chunk_bytes: bytes per chunk asked for (the server clamps to [64 KiB, 256 MiB]).
            in_place: write into ``local`` directly (it is not a theta anyone uses: a joiner's skeleton); else into
                new tensors (a peer with a theta must keep it whole until the download is complete).
        Returns:
            ``(manifest, tensors, report)``: the state's tensors in manifest order (the downloaded ones new, or
            ``local``'s where in place; ``local``'s own where the hashes matched).
        Raises:
            StateTransferError: one line (no manifest in time, every source failed, deadline passed).
            Whatever ``check`` raises.
        """
        return self._run(self._download(
            candidates, local=list(local), local_sha256=local_sha256, check=check, min_round=min_round,
            start_timeout_s=start_timeout_s, chunk_timeout_s=chunk_timeout_s, min_rate_bytes_s=min_rate_bytes_s,
            deadline_s=deadline_s, chunk_bytes=chunk_bytes, in_place=in_place))

    async def fetch_manifest(self, peer_id: str, timeout_s: float) -> Manifest | None:
        """The manifest of ``peer_id`` (base58), or None when it sent none (refused, not serving its RPC, or silent
        for ``timeout_s`` seconds between two messages). Runs on this transfer's loop."""
        try:
            stream = await asyncio.wait_for(self._p2p.iterate_protobuf_handler(
                PeerID.from_base58(peer_id), f"{self.prefix}::{MANIFEST_RPC}", averaging_pb2.DownloadData(),
                averaging_pb2.DownloadData), timeout_s)
            try:
                async for message in aiter_with_timeout(stream, timeout_s):
                    meta = _SERIALIZER.loads(message.metadata) if message.metadata else {}
                    if "manifest" in meta:
                        return Manifest.from_wire(meta["manifest"])
            finally:
                await stream.aclose()  # the reader stops now, not when the generator is collected
        except Exception as e:  # a peer that is gone, refused, or does not speak this protocol
            log.debug("%s: no state manifest from %s: %r", self.name, peer_id, e)
        return None

    async def _download(self, candidates, *, local, local_sha256, check, min_round, start_timeout_s, chunk_timeout_s,
                        min_rate_bytes_s, deadline_s, chunk_bytes, in_place):
        started = time.monotonic()
        report = DownloadReport()
        hashing = asyncio.get_running_loop().run_in_executor(None, local_sha256)  # beside the manifest's fetch
        try:
            source, manifest = await self._find_source(candidates, check, min_round, start_timeout_s, started,
                                                       same_state=None)
        finally:
            local_digests = await hashing
        if manifest is None:
            raise StateTransferError(f"no peer sent a state manifest{_min_round_text(min_round)} within "
                                     f"{start_timeout_s:.0f} s")
        job = _Job(manifest, local, list(local_digests), in_place)
        report.sources.append(source[1])  # whose state it is, even when none of its bytes need to move
        if deadline_s is None:
            deadline_s = download_deadline_s(job.bytes_needed(), start_timeout_s=start_timeout_s,
                                             min_rate_bytes_s=min_rate_bytes_s)
        deadline = started + deadline_s
        progress = _Progress(self.name, job.bytes_needed(), manifest.round)
        failures: dict[str, int] = {}
        while not job.done():
            if time.monotonic() > deadline:
                raise StateTransferError(
                    f"the state of round {job.manifest.round} did not arrive within the {deadline_s:.0f} s deadline: "
                    f"{_size(progress.done)} of {_size(job.bytes_needed())} from {source[1]} (raise --join-deadline, "
                    "or [network] state_min_rate_mb_s lower)")
            try:
                await self._stream(source, job, chunk_bytes, chunk_timeout_s, progress, report, deadline)
                continue
            except _PastDeadline:
                continue  # the deadline check at the loop's top says so, in one line
            except _Moved as moved:
                log.info("%s: %s's state moved to round %d during the download: fetching that one, keeping what "
                         "still matches", self.name, source[1], moved.round)
                fresh = await self.fetch_manifest(source[0], chunk_timeout_s)
                if fresh is None or not fresh.serves or (min_round is not None and fresh.round < min_round):
                    failures[source[0]] = 99  # go to another peer
                else:
                    check(fresh)
                    job.rebase(fresh)
                    progress = _Progress(self.name, job.bytes_needed(), fresh.round)
                    continue
            except (asyncio.TimeoutError, TimeoutError) as e:
                why = f"no chunk for {chunk_timeout_s:.0f} s ({type(e).__name__})"
                failures[source[0]] = failures.get(source[0], 0) + 1
                report.retries += 1
                log.warning("%s: state download from %s stopped at %s: %s; resuming from there", self.name,
                            source[1], job.position(), why)
            except _StreamFailed as e:
                failures[source[0]] = failures.get(source[0], 0) + 1
                report.retries += 1
                log.warning("%s: state download from %s stopped at %s: %s; resuming from there", self.name,
                            source[1], job.position(), e)
            except Exception as e:  # the peer vanished, its stream broke, it answered with an error
                failures[source[0]] = failures.get(source[0], 0) + 1
                report.retries += 1
                log.warning("%s: state download from %s stopped at %s: %r; resuming from there", self.name,
                            source[1], job.position(), e)
            if failures.get(source[0], 0) >= 2:  # this peer failed twice: another holding the same bytes
                found, fresh = await self._find_source(candidates, check, min_round, chunk_timeout_s, started,
                                                       same_state=job.manifest.state_id, exclude=set(failures))
                if fresh is None:
                    raise StateTransferError(
                        f"the state download from {source[1]} failed at {job.position()} ({_size(progress.done)} of "
                        f"{_size(job.bytes_needed())}) and no other peer holds round {job.manifest.round}'s state")
                if fresh.state_id != job.manifest.state_id:
                    job.rebase(fresh)
                    progress = _Progress(self.name, job.bytes_needed(), fresh.round)
                log.warning("%s: resuming the state download from %s at %s", self.name, found[1], job.position())
                source = found
        report.round = job.manifest.round
        report.bytes_total, report.bytes_kept = job.manifest.nbytes, job.bytes_kept()
        report.seconds = time.monotonic() - started
        return job.manifest, job.tensors(), report

    async def _find_source(self, candidates, check, min_round, timeout_s: float, started: float, *,
                           same_state: str | None, exclude: set[str] = frozenset()):
        """The first candidate whose manifest serves a state of ``min_round`` or later (``same_state``: that state,
        or, failing that, a newer one); asks again until ``timeout_s`` passes. ``check`` runs on every manifest."""
        deadline = time.monotonic() + timeout_s
        newer = None
        loop = asyncio.get_running_loop()
        while True:
            for peer_id, name in await loop.run_in_executor(None, candidates):  # DHT reads: off the loop
                if peer_id in exclude:
                    continue
                manifest = await self.fetch_manifest(peer_id, timeout_s=max(1.0, min(timeout_s, 30.0)))
                if manifest is None or not manifest.serves:
                    continue
                check(manifest)  # another model: no other peer can help either
                if min_round is not None and manifest.round < min_round:
                    log.info("%s: %s's state is at round %d, older than round %d: not taken", self.name, name,
                             manifest.round, min_round)
                    continue
                source = (peer_id, manifest.peer or name)
                if same_state is None or manifest.state_id == same_state:
                    return source, manifest
                newer = newer or (source, manifest)
            if newer is not None:
                return newer
            if time.monotonic() >= deadline:
                return None, None
            await asyncio.sleep(0.5)

    async def _stream(self, source: tuple[str, str], job: _Job, chunk_bytes: int, chunk_timeout_s: float,
                      progress: _Progress, report: DownloadReport, deadline: float) -> None:
        """One chunk stream from ``source``, from ``job``'s position to the end or to ``deadline`` (time.monotonic()).

        Each wait for a message lasts at most ``chunk_timeout_s`` and never past ``deadline``. The stream is closed on
        every way out, so a download that gives up stops reading at once (hivemind's client keeps its reader open
        until the generator is closed). Raises `_Moved`, `_StreamFailed`, `_PastDeadline`, TimeoutError or the
        transport's errors."""
        ask = {"state_id": job.manifest.state_id, "tensors": job.remaining(), "offset": job.offset,
               "chunk_bytes": chunk_bytes}
        stream = await asyncio.wait_for(self._p2p.iterate_protobuf_handler(
            PeerID.from_base58(source[0]), f"{self.prefix}::{CHUNKS_RPC}",
            averaging_pb2.DownloadData(metadata=_SERIALIZER.dumps(ask)), averaging_pb2.DownloadData), chunk_timeout_s)
        if source[1] not in report.sources:
            report.sources.append(source[1])
        loop = asyncio.get_running_loop()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _PastDeadline()
                try:
                    message = await asyncio.wait_for(stream.__anext__(), min(chunk_timeout_s, left))
                except StopAsyncIteration:
                    break
                except (asyncio.TimeoutError, TimeoutError):
                    if time.monotonic() >= deadline:
                        raise _PastDeadline() from None
                    raise
                meta = _SERIALIZER.loads(message.metadata) if message.metadata else {}
                if "moved" in meta:
                    raise _Moved(int(meta["moved"]))
                if meta.get("end"):
                    if not job.done():
                        raise _StreamFailed(f"the stream ended at {job.position()} with the state unfinished")
                    return
                data = message.tensor_part.buffer
                if meta.get("t") != job.current() or meta.get("o") != job.offset or not data:
                    raise _StreamFailed(f"chunk {meta.get('t')}@{meta.get('o')} where {job.position()} was due")
                await loop.run_in_executor(None, job.write, data)
                report.bytes_moved += len(data)
                progress.add(len(data), source[1])
        finally:
            await stream.aclose()
        if not job.done():
            raise _StreamFailed(f"the stream ended at {job.position()} (the peer stopped serving)")


class _StreamFailed(Exception):
    """A chunk stream ended early or sent a chunk out of order."""


class _PastDeadline(Exception):
    """The download's deadline passed during a chunk stream."""


def _min_round_text(min_round: int | None) -> str:
    return "" if min_round is None else f" of round {min_round} or later"


class _Job:
    """A download's progress: which tensors still travel, where in them it is, and their buffers.

    A tensor is complete once its last byte is written and its sha256 (hashed as the bytes arrive, in order)
    matches the manifest's; a mismatch starts that tensor over.
    """

    def __init__(self, manifest: Manifest, local: list[torch.Tensor], local_sha256: list[str], in_place: bool):
        if len(local) != len(manifest.tensors):
            raise StateTransferError(f"the peer's state has {len(manifest.tensors)} tensors, this peer's {len(local)}")
        self.local, self.local_sha256, self.in_place = local, local_sha256, in_place
        self.complete: dict[int, torch.Tensor] = {}  # downloaded and checked, by index
        self.manifest = manifest
        self._plan(manifest)

    def _plan(self, manifest: Manifest) -> None:
        self.manifest = manifest
        for i, entry in enumerate(manifest.tensors):
            ours = self.local[i]
            if entry.nbytes != ours.numel() * ours.element_size() or entry.dtype != str(ours.dtype):
                raise StateTransferError(f"state tensor {i} is {entry.dtype} {entry.shape} at the peer, "
                                         f"{ours.dtype} {list(ours.shape)} here")
        done = {i for i, t in self.complete.items() if _sha256(t) == manifest.tensors[i].sha256}
        self.complete = {i: self.complete[i] for i in done}
        self.need = [i for i, e in enumerate(manifest.tensors)
                     if e.sha256 != self.local_sha256[i] and i not in self.complete]
        self.pos, self.offset = 0, 0
        self._hasher = hashlib.sha256()
        self._buffer: torch.Tensor | None = None

    def rebase(self, manifest: Manifest) -> None:
        """Go on toward another state (the peer's moved on): keep what this peer holds or downloaded that still
        matches, start the rest over."""
        self._plan(manifest)

    def bytes_needed(self) -> int:
        return sum(self.manifest.tensors[i].nbytes for i in self.need)

    def bytes_kept(self) -> int:
        return self.manifest.nbytes - self.bytes_needed()

    def done(self) -> bool:
        return self.pos >= len(self.need)

    def current(self) -> int:
        return self.need[self.pos]

    def remaining(self) -> list[int]:
        return self.need[self.pos:]

    def position(self) -> str:
        if self.done():
            return "the end"
        entry = self.manifest.tensors[self.current()]
        return f"tensor {self.current()} byte {self.offset} of {entry.nbytes}"

    def write(self, data: bytes) -> None:
        """Write the next chunk at the current position (in a worker thread); completes and checks a tensor."""
        index = self.current()
        entry = self.manifest.tensors[index]
        if self._buffer is None:
            self._buffer = self.local[index] if self.in_place else torch.empty_like(self.local[index])
            if self.in_place:
                self.local_sha256[index] = ""  # overwritten from here on: no longer what this peer held
        n = len(data)
        if self.offset + n > entry.nbytes:
            raise _StreamFailed(f"tensor {index}: {self.offset + n} bytes sent, {entry.nbytes} expected")
        _bytes_of(self._buffer)[self.offset:self.offset + n] = np.frombuffer(data, dtype=np.uint8)
        self._hasher.update(data)
        self.offset += n
        if self.offset < entry.nbytes:
            return
        digest, buffer = self._hasher.hexdigest(), self._buffer
        self._hasher, self._buffer, self.offset = hashlib.sha256(), None, 0
        if digest != entry.sha256:
            raise _StreamFailed(f"tensor {index} arrived with sha256 {digest[:12]}, the manifest says "
                                f"{entry.sha256[:12]}: fetching it again")
        self.complete[index] = buffer
        if self.in_place:
            self.local_sha256[index] = digest
        self.pos += 1

    def tensors(self) -> list[torch.Tensor]:
        return [self.complete.get(i, self.local[i]) for i in range(len(self.manifest.tensors))]


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(_bytes_of(tensor)).hexdigest()


__all__ = ["CHUNKS_RPC", "DEFAULT_CHUNK_BYTES", "DownloadReport", "MANIFEST_RPC", "Manifest", "StateTransfer",
           "StateTransferError", "TensorEntry", "download_deadline_s"]
