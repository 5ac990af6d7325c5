"""`disk:DIR`: one file per block under DIR/<namespace>/<hh>/<hash>.kvb.

Writes are atomic: the record goes to a temporary file in the same directory, is fsync'ed, then
renamed over the final name (and the directory fsync'ed), so a reader (or a process restarted
after `kill -9`) sees a whole record or none; leftover temporary files are ignored and removed
at open. A size cap evicts the least recently used files (use = read or written by this
process; files found at open are ordered by modification time). Several processes may share a
directory: a file another process removed is just a miss. Only regular files are read or
indexed, each opened without following links and without blocking (a FIFO, a device, a link or a
directory named like a record is a corrupt entry, never a hang), and each key's I/O error stays
that key's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

from pagedkv.cache.tiers.base import BlockTier
from pagedkv.errors import CorruptEntryError, TierUnavailableError

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"


class DiskTier(BlockTier):
    scheme = "disk"

    def __init__(self, root: str | os.PathLike, fingerprint: bytes, *,
                 max_bytes: int | None = None, fsync: bool = True, **kw: object) -> None:
        super().__init__(fingerprint, **kw)
        self.root = Path(root)
        self.dir = self.root / self.namespace
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._size = 0
        self._ilock = threading.Lock()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._probe()
        except OSError as exc:
            raise TierUnavailableError(f"KV tier directory {self.dir} is not usable: {exc}") from exc
        self._scan()

    def describe(self) -> str:
        return f"disk:{self.root}"

    # --- layout -------------------------------------------------------------------------------

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    def keys(self) -> list[bytes]:
        """Stored keys, most recently used last."""
        with self._ilock:
            return list(self._index)

    @property
    def size_bytes(self) -> int:
        return self._size

    def _probe(self) -> None:
        """Write and remove a small file: fails early on a read-only or full directory."""
        p = self.dir / f"{TMP_PREFIX}probe-{uuid.uuid4().hex}"
        with open(p, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        p.unlink()

    def _scan(self) -> None:
        found = []
        now = time.time()
        for p in self._walk():
            try:
                st = p.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if p.name.startswith(TMP_PREFIX):
                if now - st.st_mtime > 60:  # a writer that died mid-write (kill -9)
                    p.unlink(missing_ok=True)
                continue
            try:
                found.append((st.st_mtime, bytes.fromhex(p.name.removesuffix(SUFFIX)), st.st_size))
            except ValueError:
                continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self._size += size

    def _walk(self) -> Iterator[Path]:
        """Entries of the namespace directory and of its real (not linked) subdirectories."""
        for sub in _entries(self.dir):
            if sub.is_dir(follow_symlinks=False):
                yield from (Path(e.path) for e in _entries(Path(sub.path)))
            elif sub.name.startswith(TMP_PREFIX):
                yield Path(sub.path)

    # --- raw operations -----------------------------------------------------------------------

    def _contains_raw(self, key: bytes) -> bool:
        return self.path(key).is_file()

    def _get_raw(self, keys: Sequence[bytes],
                 max_bytes: int) -> list[bytearray | CorruptEntryError | None]:
        return [self._read(key, max_bytes) for key in keys]

    def _read(self, key: bytes, max_bytes: int) -> bytearray | CorruptEntryError | None:
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link named like a record
                return CorruptEntryError("a link where a record file should be")
            self._error("get", exc)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return CorruptEntryError("not a regular file")
            if st.st_size > max_bytes:
                os.close(fd)
                return CorruptEntryError(f"{st.st_size} bytes, larger than any record")
            with open(fd, "rb", buffering=0) as f:  # closes fd
                data = bytearray(st.st_size)
                n = f.readinto(data)
                del data[n:]
        except OSError as exc:
            self._error("get", exc)
            return None
        self._touch(key, len(data))
        return data

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        dirs = set()
        for key, blob in items:
            final = self.path(key)
            final.parent.mkdir(exist_ok=True)
            tmp = final.parent / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(blob)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            dirs.add(final.parent)
            self._touch(key, len(blob))
        if self.fsync:
            for d in dirs:
                _fsync_dir(d)

    def _after_put(self) -> None:
        self._enforce_cap()

    def _discard(self, key: bytes) -> None:
        self._forget(key)
        p = self.path(key)
        try:
            p.unlink(missing_ok=True)
        except IsADirectoryError:
            with contextlib.suppress(OSError):
                p.rmdir()  # only when empty: nothing but records is ever deleted

    def _clear_raw(self) -> int:
        n = 0
        for key in self.keys():
            self._discard(key)
            n += 1
        return n

    # --- LRU index ----------------------------------------------------------------------------

    def _touch(self, key: bytes, size: int) -> None:
        with self._ilock:
            old = self._index.pop(key, None)
            self._size += size - (old or 0)
            self._index[key] = size

    def _forget(self, key: bytes) -> None:
        with self._ilock:
            old = self._index.pop(key, None)
            self._size -= old or 0

    def _enforce_cap(self) -> None:
        if self.max_bytes is None:
            return
        while True:
            with self._ilock:
                if self._size <= self.max_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._size -= size
            self.path(key).unlink(missing_ok=True)
            self._record_removed([key])


def _entries(d: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            return list(it)
    except OSError:
        return []


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
