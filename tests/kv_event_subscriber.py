"""A KV event subscriber as a router would write one: vLLM's event schema (msgspec structs,
declared here as vLLM declares them: the batch a positional array, each event a map tagged by
"type"), a SUB socket, sequence-gap detection and the replay socket; it rebuilds the set of
block hashes each medium holds."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class BlockSets:
    """Per medium, the hashes stored and not removed since (vLLM's semantics)."""

    def __init__(self) -> None:
        self.media: dict[str, set[int]] = {}
        self.stored_events: list[BlockStored] = []

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.media.setdefault(ev.medium, set()).update(ev.block_hashes)
                self.stored_events.append(ev)
            elif isinstance(ev, BlockRemoved):
                self.media.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
            else:
                self.media.clear()

    def of(self, medium: str) -> set[int]:
        return set(self.media.get(medium, ()))


class Subscriber:
    """SUB on `endpoint` (connect), replay requests to `replay` (a DEALER); `poll` applies
    every batch in sequence order, replaying a gap before going on."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "",
                 rcvhwm: int = 1000, bind: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.replay_endpoint = replay
        self.topic = topic.encode()
        self.sets = BlockSets()
        self.next_seq = 0
        self.gaps = 0
        self.batches = 0
        self.lags: list[float] = []  # receive time - batch ts, seconds

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = DECODER.decode(payload)
        self.lags.append(time.time() - batch.ts)
        self.sets.apply(batch)
        self.batches += 1
        self.next_seq = seq + 1

    def replay(self, start: int, timeout: float = 5.0) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.replay_endpoint)
        s.send_multipart((b"", start.to_bytes(8, "big")))
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                if not s.poll(100):
                    continue
                _, seq_b, payload = s.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq < 0:
                    return
                if seq >= self.next_seq:
                    self._apply(seq, payload)
            raise TimeoutError("replay did not finish")
        finally:
            s.close()

    def poll(self, quiet: float = 0.3, timeout: float = 10.0) -> None:
        """Read until nothing arrives for `quiet` seconds (replaying any gap)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.sub.poll(int(quiet * 1000)):
                return
            topic, seq_b, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_b, "big")
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self.gaps += 1
                assert self.replay_endpoint is not None, f"gap {self.next_seq}..{seq}, no replay"
                self.replay(self.next_seq)
                if seq < self.next_seq:
                    continue
            self._apply(seq, payload)
        raise TimeoutError("events kept coming")

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()
