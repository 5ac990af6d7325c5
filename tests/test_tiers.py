"""KV tiers without the model: records, the disk and Redis tiers (a real redis-server), the
background writer, faults, and a snapshot that survives kill -9 in the middle of a write."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pagedkv.cache import KVStorage
from pagedkv.cache.tiers import (
    BackgroundWriter,
    DiskTier,
    RedisTier,
    TierConnector,
    decode,
    encode,
    open_tier,
)
from pagedkv.errors import CorruptEntryError, StorageMismatchError, TierConfigError

FP = bytes(range(32))
OTHER_FP = bytes(32)


def storage(num_blocks: int = 8) -> KVStorage:
    return KVStorage(num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8)


def filled(num_blocks: int = 8, seed: int = 0) -> KVStorage:
    st = storage(num_blocks)
    st.kv.copy_(torch.randn(st.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return st


def parts_of(st: KVStorage, block: int) -> dict[str, torch.Tensor]:
    return {n: t[0] for n, t in st.export_blocks([block]).items()}


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


# --- storage block I/O -----------------------------------------------------------------------


def test_export_import_moves_whole_blocks() -> None:
    src, dst = filled(), storage()
    dst.import_blocks([5, 1], src.export_blocks([2, 3]))
    assert torch.equal(dst.kv[:, :, 5], src.kv[:, :, 2])
    assert torch.equal(dst.kv[:, :, 1], src.kv[:, :, 3])
    assert dst.kv[:, :, 0].abs().sum() == 0


def test_import_checks_before_writing() -> None:
    st = storage()
    bad = {"kv": torch.ones(1, 2, 2, 4, 2, 7)}
    with pytest.raises(StorageMismatchError):
        st.import_blocks([0], bad)
    assert st.kv.abs().sum() == 0


# --- records ---------------------------------------------------------------------------------


def test_record_round_trip_and_every_mismatch_rejected() -> None:
    st = filled()
    layout = st.block_layout()
    p = parts_of(st, 3)
    blob = encode(FP, key(7), p)
    assert torch.equal(decode(blob, FP, key(7), layout)["kv"], p["kv"])
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    for bad, fp, k, lay in [
        (flipped, FP, key(7), layout),  # a flipped payload byte
        (blob[:-100], FP, key(7), layout),  # truncated
        (blob[:10], FP, key(7), layout),  # truncated to almost nothing
        (blob, OTHER_FP, key(7), layout),  # another model
        (blob, FP, key(8), layout),  # another block's value under this key
        (blob, FP, key(7), storage().block_layout() | {"kv": (torch.float16, layout["kv"][1])}),
    ]:
        with pytest.raises(CorruptEntryError):
            decode(bad, fp, k, lay)


# --- disk tier -------------------------------------------------------------------------------


def test_disk_tier_put_get_contains(tmp_path: Path) -> None:
    st = filled()
    tier = DiskTier(tmp_path, FP)
    assert not tier.contains(key(1))
    tier.put(key(1), parts_of(st, 1))
    assert tier.contains(key(1))
    got = tier.get(key(1), st.block_layout())
    assert got is not None and torch.equal(got["kv"], st.kv[:, :, 1])
    assert tier.get(key(2), st.block_layout()) is None
    assert tier.stats.blocks_written == 1 and tier.stats.bytes_read > 0
    # a second process (another instance) sees it; another model does not
    assert DiskTier(tmp_path, FP).get(key(1), st.block_layout()) is not None
    assert DiskTier(tmp_path, OTHER_FP).get(key(1), st.block_layout()) is None
    assert not list(tmp_path.rglob(".tmp-*"))


def test_disk_tier_corrupt_and_truncated_files_ignored_and_counted(tmp_path: Path) -> None:
    st = filled()
    tier = DiskTier(tmp_path, FP)
    tier.put_many([(key(i), parts_of(st, i)) for i in range(3)])
    p0, p1 = tier.path(key(0)), tier.path(key(1))
    raw = bytearray(p0.read_bytes())
    raw[200] ^= 0x01
    p0.write_bytes(raw)
    p1.write_bytes(p1.read_bytes()[:1000])
    got = tier.get_many([key(0), key(1), key(2)], st.block_layout())
    assert got[0] is None and got[1] is None and got[2] is not None
    assert tier.stats.checksum_failures == 2
    assert not p0.exists() and not p1.exists()  # dropped, rewritten on the next put


def test_disk_tier_lru_cap(tmp_path: Path) -> None:
    st = filled()
    one = len(encode(FP, key(0), parts_of(st, 0)))
    tier = DiskTier(tmp_path, FP, max_bytes=3 * one)
    for i in range(3):
        tier.put(key(i), parts_of(st, i))
    assert tier.get(key(0), st.block_layout()) is not None  # 0 is now the most recent
    tier.put(key(3), parts_of(st, 3))
    assert tier.keys() == [key(2), key(0), key(3)]
    assert not tier.contains(key(1)) and tier.size_bytes <= 3 * one


def test_unusable_disk_tier_warns_and_returns_none(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, "pagedkv.tier"):
        assert open_tier(f"disk:{blocker}/kv", FP) is None
    assert "not usable" in caplog.text and "without the KV tier" in caplog.text


def test_disk_full_at_write_time_counts_errors(tmp_path: Path) -> None:
    """A real write failure (file size limit: EFBIG, like ENOSPC): counted, logged, no raise."""
    code = textwrap.dedent(f"""
        import resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from pagedkv.cache import KVStorage
        from pagedkv.cache.tiers import DiskTier
        st = KVStorage(2, 4, 4, 2, 8)
        tier = DiskTier({str(tmp_path)!r}, bytes(32))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        tier.put(bytes(32), {{n: t[0] for n, t in st.export_blocks([0]).items()}})
        print(tier.stats.errors, tier.stats.blocks_written)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0"]
    assert "put failed" in out.stderr
    assert not list(tmp_path.rglob(".tmp-*"))


def test_bad_specs() -> None:
    for spec in ["", "s3://bucket", "disk:", "disk:/x?size=1", "redis://h:1/0?ttl=0",
                 "redis://h:1/0?foo=1"]:
        with pytest.raises(TierConfigError):
            open_tier(spec, FP)


# --- writer and connector --------------------------------------------------------------------


def test_writer_drops_when_full_and_counts(tmp_path: Path) -> None:
    st = filled()
    tier = DiskTier(tmp_path, FP)
    writer = BackgroundWriter(tier, max_queue=2, batch=1)
    with tier._ilock:  # the writer thread blocks inside its first put (real lock, real thread)
        writer.submit([(key(0), parts_of(st, 0))])
        time.sleep(0.2)  # let it take that one item off the queue
        dropped = writer.submit([(key(i), parts_of(st, i)) for i in range(1, 6)])
    assert dropped == 3 and tier.stats.write_drops == 3
    writer.flush()
    writer.close()
    assert sorted(tier.keys()) == [key(0), key(1), key(2)]


def test_connector_fetch_stops_at_first_gap(tmp_path: Path) -> None:
    st = filled()
    tier = DiskTier(tmp_path, FP)
    tier.put_many([(key(i), parts_of(st, i)) for i in (0, 1, 3)])
    dst = storage()
    conn = TierConnector(tier, dst, write=False, read_batch=2)
    got = conn.fetch([key(0), key(1), key(2), key(3)])
    assert len(got) == 2
    for bid, p in zip([6, 7], got, strict=True):
        dst.import_blocks([bid], {n: t.unsqueeze(0) for n, t in p.items()})
    assert torch.equal(dst.kv[:, :, 6:8], st.kv[:, :, 0:2])
    assert conn.hit_tokens == 8 and conn.miss_tokens == 8


# --- redis tier (a real redis-server) --------------------------------------------------------


def test_redis_tier_round_trip_ttl_and_corruption(redis_server) -> None:  # noqa: ANN001
    st = filled()
    tier = open_tier(redis_server.url + "?ttl=100", FP)
    assert isinstance(tier, RedisTier)
    tier.put_many([(key(i), parts_of(st, i)) for i in range(4)])
    got = tier.get_many([key(i) for i in range(5)], st.block_layout())
    assert [g is not None for g in got] == [True] * 4 + [False]
    assert torch.equal(got[2]["kv"], st.kv[:, :, 2])
    client = redis_server.client()
    assert 0 < client.ttl(tier.key(key(0))) <= 100
    assert tier.get(key(0), st.block_layout()) is not None
    client.set(tier.key(key(1)), b"garbage" * 10)  # overwritten value
    client.set(tier.key(key(2)), client.get(tier.key(key(2)))[:-5])  # truncated value
    got = tier.get_many([key(1), key(2), key(3)], st.block_layout())
    assert got[0] is None and got[1] is None and got[2] is not None
    assert tier.stats.checksum_failures == 2
    other = open_tier(redis_server.url, OTHER_FP)
    assert other.get(key(3), st.block_layout()) is None  # another model never sees it
    assert tier.clear() >= 2 and not tier.contains(key(3))


def test_redis_down_at_start_then_up(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    from redis_server import RedisServer

    st = filled()
    server = RedisServer(tmp_path)  # not started
    with caplog.at_level(logging.WARNING, "pagedkv.tier"):
        tier = RedisTier(server.url, FP, retry_after=0.2)
        assert tier.get(key(0), st.block_layout()) is None
        tier.put(key(0), parts_of(st, 0))
    assert tier.stats.errors >= 1 and "connect failed" in caplog.text
    server.start()
    try:
        time.sleep(0.3)
        tier.put(key(0), parts_of(st, 0))
        assert tier.get(key(0), st.block_layout()) is not None
    finally:
        server.stop()


def test_redis_down_mid_run_reconnects(own_redis_server) -> None:  # noqa: ANN001
    st = filled()
    tier = RedisTier(own_redis_server.url, FP, retry_after=0.2, log_interval=60)
    tier.put(key(0), parts_of(st, 0))
    own_redis_server.stop()
    t0 = time.monotonic()
    for _ in range(20):  # fast misses while down: no stall per call
        assert tier.get(key(0), st.block_layout()) is None
    assert time.monotonic() - t0 < 5
    errors = tier.stats.errors
    assert errors >= 1
    own_redis_server.start()
    time.sleep(0.3)
    tier.put(key(1), parts_of(st, 1))
    assert tier.get(key(1), st.block_layout()) is not None
    assert tier.stats.errors == errors


# --- snapshot survives kill -9 ---------------------------------------------------------------


def test_snapshot_dir_survives_kill_9_mid_write(tmp_path: Path) -> None:
    st = filled(seed=1)
    layout = st.block_layout()
    tier = DiskTier(tmp_path, FP)
    tier.put_many([(key(i), parts_of(st, i)) for i in range(4)])  # the previous snapshot
    code = textwrap.dedent(f"""
        import torch
        from pagedkv.cache.tiers import DiskTier
        tier = DiskTier({str(tmp_path)!r}, {FP!r})
        big = {{"kv": torch.randn(64, 2, 4, 64, 64)}}  # large records: long writes
        i = 100
        while True:
            tier.put(i.to_bytes(32, "big"), big)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", code],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.rglob(".tmp-*")) or len(list(tmp_path.rglob("*.kvb"))) < 6:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    reopened = DiskTier(tmp_path, FP)
    for i in range(4):
        got = reopened.get(key(i), layout)
        assert got is not None and torch.equal(got["kv"], st.kv[:, :, i])
    big_layout = {"kv": (torch.float32, (64, 2, 4, 64, 64))}
    newer = [k for k in reopened.keys() if int.from_bytes(k, "big") >= 100]
    assert newer and all(reopened.get(k, big_layout) is not None for k in newer)
    assert reopened.stats.checksum_failures == 0
