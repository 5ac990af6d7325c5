"""KV cache events in vLLM's wire format, published over ZeroMQ off the engine thread.

`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "topic": "kv-events", "replay_endpoint": "tcp://*:5558"}'` takes vLLM's
`KVEventsConfig` keys with vLLM's defaults (`parse_config`; an unknown key or a wrong type is a
KVEventsConfigError naming it).

Wire format (vLLM's `vllm/distributed/kv_events.py`, current layout):
- a PUB socket sends each batch as three frames: the topic, the batch's sequence number as 8
  bytes big-endian (0, 1, 2, ... per publisher), the msgpack payload;
- the payload is an `EventBatch` as a positional array `[ts, events, data_parallel_rank]`
  (ts: seconds since the epoch when the step ended; the rank is 0);
- each event is a tagged map (`"type"` first): `BlockStored` {block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name}, `BlockRemoved` {block_hashes, medium},
  `AllBlocksCleared` {};
- a block hash is the last 8 bytes of pagedkv's sha256 chain hash as an unsigned int (vLLM's
  int form of its hashes); the chain has a fixed root, so every replica names a block alike;
- the replay socket (ROUTER) answers a request `[b"", start_seq (8 bytes big-endian)]` with
  `[b"", seq, payload]` for each buffered batch from start_seq on (the last `buffer_steps`),
  then `[b"", -1 (8 bytes, signed), b""]`.

Flow: the cache records its events (cache/kv_events.py); the engine hands the step's events to
`publish` once per step (a bounded queue: when it is full the batch is dropped and counted,
the engine never waits); the publisher thread encodes and sends them, drains the tiers'
recorders (their writes happen on the tier's thread) and serves replays. ZeroMQ drops batches
for one subscriber that falls `hwm` batches behind without slowing the others; that
subscriber sees a gap in the sequence numbers and asks the replay socket.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from pagedkv.cache.kv_events import Cleared, Event, KVEventRecorder, Removed, Stored
from pagedkv.errors import KVEventsConfigError

log = logging.getLogger("pagedkv.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENDPOINT = re.compile(r"^(tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.:-]+):(\d{1,5})"
                       r"|ipc://.+|inproc://.+)$")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys and defaults (publisher None: "zmq" when enabled)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def _fail(key: str, message: str) -> KVEventsConfigError:
    exc = KVEventsConfigError(f"kv_events_config: {key} {message}")
    exc.options = ("kv_events_config",)  # type: ignore[attr-defined]
    return exc


def parse_config(value: object) -> KVEventsConfig | None:
    """The config of a JSON object (text), a mapping or a KVEventsConfig; None for None."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _fail("", f"is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, Mapping):
        raise _fail("", f"must be a JSON object, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
    for key in value:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _fail(repr(key), f"is not a known key{hint}")
    cfg = KVEventsConfig(**value)
    _check(cfg)
    if cfg.publisher is None:
        cfg = dataclasses.replace(cfg, publisher="zmq" if cfg.enable_kv_cache_events else "null")
    return cfg


def _check(c: KVEventsConfig) -> None:
    if not isinstance(c.enable_kv_cache_events, bool):
        raise _fail("enable_kv_cache_events", f"must be true or false, got "
                                              f"{c.enable_kv_cache_events!r}")
    if c.publisher not in (None, "zmq", "null"):
        raise _fail("publisher", f"must be \"zmq\" or \"null\", got {c.publisher!r}")
    for key in ("endpoint", "replay_endpoint"):
        v = getattr(c, key)
        if v is None and key == "replay_endpoint":
            continue
        m = _ENDPOINT.match(v) if isinstance(v, str) else None
        if m is None or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
            raise _fail(key, f"must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {v!r}")
    for key, top in (("buffer_steps", 10**7), ("hwm", 10**7), ("max_queue_size", 10**7)):
        v = getattr(c, key)
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= top):
            raise _fail(key, f"must be an int in [1, {top}], got {v!r}")
    if not isinstance(c.topic, str) or len(c.topic.encode()) > 256:
        raise _fail("topic", f"must be a string of at most 256 bytes, got {c.topic!r:.80}")
    if (c.replay_endpoint is not None and c.enable_kv_cache_events
            and c.replay_endpoint == c.endpoint):
        raise _fail("replay_endpoint", "must differ from endpoint")


# --- wire encoding ---------------------------------------------------------------------------


def external_hash(h: bytes) -> int:
    """vLLM's int form of a block hash: the last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(h[-8:], "big")


def event_map(ev: Event, block_size: int) -> dict[str, Any]:
    """One event as vLLM's tagged map."""
    if isinstance(ev, Stored):
        return {"type": "BlockStored", "block_hashes": [external_hash(h) for h in ev.hashes],
                "parent_block_hash": None if ev.parent is None else external_hash(ev.parent),
                "token_ids": list(ev.token_ids), "block_size": block_size, "lora_id": None,
                "medium": ev.medium, "lora_name": None}
    if isinstance(ev, Removed):
        return {"type": "BlockRemoved", "block_hashes": [external_hash(h) for h in ev.hashes],
                "medium": ev.medium}
    assert isinstance(ev, Cleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Iterable[Event], block_size: int, rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([ts, [event_map(e, block_size) for e in events], rank])


# --- the publisher -------------------------------------------------------------------------------


_STOP = object()


@dataclasses.dataclass(slots=True)
class PublisherStats:
    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0  # the queue was full (the publisher thread behind): never sent
    events_dropped: int = 0
    send_errors: int = 0
    replays: int = 0


class KVEventPublisher:
    """A PUB socket (bound when the endpoint has `*`, `::`, ipc:// or inproc://, else
    connected: vLLM's rule), an optional ROUTER replay socket, a bounded queue and one
    daemon thread. `publish` never blocks; everything else happens on the thread."""

    POLL_S = 0.05

    def __init__(self, config: KVEventsConfig, block_size: int,
                 background: Iterable[KVEventRecorder] = ()) -> None:
        import zmq

        self.config = config
        self.block_size = block_size
        self.background = list(background)
        self.stats = PublisherStats()
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            ep = config.endpoint
            if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                self._pub.bind(ep)
            else:
                self._pub.connect(ep)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise _fail("endpoint", f"cannot be opened: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    # --- engine thread -------------------------------------------------------------------------

    def publish(self, events: list[Event]) -> bool:
        """Queue one batch (the step's events); False (dropped, counted) when the queue is full."""
        if not events:
            return True
        try:
            self._q.put_nowait((time.time(), events))
            return True
        except queue.Full:
            with self._lock:
                self.stats.batches_dropped += 1
                self.stats.events_dropped += len(events)
            return False

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dataclasses.asdict(self.stats)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued batch (and the tiers' pending events) has been sent."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and (self._q.unfinished_tasks
                                          or any(len(r) for r in self.background)):
            time.sleep(0.005)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), stop the thread, close the sockets."""
        if self._thread.is_alive():
            try:
                self._q.put(_STOP, timeout=timeout)
            except queue.Full:  # the thread is stuck behind a full queue: stop it as it is
                self._running = False
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    # --- publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            try:
                self._serve_replays()
                try:
                    item = self._q.get(timeout=self.POLL_S)
                except queue.Empty:
                    item = None
                try:
                    if item is _STOP:
                        self._drain_background()
                        return
                    if item is not None:
                        self._send(*item)
                    self._drain_background()
                finally:
                    if item is not None:
                        self._q.task_done()
            except Exception:  # noqa: BLE001 - the publisher never takes the engine down
                log.exception("KV event publisher failed; going on")
                with self._lock:
                    self.stats.send_errors += 1
                time.sleep(self.POLL_S)

    def _drain_background(self) -> None:
        for rec in self.background:
            events = rec.take()
            if events:
                self._send(time.time(), events)

    def _send(self, ts: float, events: list[Event]) -> None:
        import zmq

        payload = encode_batch(ts, events, self.block_size)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            with self._lock:
                self.stats.send_errors += 1
            return
        with self._lock:
            self.stats.batches_published += 1
            self.stats.events_published += len(events)

    def _serve_replays(self) -> None:
        import zmq

        r = self._replay
        if r is None:
            return
        while r.poll(0):
            frames = r.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed KV event replay request (%d frames)",
                            len(frames))
                continue
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                self.stats.replays += 1
            try:
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        r.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload),
                                         flags=zmq.NOBLOCK)
                r.send_multipart((ident, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # the requester went away or is too slow: its loss only
                continue


class EngineKVEvents:
    """The engine's side: a recorder on the cache (and one on the KV tier), the publisher, and
    `after_step` (the step's events as one batch). Built only when events are enabled."""

    def __init__(self, config: KVEventsConfig, cache: Any, tier: Any = None) -> None:
        self.recorder = KVEventRecorder(cache.block_size)
        background = []
        if tier is not None:
            tier.events = KVEventRecorder(cache.block_size)
            background.append(tier.events)
        self.publisher = KVEventPublisher(config, cache.block_size, background)
        self.cache = cache
        self.tier = tier
        cache.attach_events(self.recorder)
        for h, _ in cache.cached_blocks():  # restored from a snapshot before we were attached
            self.recorder.stored((h,), None, None)
        self.after_step()

    def after_step(self) -> None:
        """Queue the events recorded since the last call as one batch (none: nothing sent)."""
        if len(self.recorder):
            self.publisher.publish(self.recorder.take())

    def cleared(self) -> None:
        """Every medium was emptied (a reset with the tier): one AllBlocksCleared."""
        self.recorder.take()  # the removals the reset recorded are covered by the clear
        if self.tier is not None and self.tier.events is not None:
            self.tier.events.take()
        self.recorder.cleared()
        self.after_step()

    def stats(self) -> dict[str, int]:
        return self.publisher.snapshot()

    def close(self) -> None:
        self.after_step()
        self.cache.attach_events(None)
        if self.tier is not None:
            self.tier.events = None
        self.publisher.close()


__all__ = ["END_SEQ", "EngineKVEvents", "KVEventPublisher", "KVEventsConfig", "encode_batch", "event_map",
           "external_hash", "parse_config"]
