"""hivemind all-reduce that leaves the same bytes on every peer: the one adapter over hivemind's internals.

Why this exists: hivemind 1.1.12's `AllReduceRunner` sends each peer ``average - own_part`` and the peer adds it
to its own part, so peers end with averages that differ in the last bits (and by the compression error with
fp16/int8). DiLoCo replicas that each apply an outer step to slightly different pseudo-gradients drift apart
round after round. Here the reducer of a part sends the *average itself*, compressed once, and passes its own
copy through the same compress/decompress, so every peer holds ``decompress(compress(average))``: identical
bytes, whatever the compression.

Failure behaviour (what the round protocol relies on):
- a sender that dies is banned by the reducers; the parts it had not sent are averaged without it. A reducer bans it
  as soon as its own stream to that peer fails to dial (`unreachable`: no connection to it is left), not only after
  hivemind's ``sender_timeout``: the sender's open stream to us does not always end when its process does, and every
  other member would wait for this reducer's averaged parts meanwhile (20-30 s, BENCHMARKS.md 3q). When its stream
  failed otherwise (reset), the reducer waits `BROKEN_SENDER_S` for the sender's next part, then bans it; any other
  sender it waits on for ``sender_timeout`` is banned too, even where hivemind's own timer is not read (`_watch`);
- a peer's ``step`` returns only once its replies as a reducer have been written out (`ExactAllReduceRunner.replies_sent`):
  hivemind's returns as soon as the peer holds its own average, so a node that shut down right after its last round
  cut the end of its share off the coordinator's average;
- the sender closes each reply stream once it holds every averaged part of that reducer, and the reducer keeps its
  end open until then (`_ClosingAfterLastPart`, `ExactAllReduceRunner.rpc_aggregate_part`): in hivemind a reducer
  closes its end as soon as its last part is written, and under load the libp2p stream then lost parts still in
  flight (1 round in about 80 on loopback: "peer ... sent 15 parts, but we expected 16"), which the sender filled
  with zeros, and its round ended settling on another member's theta;
- likewise a group's leader keeps each follower's join stream open after BEGIN_ALLREDUCE until the follower closes
  it (`ExactAverager.rpc_join_group`): a follower that lost that message searched on alone while the others averaged
  without it, and sat out the step's whole timeout;
- a reducer that dies leaves its parts unreduced: every surviving peer fills them with zeros (no update for
  those coordinates this round) and `ExactAverager.failed_size` tells how many elements were lost. A reducer
  that dies after returning a part to some peers and not to others leaves the survivors with *different*
  averages: only peers with ``failed_size == 0`` are sure to agree, and `composer_diloco.outer.peer` brings the
  others to one of them (`ExactAverager.load_state_from_peers` with ``peer=``);
- ``step`` raises or returns None when no group forms within its timeout (see `composer_diloco.outer.peer`);
- a contribution that `composer_diloco.outer.screening.screen` drops (non-finite, or a norm outlier) is averaged with
  weight 0 by every reducer, and its owner sends zeros: the group goes on without it. ``step`` hands back the
  verdicts it applied (`Contribution.rejection`), so the caller never decides the drop a second time.

The codec is the run's (`composer_diloco.outer.codec_contract`): a "butterfly" codec either is one of hivemind's
per-part codecs (none, fp16, int8) over the whole buffers, or also packs the buffers before the butterfly and unpacks
the mean after it, from the group's gathered metadata (``shared-blocks``: the kept blocks' values, chosen from every
member's scores, the same on every member; `composer_diloco.outer.shared_blocks`). The failure behaviour above holds
for both, on the packed vector.

The ``sparse-2bit`` codec (`composer_diloco.outer.sparse`) is a "gather" codec, not a per-part one: top-k messages of different peers
keep different entries, so a reducer could not sum them without re-encoding the sum (more bytes, and an error no
error feedback carries). With it, `ExactAverager` runs an all-gather instead of the butterfly (`SparseGatherRunner`):
every contributor sends its one compressed message to every other member, and every member decodes the messages and
forms the weighted mean itself, in group order (`composer_diloco.outer.sparse.weighted_mean`, bit-identical on
every peer). SparseLoCo and DeMo aggregate the same way. A node then sends ``(group size - 1) x message`` bytes a
round: that grows with N, where the butterfly's ``2 (n - 1) / n x vector`` does not. Its failure behaviour:
- a contributor whose message has not started arriving within ``sender_timeout``, stalls between pieces for as
  long, or whose connection closes before all its bytes came, is missing for this peer (one whose bytes all came
  counts, even if it died before its end of stream): the mean is formed without it and ``failed_size`` is set to the vector's size, so
  that `composer_diloco.outer.recovery.settle_pick` brings this peer to a member that received every message;
- a member that does not acknowledge our message only costs that member our contribution (it counts it missing);
- screened-out members and members of weight 0 (the coordinator) send nothing, and every member leaves them out.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import multiprocessing as mp
import sys
import threading
import time
import traceback
import typing
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionBase, NoCompression
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, anext, as_aiter, azip
from hivemind.utils.mpfuture import MPFuture

from composer_diloco import faults
from composer_diloco.malloc import fix_mmap_threshold
from composer_diloco.outer.compression import roundtrip
from composer_diloco.outer.screening import Rejection, screen
from composer_diloco.outer.sparse import CodecError, SparseCodec

log = logging.getLogger(__name__)

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


BROKEN_SENDER_S = 2.0
"""Seconds a reducer waits for the next part of a sender whose own reducer stream to us broke (`_watch`), before it
bans that sender; hivemind waits ``sender_timeout`` for any sender (10 s at our default)."""


def unreachable(error: BaseException) -> bool:
    """Whether ``error``, raised by a stream to a peer, says that no connection to that peer is left: the daemon had
    to dial it and every address failed (hivemind's ``ControlFailure``: "failed to dial"). An open stream of that peer
    to us ran over a connection, and a daemon with a live connection opens a new stream on it instead of dialing: so
    that stream is gone too. A reset stream (``ConnectionResetError``) is not proof: one stream can end while the
    peer lives."""
    return "failed to dial" in str(error)


class ExactAllReduceRunner(AllReduceRunner):
    """`AllReduceRunner` returning averages (not deltas), identical on all peers, counting payload bytes.

    Args (beyond hivemind's):
        bytes_sent: an ``mp.Value('Q')`` incremented by the serialized size (bytes) of every tensor part this
            peer sends, to reducers and back to senders.
        dropped: indices (in ``ordered_peer_ids``) of peers whose contribution every reducer weighs 0.
        round_: the DiLoCo round (for fault injection only).
        closed_by_sender: an ``mp.Value('Q')`` incremented for every reply stream of this reducer that its sender
            closed after receiving every averaged part (the order that loses nothing; `rpc_aggregate_part`).
    """

    def __init__(self, *, tensors: Sequence[torch.Tensor], peer_fractions: tuple[float, ...],
                 compression: CompressionBase, bytes_sent: Any, dropped: frozenset[int] = frozenset(),
                 round_: int | None = None, closed_by_sender: Any = None, **kwargs: Any):
        super().__init__(tensors=tensors, peer_fractions=peer_fractions, compression=compression, **kwargs)
        self._compression = compression
        self._bytes_sent = bytes_sent
        self._closed_by_sender = closed_by_sender
        self._dropped_senders = {self.ordered_peer_ids[i] for i in dropped}
        self._round = round_
        self._answered_one = False
        # as a reducer, a peer owes each other sender the averaged parts of its share: `replies_sent` waits for them
        self._replied = {p: asyncio.Event() for p in self.sender_peer_ids if p != self.peer_id}
        self._broken: set[PeerID] = set()  # peers whose reducer stream to us failed (`_communicate_with_peer`)
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

    async def run(self) -> AsyncIterator[torch.Tensor]:
        """hivemind's ``run`` (the averaged tensors, in order), watched: see `_watch`."""
        watch = asyncio.create_task(self._watch())
        try:
            async for tensor in super().run():
                yield tensor
        finally:
            watch.cancel()

    def _progress(self) -> tuple:
        """What changes whenever this all-reduce moves: parts taken in as a reducer, the reducer's current part,
        averaged parts registered from every reducer, payload bytes sent, senders banned."""
        reducer, container = self.tensor_part_reducer, self.tensor_part_container
        return (sum(reducer.num_parts_received), reducer.current_part_index,
                tuple(container._outputs_registered_by_peer), self._bytes_sent.value, len(self.banned_senders))

    def _only_own_share_left(self) -> bool:
        """True when nothing from another peer is still to come: every other reducer's averaged parts are in (or
        given up: zeros), every other sender sent all its parts or was banned, and this peer's own share is not
        done. Only this peer's own parts can still move it: it is local work, not a wait on the network."""
        me = self.ordered_peer_ids.index(self.peer_id)
        reducer, container = self.tensor_part_reducer, self.tensor_part_container
        registered, expected = container._outputs_registered_by_peer, container.num_parts_by_peer
        reducers_done = all(registered[i] == expected[i] for i in range(len(expected)) if i != me)
        senders_done = all(p in self.banned_senders or reducer.num_parts_received[i] == reducer.num_parts
                           for i, p in enumerate(self.sender_peer_ids) if p != self.peer_id)
        return reducers_done and senders_done and registered[me] < expected[me]

    async def _watch(self, poll_s: float = 0.5) -> None:
        """End an all-reduce that stopped moving, and say where it stood.

        hivemind times each stream on its own (a sender's next part within ``sender_timeout``, a reducer's within
        ``reducer_timeout``), not the all-reduce: one stuck where no stream timer runs (this peer's own share
        never finishing, its senders given up on it) waited out the step's whole timeout
        (`composer_diloco.outer.peer`'s ``allreduce_timeout_s``, 45 s at the default; seen once in 18 kills of an
        overlapped churn run, BENCHMARKS.md 3k). After ``sender_timeout`` seconds without progress (`_progress`)
        this logs where the all-reduce stands (`describe`) at WARNING. It finalizes the runner with an
        `AllreduceException` (the step fails, the peer resyncs as after any failed all-reduce) after half a
        ``sender_timeout`` without progress when nothing but its own share is left (`_only_own_share_left`: no
        stream is waited for, and finishing the share is local work of milliseconds a part), and after
        ``reducer_timeout + sender_timeout`` in any case: later than hivemind's own bound on any one stream, so a
        slow reducer is still given up alone, as hivemind does.

        It also bans a sender this peer's reducer has waited on for its current part (`_senders_to_ban`) for
        `BROKEN_SENDER_S` when that sender's own reducer stream to us failed, or for ``sender_timeout`` in any case.
        hivemind's bound on a sender (``sender_timeout`` on its stream) is read only when the sender's handler asks
        for its next part, and a handler stuck writing its reply to a dead peer never asks: under churn a killed
        sender's parts were waited for until the whole all-reduce was given up (30 s, every survivor; BENCHMARKS.md
        3r). Its parts are then averaged without it, on every reducer alike, so the members still agree.
        """
        warn_s = self.sender_timeout or 10.0
        give_up_s = (self.reducer_timeout or 2 * warn_s) + warn_s
        last, since, warned = self._progress(), time.monotonic(), False
        waited: dict[PeerID, tuple[int, float]] = {}  # sender -> (its parts received, since when it blocks us)
        while True:
            await asyncio.sleep(poll_s)
            for peer_id in self._senders_to_ban(waited, warn_s):
                await self._ban_sender(peer_id, f"waited on for {BROKEN_SENDER_S:.0f} s after its reducer stream broke"
                                       if peer_id in self._broken else f"waited on for {warn_s:.0f} s")
            now = self._progress()
            if now != last:
                last, since, warned = now, time.monotonic(), False
                continue
            stalled = time.monotonic() - since
            own_only = stalled >= warn_s / 2 and self._only_own_share_left()
            if own_only or stalled >= give_up_s:
                why = "only this peer's own share is left" if own_only else "no stream moved"
                log.warning("all-reduce: no progress for %.1f s (%s): given up, the step fails%s", stalled, why,
                            "" if warned else f": {self.describe()}")
                self.finalize(exception=AllreduceException(f"no progress for {stalled:.1f} s ({why})"))
                return
            if stalled >= warn_s and not warned:
                warned = True
                log.warning("all-reduce: no progress for %.0f s: %s", stalled, self.describe())

    def _senders_to_ban(self, waited: dict[PeerID, tuple[int, float]], sender_timeout_s: float) -> list[PeerID]:
        """The senders `_watch` bans now: of those this peer's reducer waits on for its current part (not banned, fewer
        parts in than the current part's index + 1), each one waited on for `BROKEN_SENDER_S` while its reducer
        stream to us is broken, or for ``sender_timeout_s`` (seconds). ``waited`` (sender -> its parts received and
        since when, `time.monotonic`) is kept across calls: a part that comes in starts the clock again."""
        reducer, now = self.tensor_part_reducer, time.monotonic()
        if reducer.finished.is_set():
            return []
        blocking = {p: reducer.num_parts_received[i] for i, p in enumerate(self.sender_peer_ids)
                    if p != self.peer_id and p not in self.banned_senders
                    and reducer.num_parts_received[i] <= reducer.current_part_index}
        for peer_id in list(waited):
            if blocking.get(peer_id) != waited[peer_id][0]:
                del waited[peer_id]
        banned = []
        for peer_id, received in blocking.items():
            _, since = waited.setdefault(peer_id, (received, now))
            if now - since >= (BROKEN_SENDER_S if peer_id in self._broken else sender_timeout_s):
                banned.append(peer_id)
        return banned

    def describe(self) -> str:
        """One line on where this all-reduce stands: this peer's reducer (its current part, how many of the
        senders counted for it have added it, parts taken from each sender, where each banned sender's parts stop),
        the averaged parts registered from each reducer, this process's other threads (idle pool workers counted,
        every other thread's innermost frames) and its event loop's tasks, counted by where each is suspended
        (`_awaiting`): what a stalled all-reduce waits for."""
        reducer, container = self.tensor_part_reducer, self.tensor_part_container
        short = [str(p)[-6:] for p in self.sender_peer_ids]
        failed = {s: a for s, a in zip(short, reducer.sender_failed_after) if a != float("inf")}
        outputs = [f"{str(p)[-6:]} {n}/{m}" for p, n, m in zip(self.ordered_peer_ids,
                                                                container._outputs_registered_by_peer,
                                                                container.num_parts_by_peer)]
        parts = (f"reducer part {reducer.current_part_index}/{reducer.num_parts} "
                 f"({reducer.current_part_accumulated_from} of {reducer.num_current_senders} senders in), "
                 f"received {dict(zip(short, reducer.num_parts_received))}, banned after {failed}, "
                 f"finished {reducer.finished.is_set()}; averaged parts in: {', '.join(outputs)}")
        frames, idle, busy = sys._current_frames(), 0, []
        for thread in threading.enumerate():  # hivemind's loop is uvloop's: its executor is not ours to inspect
            frame = frames.get(thread.ident)
            if thread is threading.current_thread() or frame is None:
                continue
            stack = traceback.extract_stack(frame)[-3:]
            if stack[-1].name == "_worker" and stack[-1].filename.endswith("thread.py"):
                idle += 1  # a pool worker waiting for a job (in C: `SimpleQueue.get`)
                continue
            where = " <- ".join(_where(f.name, f.filename, f.lineno) for f in reversed(stack))
            busy.append(f"{thread.name}: {where}")
        tasks = collections.Counter(_awaiting(t.get_coro()) for t in asyncio.all_tasks())
        waits = "; ".join(f"{n} x {where}" for where, n in tasks.most_common(12))
        return parts + f"; threads: {idle} idle workers, others: {'; '.join(busy) or 'none'}; tasks: {waits}"

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            try:
                return await super()._communicate_with_peer(peer_id)
            except Exception as e:  # hivemind logs it at DEBUG only; the parts of this reducer are zeros now
                log.warning("all-reduce: no average from reducer %s (%d elements zeroed so far): %r", peer_id,
                            self.tensor_part_container.failed_size, e)
                self._broken.add(peer_id)  # its parts to us are waited for `BROKEN_SENDER_S` at most (`_watch`)
                if peer_id in self._replied and (peer_id not in self.active_senders or unreachable(e)):
                    # it died before opening its stream as our sender too, or no connection to it is left (a dial
                    # failed: its open sender stream ran over the connection that is gone), so no more of its parts
                    # will come; hivemind would ban it only after sender_timeout (`_handle_missing_senders`), and
                    # meanwhile every other member waits for our averaged parts (BENCHMARKS.md 3q: 20-30 s)
                    await self._ban_sender(peer_id, "its reducer stream failed to dial" if unreachable(e)
                                           else "its reducer stream failed before its sender stream opened")
                raise
        # Our own part: average it here, then take it through the compression the others receive it with.
        if faults.stalls_reducer(self._round):
            await asyncio.Event().wait()  # never set: the fault's hung reducer (`_watch` ends the all-reduce)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            self.tensor_part_container.register_processed_part(
                peer_index, part_index, roundtrip(averaged, self._compression)
            )

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return _ClosingAfterLastPart(super()._get_peer_stub(peer),
                                     self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(peer)])

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._count(message.tensor_part.ByteSize())
            yield message
            faults.point("allreduce_part_sent", self._round)
            if faults.mutes_sender(self._round):
                await asyncio.Event().wait()  # never set: the fault's mute sender, its stream left open

    async def rpc_aggregate_part(self, stream, context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        # hivemind's, marking the sender served once its reply stream is over (every averaged part written to it)
        if faults.mutes_sender(self._round):  # once its own sender streams are open: their first parts are sent
            await asyncio.sleep(1.0)
            raise AllreduceException("fault mute_sender: this reducer refuses every sender")
        sent = 0
        try:
            async for message in super().rpc_aggregate_part(stream, context):
                sent += message.code == averaging_pb2.AVERAGED_PART  # counted as the sender counts them
                yield message
            if sent == self.tensor_part_reducer.num_parts:
                # every averaged part is written: keep our end open until the sender closes its own, which it does
                # once it holds them all (`_ClosingAfterLastPart`); hivemind then cancels this handler. A reply stream
                # that the reducer closes first can lose its last parts in flight (seen on loopback under load: "peer
                # ... sent 15 parts, but we expected 16"), and the sender fills them with zeros
                await asyncio.sleep(self.sender_timeout or 30.0)
        except (asyncio.CancelledError, GeneratorExit):  # the sender closed (GeneratorExit: while we were writing)
            if sent < self.tensor_part_reducer.num_parts:
                log.warning("all-reduce: the reply stream to %s was cut after %d of %d parts", context.remote_id, sent,
                            self.tensor_part_reducer.num_parts)
            elif self._closed_by_sender is not None:
                with self._closed_by_sender.get_lock():
                    self._closed_by_sender.value += 1
            raise
        finally:
            if context.remote_id in self._replied:
                self._replied[context.remote_id].set()

    async def replies_sent(self, timeout_s: float | None) -> list[PeerID]:
        """Wait until every other sender holds this reducer's averaged parts (it closed its reply stream after the last
        part, its stream broke off, or it was banned), at most ``timeout_s`` seconds; returns the senders still
        unserved.

        hivemind's `run` ends as soon as *this* peer holds every averaged part; its replies to the others go out
        from separate RPC handlers, which may still be writing. A peer that shut down right then (a node at the
        run's end) cut the last parts of its share off the others' averages (they fill them with zeros).
        """
        if self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)] == 0:
            return []  # no share of the vector to reduce: nobody waits on us

        pending = [done.wait() for done in self._replied.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*pending), timeout_s)
        except asyncio.TimeoutError:
            pass
        return [p for p, done in self._replied.items() if not done.is_set()]

    async def _ban_sender(self, peer_id: PeerID, why: str = "by hivemind: its stream failed or timed out") -> None:
        """hivemind's ban, logged at WARNING with how many parts the sender gave and ``why`` (which rule banned it;
        hivemind's own calls give none: a stream that raised or outlasted ``sender_timeout``, a sender that never
        started)."""
        if peer_id not in self.banned_senders:
            index = self.sender_peer_ids.index(peer_id)
            log.warning("all-reduce: sender %s banned after %d of %d parts (%s); the rest are averaged without it",
                        peer_id, self.tensor_part_reducer.num_parts_received[index], self.tensor_part_reducer.num_parts,
                        why)
        await super()._ban_sender(peer_id)
        if peer_id in self._replied:  # a sender that failed is owed nothing more
            self._replied[peer_id].set()

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # Same as hivemind's, except that the reply is the average itself rather than average - sender's part.
        part_index = 0
        # fault injection: answer the first sender only, then die (the others never receive our parts)
        kill_in_reply = faults.withholds_replies(self._round)
        answer = not (kill_in_reply and self._answered_one)
        self._answered_one = True
        if not answer:  # withheld on purpose: this peer's step does not wait for it (`replies_sent`)
            self._replied[self.sender_peer_ids[sender_index]].set()
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
                    if part_index == self.tensor_part_reducer.num_parts:  # the last part: a late reply (fault injection)
                        await asyncio.sleep(faults.reply_delay_s(self._round))
                    self._count(serialized.ByteSize())
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
            if kill_in_reply:
                if answer:
                    self._replied[self.sender_peer_ids[sender_index]].set()  # every part is written: served
                    # the kill, 1 s on (the answered sender receives its last part), runs apart from this handler:
                    # the sender closes the stream once it holds every part, which cancels the handler
                    self._dying = asyncio.create_task(self._die_after_answer())
                await asyncio.sleep(3600.0)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index], "its stream ended early")

    async def _die_after_answer(self) -> None:
        await asyncio.sleep(1.0)
        faults.point("reducer_answered", self._round)


def _where(function: str, filename: str, lineno: int) -> str:
    """``function (file.py:line)``: one frame in `ExactAllReduceRunner.describe`'s line."""
    return f"{function} ({filename.rsplit('/', 1)[-1]}:{lineno})"


def _awaiting(coro: Any) -> str:
    """Where a task's coroutine is suspended: its outermost frame and, following what each frame awaits, the
    innermost one reachable (the chain stops where an async generator is iterated: its ``asend`` object hides it).
    For `ExactAllReduceRunner.describe`: e.g. a handler blocked writing a reply to a peer that reads nothing more."""
    def where(frame: Any) -> str:
        return _where(frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno)

    outer = inner = None
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            outer, inner = outer or where(frame), where(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return f"{outer} > {inner}" if outer != inner else str(outer)


class _ClosingAfterLastPart:
    """A reducer's stub whose ``rpc_aggregate_part`` reply stream is closed by us, the sender, as soon as it has
    delivered the ``parts`` averaged parts we expect (an error reply ends it as before). The reducer keeps its end open
    until then (`ExactAllReduceRunner.rpc_aggregate_part`): the side that closes a libp2p stream first is the one
    that holds every byte it needs."""

    def __init__(self, stub: Any, parts: int):
        self._stub, self._parts = stub, parts

    async def rpc_aggregate_part(self, requests: AsyncIterator[averaging_pb2.AveragingData]
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        return self._until_last_part(await self._stub.rpc_aggregate_part(requests))

    async def _until_last_part(self, stream: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        received = 0
        try:
            async for message in stream:
                yield message
                received += message.code == averaging_pb2.AVERAGED_PART
                if received == self._parts:
                    return
        finally:
            await stream.aclose()  # hivemind's reader closes our end of the stream


class SparseGatherRunner:
    """All-gather of one compressed message per contributor, then the same weighted mean on every member.

    Stands in for hivemind's `AllReduceRunner` when the codec is ``sparse-2bit`` (module docstring): it serves the
    same RPC (``rpc_aggregate_part``, dispatched by `DecentralizedAverager` to the group's runner), so it needs no new
    RPC and a closed run's membership check (`composer_diloco.outer.auth.MembersOnlyAverager`) covers it unchanged.

    Args:
        p2p, servicer_type, prefix, group_id, ordered_peer_ids: as hivemind's `AllReduceRunner`.
        codec: the run's `SparseCodec`.
        contributors: ``{index in ordered_peer_ids: weight}`` of the members whose messages are averaged (weight > 0,
            not screened out), the same on every member.
        message: this peer's message when it is a contributor, else None.
        bytes_sent: an ``mp.Value('Q')`` incremented by the serialized size (bytes) of every piece sent.
        sender_timeout: seconds a contributor may take to start its message, and between two of its pieces.
        piece_bytes: a message travels in pieces of at most this many bytes (libp2p caps one frame at 4 MiB).
        round_: the DiLoCo round (fault injection only).

    ``await run()`` returns ``(mean, missing)``: the fp32 (numel,) mean of the messages received (`weighted_mean`,
    group order), or None when none arrived; ``missing`` lists the contributors whose message did not arrive.
    """

    def __init__(self, *, p2p: Any, servicer_type: Any, prefix: str | None, group_id: bytes,
                 ordered_peer_ids: Sequence[PeerID], codec: SparseCodec, contributors: dict[int, float],
                 message: bytes | None, bytes_sent: Any, sender_timeout: float | None, piece_bytes: int = 2**19,
                 round_: int | None = None):
        self._p2p, self._servicer_type, self._prefix = p2p, servicer_type, prefix
        self.peer_id, self.group_id, self.ordered_peer_ids = p2p.peer_id, group_id, list(ordered_peer_ids)
        self.codec, self.contributors, self.message = codec, dict(contributors), message
        self._bytes_sent, self.sender_timeout, self.piece_bytes = bytes_sent, sender_timeout or 30.0, piece_bytes
        self._round = round_
        self._me = self.ordered_peer_ids.index(self.peer_id)
        if (self._me in self.contributors) != (message is not None):
            raise ValueError("a contributor must send a message, and only a contributor")
        self.received: dict[int, bytes] = {self._me: message} if message is not None else {}
        others = [i for i in self.contributors if i != self._me]
        self._started = {i: asyncio.Event() for i in others}  # its first piece came
        self._done = {i: asyncio.Event() for i in others}  # its message came whole, or never will
        self._future: asyncio.Future = asyncio.get_event_loop().create_future()

    async def run(self) -> tuple[torch.Tensor | None, list[int]]:
        """Send our message to every other member, wait for the contributors' messages (or their timeouts), and
        return ``(mean, missing)`` (class docstring)."""
        sends = [asyncio.create_task(self._send_to(peer_id)) for i, peer_id in enumerate(self.ordered_peer_ids)
                 if i != self._me and self.message is not None]
        try:
            await asyncio.gather(*(self._wait_for(i) for i in self._done))
            await asyncio.gather(*sends, return_exceptions=True)  # failures are logged in _send_to
        finally:
            for task in sends:
                task.cancel()
            self.finalize()
        order = sorted(self.received)  # group order: the same on every member
        missing = sorted(set(self.contributors) - set(order))
        if not order:
            return None, missing
        loop = asyncio.get_event_loop()
        mean = await loop.run_in_executor(None, lambda: self.codec.combine(
            [self.received[i] for i in order], [self.contributors[i] for i in order]))
        return mean, missing

    async def _wait_for(self, index: int) -> None:
        """Until contributor ``index``'s message is in or given up: it must start within ``sender_timeout`` (a
        message under way is timed piece by piece in `rpc_aggregate_part`)."""
        try:
            await asyncio.wait_for(self._started[index].wait(), self.sender_timeout)
        except asyncio.TimeoutError:
            if not self._started[index].is_set():
                log.warning("all-gather: no message from %s within %.0f s", self.ordered_peer_ids[index],
                            self.sender_timeout)
                self._done[index].set()
        await self._done[index].wait()

    async def _send_to(self, peer_id: PeerID) -> None:
        message = self.message
        total = len(message)

        async def pieces() -> AsyncIterator[averaging_pb2.AveragingData]:
            for at in range(0, total, self.piece_bytes):
                part = runtime_pb2.Tensor(buffer=message[at:at + self.piece_bytes], size=[total], dtype="uint8",
                                          compression=runtime_pb2.CompressionType.NONE)
                with self._bytes_sent.get_lock():
                    self._bytes_sent.value += part.ByteSize()
                yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id,
                                                  tensor_part=part)
                faults.point("allreduce_part_sent", self._round)

        try:
            stub = self._servicer_type.get_stub(self._p2p, peer_id, namespace=self._prefix)
            stream = await stub.rpc_aggregate_part(pieces())
            reply = await asyncio.wait_for(anext(stream), 2 * self.sender_timeout)
            if reply.code != averaging_pb2.AVERAGED_PART:
                log.warning("all-gather: %s refused our message: %s", peer_id,
                            averaging_pb2.MessageCode.Name(reply.code))
        except Exception as e:
            log.warning("all-gather: could not send our message to %s: %r", peer_id, e)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Receive one contributor's message (its pieces, in order) and acknowledge it."""
        sender = self.ordered_peer_ids.index(context.remote_id) if context.remote_id in self.ordered_peer_ids else -1
        if sender not in self._done or self._started[sender].is_set() or self._done[sender].is_set():
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        self._started[sender].set()
        chunks: list[bytes] = []
        received, total = 0, None
        try:
            async for data in aiter_with_timeout(stream, self.sender_timeout):
                if data.group_id != self.group_id or not data.tensor_part.size:
                    break
                total = int(data.tensor_part.size[0])
                chunks.append(data.tensor_part.buffer)
                received += len(data.tensor_part.buffer)
                if received > total:  # more than announced: not a message of this protocol
                    break
                # read on to the sender's end of stream: a reply written before it makes the sender's
                # end-of-stream write fail (BrokenPipeError) once this handler closes the stream
        except Exception as e:
            log.warning("all-gather: the message of %s broke off: %r", context.remote_id, e)
        finally:  # also when hivemind cancels this handler (the sender's connection closed): `run` waits for _done
            # a message whose bytes all came counts, even if its end of stream did not (its sender died just after)
            complete = total is not None and received == total and not self._done[sender].is_set()
            if complete:
                self.received[sender] = b"".join(chunks)
            self._done[sender].set()
        yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART if complete else
                                          averaging_pb2.INTERNAL_ERROR)

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None) -> None:
        """Stop waiting for messages (those not in yet count as missing); idempotent."""
        for event in self._done.values():
            event.set()
        if not self._future.done():
            self._future.set_result(None)


class ExactAverager(DecentralizedAverager):
    """A `DecentralizedAverager` whose ``step`` replaces the averaged tensors by bit-identical weighted means.

    Args:
        averaged_tensors: fp32 CPU tensors (the pseudo-gradient buffers), moved to shared memory by hivemind.
        dht: a running `hivemind.DHT`.
        kwargs: as `hivemind.averaging.DecentralizedAverager` (``prefix``, ``compression``, timeouts ...).

    It serves no state: hivemind's ``rpc_download_state`` answers an empty stream ("no state here"). A peer's state
    (theta and the outer optimizer's) travels through `composer_diloco.outer.state_transfer`, served from the peer's
    own process in bounded chunks; the averager still declares itself under ``{prefix}.all_averagers`` with its
    ``state_sharing_priority``, which is how a downloader finds and orders the peers to ask.

    ``step`` returns ``{peer_id: Contribution}`` in group order: each member's gathered metadata with the screening
    verdict applied to it (see `Contribution`), or raises / returns None as hivemind's (no group in time).

    Attributes:
        bytes_sent: total bytes of tensor payload this peer has sent in all-reduces (shared across processes); with a
            codec that puts data in the gathered metadata (``shared-blocks``' scores), also that data, once for each
            other member of the group.
        failed_size: elements of the last all-reduce that no reducer returned (zeroed), shared across processes.
        replies_closed_by_sender: reply streams, over all all-reduces, whose sender closed them once it held every
            averaged part of this peer's share (`ExactAllReduceRunner.rpc_aggregate_part`); shared across processes.
        max_norm_ratio: screening threshold handed to `composer_diloco.outer.screening.screen` (None = NaN/Inf only).
        codec: the run's wire codec (`composer_diloco.outer.codec_contract.WireCodec`), None for a plain dense
            butterfly with ``compression``. A "gather" codec (``sparse-2bit``): ``step`` all-gathers messages instead
            of running the butterfly (module docstring); each member's gathered metadata must then be a dict with its
            ``weight``, and a member of weight > 0 must hand over its message with `set_message` before each ``step``.
            A "butterfly" codec with ``pack``/``unpack`` (``shared-blocks``): the butterfly averages what ``pack``
            makes of the buffers, given the group's metadata, and ``unpack`` writes the mean back.
        sparse_codec: the older name of ``codec`` for a `SparseCodec`.
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, max_norm_ratio: float | None = None,
                 codec: Any = None, sparse_codec: SparseCodec | None = None, **kwargs: Any):
        self.max_norm_ratio = max_norm_ratio
        self.codec = codec if codec is not None else sparse_codec
        self.gathers = getattr(self.codec, "transport", "butterfly") == "gather"
        if self.gathers and self.codec.numel != sum(t.numel() for t in averaged_tensors):
            raise ValueError(f"codec over {self.codec.numel} elements, averaged tensors hold "
                             f"{sum(t.numel() for t in averaged_tensors)}")
        self._messages: dict[int, bytes] = {}  # by round, in the averager process (a "gather" codec only)
        # the message goes from this process to the averager's through shared memory allocated before hivemind forks
        # (like the averaged tensors): hivemind's control pipe is non-blocking on the averager's side, and a message
        # of a few KB sent through it fails there with EAGAIN half-read (BlockingIOError), which breaks its loop
        self._message_buffer = None if not self.gathers else \
            torch.zeros(self.codec.max_message_bytes(), dtype=torch.uint8).share_memory_()
        self._message_lock = threading.Lock()
        self.bytes_sent = mp.Value(ctypes.c_uint64, 0)
        self.failed_size = mp.Value(ctypes.c_uint64, 0)
        self.replies_closed_by_sender = mp.Value(ctypes.c_uint64, 0)
        self._verdicts: dict[bytes, list[Rejection | None]] = {}  # by group id, in the averager process
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self) -> None:
        """The averager process's main (hivemind's), with glibc's mmap threshold pinned first
        (`composer_diloco.malloc.fix_mmap_threshold`): the all-reduce parts and state chunks this process allocates by
        the thousand would otherwise stay in its heap at their peak, 3-4 copies of theta (BENCHMARKS.md, section 3c)."""
        fix_mmap_threshold()
        super().run()

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's ``rpc_join_group`` (this peer leads the group), which keeps its end of the stream open after
        BEGIN_ALLREDUCE until the follower closes its own (it does once it read the message), at most
        ``request_timeout`` seconds. hivemind's handler returns right after writing BEGIN_ALLREDUCE, and a libp2p
        stream closed first by its writer can lose what is still in flight, as the all-reduce's reply streams did
        (`ExactAllReduceRunner.rpc_aggregate_part`): a follower then read an empty stream, searched on alone and, the
        others averaging without it, sat out the whole step timeout ("could not find a group", about 1 round in
        80-300 under load). hivemind's own handler has ended by then (its follower bookkeeping is done): only the
        stream stays open."""
        began = False
        async for message in super().rpc_join_group(request, context):
            began = message.code == averaging_pb2.BEGIN_ALLREDUCE
            yield message
        if began:
            await asyncio.sleep(self._matchmaking.request_timeout)  # cancelled when the follower closes

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """An empty stream, always (hivemind's own "no state here"): state moves through
        `composer_diloco.outer.state_transfer`. hivemind's handler would copy the whole state to this process and
        serialize it before the first byte leaves, which a 0.6B model's 7 GB never survived. Annotated with typing's
        AsyncIterator, not collections.abc's: hivemind recognizes a streaming RPC by it."""
        return
        yield  # an async generator that yields nothing

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

    def set_message(self, round_: int, message: bytes) -> None:
        """Hand this peer's compressed message of round ``round_`` to the averager process (``sparse_codec`` only):
        the next ``step`` whose gathered metadata says ``round == round_`` sends it. Older rounds' messages are
        dropped. The bytes travel through a shared-memory buffer of `SparseCodec.max_message_bytes` bytes; the
        control pipe carries only their length, and this call returns once the averager process has copied them.

        Raises:
            ValueError: no sparse codec, or a message longer than the codec's bound (not one of its messages).
        """
        if self._message_buffer is None:
            raise ValueError("set_message: this averager has no sparse codec")
        if len(message) > self._message_buffer.numel():
            raise ValueError(f"set_message: message of {len(message)} bytes, the codec's bound is "
                             f"{self._message_buffer.numel()}")
        with self._message_lock:  # one message in the buffer at a time
            if message:
                self._message_buffer[:len(message)].copy_(torch.frombuffer(bytearray(message), dtype=torch.uint8))
            future = MPFuture()
            self._outer_pipe.send(("_set_message", [], dict(round_=round_, length=len(message), future=future)))
            future.result()

    async def _set_message(self, round_: int, length: int, future: MPFuture) -> None:
        try:
            self._messages = {round_: self._message_buffer[:length].numpy().tobytes()}
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
        if self.gathers:
            return await self._all_gather(tensors, group_info, group_id, gathered, dropped, **kwargs)
        if me in dropped:  # send zeros with weight 0: 0 * NaN would still poison the reducers' sums
            for t in tensors:
                t.zero_()
            kwargs["weight"] = 0.0
        shared, packing = tensors, getattr(self.codec, "pack", None) is not None
        if packing:  # the codec averages part of the buffers, chosen from the group's metadata (the same everywhere)
            tensors, selection = self.codec.pack(shared, gathered, dropped)
            kwargs["tensor_infos"] = None  # hivemind's describe the buffers, not the packed tensors
            # hivemind hands whole parts to reducers: a packed vector under one part (512 KB) would be reduced by one
            # peer, whose bytes then grow with the group. Parts of a share of it spread the reducing over the group
            packed = sum(t.numel() * t.element_size() for t in tensors)
            kwargs["part_size_bytes"] = min(kwargs.get("part_size_bytes") or 2**19,
                                            max(1024, packed // (4 * len(group_info.peer_ids))))
            # the codec's part of the metadata reached every other member (through the group's leader, which relays
            # it): count it as this peer's, once per other member
            self._count_bytes((len(gathered) - 1) * self.codec.metadata_bytes(gathered[me]))
        mine = gathered[me] if isinstance(gathered[me], dict) else {}
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            bytes_sent=self.bytes_sent,
            closed_by_sender=self.replies_closed_by_sender,
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
        if packing:
            self.codec.unpack(tensors, shared, selection)
        self.failed_size.value = runner.tensor_part_container.failed_size
        # return only once our replies as a reducer are out: the caller may shut this averager down next. A sender
        # that reads them slower than sender_timeout is given up on (hivemind bans a reducer only after twice that)
        unserved = await runner.replies_sent(kwargs.get("sender_timeout"))
        if unserved:
            log.warning("all-reduce: the averaged parts for %s were not all sent in time", unserved)

    def _count_bytes(self, size: int) -> None:
        with self.bytes_sent.get_lock():
            self.bytes_sent.value += size

    async def _all_gather(self, tensors, group_info, group_id: bytes, gathered: list, dropped: frozenset[int],
                          **kwargs) -> None:
        """A "gather" codec's round: all-gather the contributors' messages, write their weighted mean into
        ``tensors`` (module docstring). Raises ValueError when a member's metadata carries no weight."""
        weights = []
        for g in gathered:
            if not isinstance(g, dict) or not isinstance(g.get("weight"), (int, float)):
                raise ValueError("the sparse codec needs each member's weight in its gathered metadata")
            weights.append(float(g["weight"]))
        contributors = {i: w for i, w in enumerate(weights) if w > 0 and i not in dropped}
        me = group_info.peer_ids.index(self.peer_id)
        round_ = gathered[me].get("round")
        message = self._messages.pop(round_, None) if me in contributors else None
        if me in contributors and message is None:
            raise ValueError(f"no message was set for round {round_} (ExactAverager.set_message)")
        runner = SparseGatherRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, codec=self.codec, contributors=contributors,
            message=message, bytes_sent=self.bytes_sent, sender_timeout=kwargs.get("sender_timeout"), round_=round_,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        try:
            mean, missing = await runner.run()
        except CodecError as e:  # a member sent a message that does not decode: no mean this peer can trust
            raise ValueError(f"all-gather: {e}") from e
        if mean is None:
            mean = torch.zeros(self.codec.numel)
        for tensor, part in zip(tensors, self.codec.split(mean), strict=True):
            tensor.copy_(part.view_as(tensor))
        self.failed_size.value = self.codec.numel if missing else 0


__all__ = ["Contribution", "ExactAverager", "ExactAllReduceRunner", "unreachable"]
