"""A directory of cache entries, one file `<digest><suffix>` each: what the executable store
(executables.py) and the weights cache (weights_cache.py) share. An entry is written atomically
(a temporary file, then a rename) and readable by the other users of a shared cache, touched when
used, and the least recently used are dropped once the entries exceed max_bytes. A failure to
read or write is a miss, logged, never the caller's error."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_STALE_TMP_S = 3600.0  # a temporary entry this old belongs to a writer that died


class FileStore:
    """Entries under directory, at most max_bytes in all; name and instead are what the log says:
    whose entry it is and what a miss does instead ("compiling", "rebuilding the weights")."""

    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int,
        *,
        suffix: str,
        name: str,
        instead: str,
        log: logging.Logger,
    ):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.suffix, self.name, self.instead, self._log = suffix, name, instead, log

    def path(self, digest: str) -> Path:
        return self.directory / f"{digest}{self.suffix}"

    def open(self, digest: str) -> BinaryIO | None:
        """The entry's file to read, or None (absent; unreadable, logged)."""
        path = self.path(digest)
        try:
            return open(path, "rb")
        except FileNotFoundError:
            return None
        except OSError as e:
            self._log.warning("%s: cannot read %s (%s); %s", self.name, path, e, self.instead)
            return None

    def unusable(self, digest: str, error: Exception) -> None:
        """The entry could not be used (corrupt, truncated, foreign): a miss, overwritten next."""
        self._log.warning(
            "%s: %s is unusable (%s: %s); %s and overwriting it",
            self.name,
            self.path(digest).name,
            type(error).__name__,
            error,
            self.instead,
        )

    def used(self, digest: str) -> None:
        """The entry was read: the most recently used now (pruning drops the least)."""
        with contextlib.suppress(OSError):
            os.utime(self.path(digest))

    def write(self, digest: str, write: Callable[[BinaryIO], object]) -> bool:
        """The entry written by write(file) to a temporary file, then renamed into place; False
        (logged) where the disk refuses it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=self.suffix)
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide it from a shared cache
                    write(f)
                os.replace(tmp, self.path(digest))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:  # a full or read-only disk: run without the entry
            self._log.warning("%s: cannot write %s (%s)", self.name, self.directory, e)
            return False
        return True

    def entries(self) -> list[Path]:
        try:
            return [
                p
                for p in self.directory.iterdir()
                if p.suffix == self.suffix and not p.name.startswith(".")
            ]
        except OSError:
            return []

    def prune(self, keep_free: int = 0) -> None:
        """Drop least recently used entries until the others plus keep_free bytes fit in
        max_bytes (and temporary files of writers that died)."""
        with contextlib.suppress(OSError):
            for p in self.directory.glob(f".tmp-*{self.suffix}"):
                with contextlib.suppress(OSError):
                    if time.time() - p.stat().st_mtime > _STALE_TMP_S:
                        p.unlink()
        stats = []
        for p in self.entries():
            with contextlib.suppress(OSError):
                st = p.stat()
                stats.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in stats) + keep_free
        for _, size, p in sorted(stats, key=lambda s: s[0]):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                p.unlink()  # a process that mapped it keeps its pages
            total -= size
