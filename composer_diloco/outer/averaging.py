"""hivemind all-reduce that leaves the same bytes on every peer: the one adapter over hivemind's internals.

Why this exists: hivemind 1.1.12's `AllReduceRunner` sends each peer ``average - own_part`` and the peer adds it
to its own part, so peers end with averages that differ in the last bits (and by the compression error with
fp16/int8). DiLoCo replicas that each apply an outer step to slightly different pseudo-gradients drift apart
round after round. Here the reducer of a part sends the *average itself*, compressed once, and passes its own
copy through the same compress/decompress, so every peer holds ``decompress(compress(average))``: identical
bytes, whatever the compression.

Failure behaviour (what the round protocol relies on):
- a sender that dies is banned by the reducers; the parts it had not sent are averaged without it;
- a reducer that dies leaves its parts unreduced: every surviving peer fills them with zeros (no update for
  those coordinates this round) and `ExactAverager.failed_size` tells how many elements were lost. A reducer
  that dies after returning a part to some peers and not to others leaves the survivors with *different*
  averages: only peers with ``failed_size == 0`` are sure to agree, and `composer_diloco.outer.peer` brings the
  others to one of them (`ExactAverager.load_state_from_peers` with ``peer=``);
- ``step`` raises or returns None when no group forms within its timeout (see `composer_diloco.outer.peer`);
- a contribution that `composer_diloco.outer.screening.screen` drops (non-finite, or a norm outlier) is averaged with
  weight 0 by every reducer, and its owner sends zeros: the group goes on without it. ``step`` hands back the
  verdicts it applied (`Contribution.rejection`), so the caller never decides the drop a second time.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException, TensorPartContainer
from hivemind.compression import deserialize_tensor_stream, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionBase, NoCompression
from hivemind.proto import averaging_pb2
from hivemind.p2p import PeerID
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, azip
from hivemind.utils.mpfuture import MPFuture

from composer_diloco import faults
from composer_diloco.outer.compression import roundtrip
from composer_diloco.outer.screening import Rejection, screen

log = logging.getLogger(__name__)

StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


@dataclass(frozen=True)
class Contribution:
    """One group member's entry in what `ExactAverager.step` returns.

    Attributes:
        metadata: what the member passed as ``gather`` (for DiLoCo a dict: name, role, round, weight, norm).
        rejection: the screening verdict every reducer applied to its pseudo-gradient: None (averaged) or the
            `Rejection` (averaged with weight 0).
    """

    metadata: Any
    rejection: Rejection | None


class _ZeroOnFailureContainer(TensorPartContainer):
    """A part container whose parts that no reducer returned become zeros on every peer (not the local part)."""

    def register_failed_reducer(self, peer_index: int) -> None:
        for part_index in range(self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]):
            part = torch.zeros_like(self._input_parts_by_peer[peer_index][part_index][0])
            self.register_processed_part(peer_index, part_index, part)
            self.failed_size += part.numel()


class ExactAllReduceRunner(AllReduceRunner):
    """`AllReduceRunner` returning averages (not deltas), identical on all peers, counting payload bytes.

    Args (beyond hivemind's):
        bytes_sent: an ``mp.Value('Q')`` incremented by the serialized size (bytes) of every tensor part this
            peer sends, to reducers and back to senders.
        dropped: indices (in ``ordered_peer_ids``) of peers whose contribution every reducer weighs 0.
        round_: the DiLoCo round (for fault injection only).
    """

    def __init__(self, *, tensors: Sequence[torch.Tensor], peer_fractions: tuple[float, ...],
                 compression: CompressionBase, bytes_sent: Any, dropped: frozenset[int] = frozenset(),
                 round_: int | None = None, **kwargs: Any):
        super().__init__(tensors=tensors, peer_fractions=peer_fractions, compression=compression, **kwargs)
        self._compression = compression
        self._bytes_sent = bytes_sent
        self._dropped_senders = {self.ordered_peer_ids[i] for i in dropped}
        self._round = round_
        self._answered_one = False
        container_kwargs = {k: v for k, v in kwargs.items() if k in ("part_size_bytes", "tensor_infos", "prefetch")}
        self.tensor_part_container = _ZeroOnFailureContainer(
            tensors, peer_fractions, compression=compression, return_deltas=False, **container_kwargs
        )
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(
            self.ordered_peer_ids.index(self.peer_id)
        )

    def _count(self, message_bytes: int) -> None:
        with self._bytes_sent.get_lock():
            self._bytes_sent.value += message_bytes

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        # Our own part: average it here, then take it through the compression the others receive it with.
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            self.tensor_part_container.register_processed_part(
                peer_index, part_index, roundtrip(averaged, self._compression)
            )

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._count(message.tensor_part.ByteSize())
            yield message
            faults.point("allreduce_part_sent", self._round)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # Same as hivemind's, except that the reply is the average itself rather than average - sender's part.
        part_index = 0
        # fault injection: answer the first sender only, then die (the others never receive our parts)
        kill_in_reply = faults.withholds_replies(self._round)
        answer = not (kill_in_reply and self._answered_one)
        self._answered_one = True
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if self.sender_peer_ids[sender_index] in self._dropped_senders:
                    weight = 0.0  # screened out: every reducer agrees (composer_diloco.outer.screening)
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:  # the sender was banned: its stream is no longer needed
                    break
                serialized = await loop.run_in_executor(
                    None, lambda: serialize_torch_tensor(averaged, part_compression)
                )
                if answer:
                    self._count(serialized.ByteSize())
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
            if kill_in_reply:
                if answer:
                    await asyncio.sleep(1.0)  # let the answered sender receive its last part
                    faults.point("reducer_answered", self._round)
                await asyncio.sleep(3600.0)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class ExactAverager(DecentralizedAverager):
    """A `DecentralizedAverager` whose ``step`` replaces the averaged tensors by bit-identical weighted means.

    Args:
        averaged_tensors: fp32 CPU tensors (the pseudo-gradient buffers), moved to shared memory by hivemind.
        dht: a running `hivemind.DHT`.
        state_provider: called in this process when a peer downloads our state (``load_state_from_peers``);
            returns ``(metadata, tensors)``: for DiLoCo, the round number and `GlobalModel.state` (theta and the
            outer optimizer's state).
        kwargs: as `hivemind.averaging.DecentralizedAverager` (``prefix``, ``compression``, timeouts ...).

    ``step`` returns ``{peer_id: Contribution}`` in group order: each member's gathered metadata with the screening
    verdict applied to it (see `Contribution`), or raises / returns None as hivemind's (no group in time).

    Attributes:
        bytes_sent: total bytes of tensor payload this peer has sent in all-reduces (shared across processes).
        failed_size: elements of the last all-reduce that no reducer returned (zeroed), shared across processes.
        max_norm_ratio: screening threshold handed to `composer_diloco.outer.screening.screen` (None = NaN/Inf only).
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, state_provider: StateProvider,
                 max_norm_ratio: float | None = None, **kwargs: Any):
        self._state_provider = state_provider
        self.max_norm_ratio = max_norm_ratio
        self.bytes_sent = mp.Value(ctypes.c_uint64, 0)
        self.failed_size = mp.Value(ctypes.c_uint64, 0)
        self._verdicts: dict[bytes, list[Rejection | None]] = {}  # by group id, in the averager process
        super().__init__(averaged_tensors, dht, **kwargs)

    def set_target_group_size(self, size: int | None) -> None:
        """Close the next group as soon as it holds ``size`` peers (hivemind's ``target_group_size``, applied in the
        averager's process like hivemind's ``set_group_bits``), instead of waiting out ``min_matchmaking_time``;
        None restores waiting for the whole window. The round's barrier knows how many peers it waits for, so the
        leader need not wait for anyone else (hivemind's open request for it: learningathome/hivemind#676).

        Raises:
            ValueError: ``size`` below 2 (a group of one is no all-reduce).
        """
        if size is not None and size < 2:
            raise ValueError(f"target group size {size}: expected at least 2 peers, or None")
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result()

    async def _set_target_group_size(self, size: int | None, future: MPFuture) -> None:
        try:
            self._matchmaking.target_group_size = size  # the leader assembles once the group is this big
            self._matchmaking.potential_leaders.target_group_size = size
            future.set_result(None)
        except Exception as e:
            if not future.done():
                future.set_exception(e)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> dict[Any, Contribution]:
        # hivemind's, returning with each member's metadata the verdict `_run_allreduce_inplace_` applied to it
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            verdicts = self._verdicts[group_info.group_id]
        finally:
            self._verdicts.pop(group_info.group_id, None)
        return {pid: Contribution(meta, v) for (pid, meta), v in zip(gathered.items(), verdicts, strict=True)}

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        kwargs.setdefault("compression", NoCompression())
        gathered = [self.serializer.loads(self.serializer.loads(b)[2]) for b in group_info.gathered]
        verdicts = screen(gathered, self.max_norm_ratio)
        self._verdicts[group_info.group_id] = verdicts
        dropped = frozenset(i for i, v in enumerate(verdicts) if v is not None)
        me = group_info.peer_ids.index(self.peer_id)
        if me in dropped:  # send zeros with weight 0: 0 * NaN would still poison the reducers' sums
            for t in tensors:
                t.zero_()
            kwargs["weight"] = 0.0
        mine = gathered[me] if isinstance(gathered[me], dict) else {}
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            bytes_sent=self.bytes_sent,
            dropped=dropped,
            round_=mine.get("round"),
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            raise ValueError("ExactAverager peers must send tensors (AUX mode is not supported)")
        async for tensor, average in azip(as_aiter(*tensors), runner):
            tensor.copy_(average)
        self.failed_size.value = runner.tensor_part_container.failed_size

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None, *,
                              peer: str | None = None) -> tuple[Any, list[torch.Tensor]] | None:
        """Download ``(metadata, tensors)`` from the best peer (hivemind's order), or from ``peer`` only.

        Args:
            wait: block for the result (else return an ``MPFuture``).
            timeout: seconds for the whole download.
            peer: the base58 PeerID to download from (its DHT multiaddr's ``/p2p/`` part); None = hivemind's
                choice: the highest ``state_sharing_priority``, ties broken at random.
        Returns:
            ``(metadata, tensors)``, or None when no peer (or not ``peer``) sent its state in time.
        """
        if peer is None:
            return super().load_state_from_peers(wait=wait, timeout=timeout)
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peer", [], dict(peer=peer, timeout=timeout, future=future)))
        return future.result(timeout=timeout) if wait else future

    async def _load_state_from_peer(self, future: MPFuture, peer: str, timeout: float | None) -> None:
        # hivemind's download (rpc_download_state), from one named peer instead of the best of all_averagers
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata = None

            async def parts():
                nonlocal metadata
                async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout or timeout):
                    if message.metadata:
                        metadata = self.serializer.loads(message.metadata)
                    yield [message.tensor_part]

            tensors = await asyncio.wait_for(deserialize_tensor_stream(parts()), timeout)
            future.set_result((metadata, tensors) if metadata is not None else None)
        except Exception as e:
            log.warning("could not download the state of peer %s: %r", peer, e)
            if not future.done():
                future.set_result(None)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        """The state a joining peer downloads: ``(metadata, tensors, None)`` from ``state_provider``."""
        metadata, tensors = self._state_provider()
        return metadata, tensors, None


__all__ = ["Contribution", "ExactAverager", "ExactAllReduceRunner"]
