"""KV tier records and entries as hostile input (issue 24): any record that fails to decode is a
corrupt entry (counted, dropped, a miss, never an exception), non-regular files never hang or
fail a batch, keyed tiers authenticate and encrypt per tenant, and keyless or other-keyed
replicas live in their own namespace. Disk and a real redis-server; no model."""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.cache import KVStorage, PagedKVCache
from pagedkv.cache.tiers import DiskTier, TierKey, decode, encode, open_tier
from pagedkv.cache.tiers import warm_restart as snap
from pagedkv.cache.tiers.record import MAX_HEADER
from pagedkv.errors import CorruptEntryError, TierConfigError

FP = bytes(range(32))
KEY = TierKey(bytes(range(100, 132)))
OTHER_KEY = TierKey(bytes(range(200, 232)))


def storage(num_blocks: int = 8) -> KVStorage:
    return KVStorage(num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8)


LAYOUT = storage().block_layout()


def parts(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(LAYOUT["kv"][1], generator=g)}


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def forged(header: bytes, payload: bytes = b"") -> bytes:
    """A plain record with a valid checksum around any header bytes."""
    body = struct.pack("<4sHI", b"PKVB", 1, len(header)) + header + payload
    return body + hashlib.blake2b(body, digest_size=16).digest()


def deep_header(depth: int) -> bytes:
    return (b'{"fp":"' + FP.hex().encode() + b'","key":"' + key(1).hex().encode()
            + b'","parts":' + b"[" * depth + b"]" * depth + b"}")


# --- decode: every failure is CorruptEntryError ----------------------------------------------


@pytest.mark.parametrize("header", [
    deep_header(50_000),  # was RecursionError
    deep_header(9),  # within the size limit, over the depth limit
    b" " * (MAX_HEADER + 1),
    b'{"fp": NaN, "key": "x", "parts": []}',
    b'{"fp": "a", "key": "b", "parts": [["kv", "float32", [Infinity]]]}',
    b'{"fp": "a", "key": "b", "parts": [["kv", "float32", [1e400]]]}',
    b'{"fp": "a", "key": "b", "parts": [["kv", "float32", [' + b"9" * 5000 + b"]]]}",
    b'{"fp": "a", "key": "b", "parts": [["kv", "float32", [true]]]}',
    b'{"fp": "a", "key": "b", "parts": {"kv": 1}}',
    b'{"fp": "a", "key": "b", "parts": [[1, 2]]}',
    b"[1, 2, 3]",
    b"\xff\xfe\x00",
    b'{"fp": "\\ud800", "key": 1}',
])
def test_hostile_headers_are_corrupt_entries(header: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode(forged(header), FP, key(1), LAYOUT)


def test_header_length_past_the_end_is_corrupt() -> None:
    body = struct.pack("<4sHI", b"PKVB", 1, 2**31) + b"{}"
    with pytest.raises(CorruptEntryError):
        decode(body + hashlib.blake2b(body, digest_size=16).digest(), FP, key(1), LAYOUT)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_records_decode_exactly_or_raise_corrupt(data: st.DataObject) -> None:
    p = parts(1)
    tier_key = data.draw(st.sampled_from([None, KEY]))
    blob = bytearray(encode(FP, key(1), p, tier_key, "t"))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        got = decode(bytes(blob[:cut]), FP, key(1), LAYOUT, tier_key, "t")
    except CorruptEntryError:
        return
    assert torch.equal(got["kv"], p["kv"])  # only an unchanged record decodes


# --- keys: authenticated, encrypted per tenant -----------------------------------------------


def test_sealed_records_open_only_for_their_key_tenant_and_block() -> None:
    p = parts(2)
    blob = encode(FP, key(1), p, KEY, "tenant-a")
    assert torch.equal(decode(blob, FP, key(1), LAYOUT, KEY, "tenant-a")["kv"], p["kv"])
    raw = p["kv"].numpy().tobytes()
    assert raw[:64] not in blob and raw[-64:] not in blob  # no plaintext in the store
    assert encode(FP, key(1), p, KEY, "tenant-a") != blob  # a fresh nonce every time
    for args in [(FP, key(1), LAYOUT, KEY, "tenant-b"),  # another tenant's key
                 (FP, key(1), LAYOUT, KEY, None),
                 (FP, key(1), LAYOUT, OTHER_KEY, "tenant-a"),  # another server key
                 (FP, key(2), LAYOUT, KEY, "tenant-a"),  # moved to another block
                 (bytes(32), key(1), LAYOUT, KEY, "tenant-a"),  # another model
                 (FP, key(1), LAYOUT, None, "tenant-a")]:  # a keyless reader
        with pytest.raises(CorruptEntryError):
            decode(blob, *args)
    plain = encode(FP, key(1), p)  # unauthenticated: refused when a key is set
    with pytest.raises(CorruptEntryError, match="unauthenticated"):
        decode(plain, FP, key(1), LAYOUT, KEY, "tenant-a")


def test_tier_key_parsing(tmp_path: Path) -> None:
    secret = os.urandom(32)
    assert TierKey.parse(secret.hex()).key_id == TierKey(secret).key_id
    assert TierKey.parse(base64.b64encode(secret).decode() + "\n").key_id == TierKey(secret).key_id
    (tmp_path / "k").write_text(secret.hex() + "\n")
    assert TierKey.from_file(tmp_path / "k").key_id == TierKey(secret).key_id
    assert secret.hex() not in repr(TierKey(secret))
    for bad in ["", "00" * 8, "not a key!", "abc"]:
        with pytest.raises(TierConfigError):
            TierKey.parse(bad)
    with pytest.raises(TierConfigError, match="cannot read"):
        TierKey.from_file(tmp_path / "missing")


def test_keyed_disk_tier_refuses_forged_and_foreign_records(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, key=KEY)
    tier.put(key(1), parts(1), "a")
    tier.put(key(2), parts(2), "a")
    assert tier.get(key(1), LAYOUT, "a") is not None
    assert tier.get(key(2), LAYOUT, "b") is None  # another tenant: never opened (and dropped)
    tier.path(key(1)).write_bytes(encode(FP, key(1), parts(9)))  # forged, checksum valid
    assert tier.get(key(1), LAYOUT, "a") is None
    assert tier.stats.checksum_failures == 2 and not tier.path(key(1)).exists()
    keyless, other = DiskTier(tmp_path, FP), DiskTier(tmp_path, FP, key=OTHER_KEY)
    tier.put(key(3), parts(3), "a")
    assert keyless.dir != tier.dir != other.dir  # namespaces: never seen, never dropped
    assert keyless.get(key(3), LAYOUT, "a") is None and other.get(key(3), LAYOUT, "a") is None
    assert keyless.stats.checksum_failures == other.stats.checksum_failures == 0
    assert keyless.clear() == 0 and tier.get(key(3), LAYOUT, "a") is not None


# --- disk entries that are not records -------------------------------------------------------


def _bad_entries(tier: DiskTier) -> dict[str, Path]:
    paths = {name: tier.path(key(100 + i)) for i, name in enumerate(["fifo", "dir", "link", "big"])}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(paths["fifo"])
    paths["dir"].mkdir()
    paths["link"].symlink_to("/dev/zero")
    with open(paths["big"], "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse, larger than any record
    return paths


def test_non_regular_entries_never_hang_or_fail_the_batch(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP)
    tier.put_many([(key(i), parts(i)) for i in range(3)])
    _bad_entries(tier)
    asked = [key(0), key(100), key(1), key(101), key(102), key(103), key(2)]
    out: list = []
    t = threading.Thread(target=lambda: out.append(tier.get_many(asked, LAYOUT)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "a FIFO named like a record blocked the read"
    got = out[0]
    assert [g is not None for g in got] == [True, False, True, False, False, False, True]
    assert tier.stats.checksum_failures == 4 and tier.stats.errors == 0
    assert not tier.path(key(100)).exists() and not tier.path(key(101)).exists()
    assert os.path.exists("/dev/zero")  # a link is removed, never its target


def test_snapshot_restore_skips_non_regular_entries(tmp_path: Path) -> None:
    src = DiskTier(tmp_path, FP)
    src.put_many([(key(i), parts(i)) for i in range(51)])
    _bad_entries(src)
    tier = DiskTier(tmp_path, FP)  # as at start-up: only regular files are indexed
    assert len(tier.keys()) == 52  # the 51 records and the oversized file
    cache = PagedKVCache(64, 4, storage=storage(64))
    out: list = []
    t = threading.Thread(target=lambda: out.append(snap.restore(cache, tier)[1]), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive() and out == [51]
    cache.check_invariants()
    assert tier.stats.checksum_failures == 1 and len(tier.keys()) == 51


# --- Redis: hostile values, keys, namespaces (a real redis-server) ---------------------------


def test_redis_hostile_values_are_dropped_one_by_one(redis_server) -> None:  # noqa: ANN001
    tier = open_tier(redis_server.url, FP)
    tier.put_many([(key(i), parts(i)) for i in range(3)])
    client = redis_server.client()
    client.set(tier.key(key(1)), forged(deep_header(50_000)))
    client.set(tier.key(key(5)), b"x" * (8 * 1024 * 1024))
    got = tier.get_many([key(0), key(1), key(5), key(2)], LAYOUT)
    assert [g is not None for g in got] == [True, False, False, True]
    assert tier.stats.checksum_failures == 2
    assert not client.exists(tier.key(key(1))) and not client.exists(tier.key(key(5)))
    tier.clear()


def test_redis_keyed_namespace_keyless_clear_and_forgery(redis_server) -> None:  # noqa: ANN001
    keyed = open_tier(redis_server.url, FP, key=KEY)
    keyless = open_tier(redis_server.url, FP)
    keyed.put_many([(key(i), parts(i), "a") for i in range(4)])
    keyless.put(key(0), parts(0))
    assert keyless.clear() == 1  # its own entries only
    assert all(g is not None for g in keyed.get_many([key(i) for i in range(4)], LAYOUT, "a"))
    client = redis_server.client()
    value = client.get(keyed.key(key(0)))
    assert parts(0)["kv"].numpy().tobytes()[:64] not in value
    client.set(keyed.key(key(1)), encode(FP, key(1), parts(7)))  # forged without the key
    client.set(keyed.key(key(2)), value)  # a real record moved to another block
    got = keyed.get_many([key(0), key(1), key(2), key(3)], LAYOUT, "a")
    assert [g is not None for g in got] == [True, False, False, True]
    assert keyed.stats.checksum_failures == 2
    keyed.clear()


# --- stateful: a disk tier under hostile writers ---------------------------------------------


class HostileDiskTier(RuleBasedStateMachine):
    """Puts, reads and hostile entries in any order: a read returns exactly what was put or
    None, never raises, and a hostile entry is gone (or a miss) after it was read."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.tier = DiskTier(self.tmp.name, FP, key=KEY, fsync=False)
        self.model: dict[int, int] = {}

    def teardown(self) -> None:
        self.tmp.cleanup()

    @rule(i=st.integers(0, 5), seed=st.integers(0, 3))
    def put(self, i: int, seed: int) -> None:
        p = self.tier.path(key(i))
        if p.is_dir():
            os.rmdir(p)
        self.tier.put(key(i), parts(seed), "t")
        self.model[i] = seed

    @rule(i=st.integers(0, 5), what=st.sampled_from(["fifo", "dir", "garbage", "deep", "plain"]))
    def hostile(self, i: int, what: str) -> None:
        p = self.tier.path(key(i))
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_dir():
            os.rmdir(p)
        else:
            p.unlink(missing_ok=True)
        if what == "fifo":
            os.mkfifo(p)
        elif what == "dir":
            p.mkdir()
        elif what == "garbage":
            p.write_bytes(b"PKVB" + os.urandom(100))
        elif what == "deep":
            p.write_bytes(forged(deep_header(50_000)))
        else:
            p.write_bytes(encode(FP, key(i), parts(0)))
        self.model.pop(i, None)

    @rule(ids=st.lists(st.integers(0, 5), min_size=1, max_size=6), tenant=st.sampled_from(["t", "u"]))
    def get(self, ids: list[int], tenant: str) -> None:
        got = self.tier.get_many([key(i) for i in ids], LAYOUT, tenant)
        for i, g in zip(ids, got, strict=True):
            if tenant == "t" and i in self.model:
                assert g is not None and torch.equal(g["kv"], parts(self.model[i])["kv"])
            else:
                assert g is None
                if tenant == "u":
                    self.model.pop(i, None)  # opened by no one else: dropped as corrupt

    @invariant()
    def no_errors(self) -> None:
        assert self.tier.stats.errors == 0


TestHostileDiskTier = HostileDiskTier.TestCase
TestHostileDiskTier.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
