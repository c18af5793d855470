"""The weights cache: the device layout of a GGUF's weights (int8 matrices and the layers' dense
f32 copies on a CPU, repacked planes on a GPU) kept on disk, so a restart maps them instead of
dequantizing or repacking again.

Measured on the 2-core CPU: dequantizing the built-in 0.5B to 2 GB of f32 takes 5-10 s and
repacking its planes 10-20 s at every start; mapping the cached copy takes ~0.1 s (on a CPU
jax.device_put aliases a read-only mmap, so the weights are the page cache's pages, not a copy).

One entry is one file `<digest>.weights` under MINFER_WEIGHTS_CACHE (default
`<model cache dir>/weights`; `0` turns it off): a header (the params pytree and each leaf's
offset, shape and dtype), then every leaf's bytes, 4 KiB aligned. The digest covers the GGUF
(real path, size, mtime, a hash of its first and last MiB), the LoadOptions, the jax version and
the source of the modules that produce the weights (model/weights.py, quant/, files/gguf.py,
model/from_gguf.py).
Entries are written atomically (tmp + rename) on a background thread that the interpreter waits
for at exit, so a cold start's first token does not wait for the write (2.5 GB: 3-9 s here).
The cache keeps its total under MINFER_WEIGHTS_CACHE_GB (default 16), dropping the least
recently used entries, and never writes an entry that alone exceeds it. Models without a file
(synthetic, in memory) and tensor parallel loads are not cached. An unreadable entry is a miss
(logged, rebuilt, overwritten).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import pickle
import shutil
import struct
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.engine.file_store import FileStore
from minfer_jax.sizes import gib_from_env

_log = logging.getLogger(__name__)

CACHE_ENV = "MINFER_WEIGHTS_CACHE"  # a directory, or "0"/"off" to disable
LIMIT_ENV = "MINFER_WEIGHTS_CACHE_GB"
DEFAULT_LIMIT_GB = 16.0
FORMAT = 1
_MAGIC = b"MINFERW1"
_ALIGN = 4096  # leaf data offsets: page aligned, so every leaf maps without a copy
_PREFIX = len(_MAGIC) + 8  # magic + the header's length
_PROBE = 1 << 20  # bytes of the GGUF's head and tail hashed into the key
_SUFFIX = ".weights"
# The modules whose code decides the bytes of the weights (a change there misses the cache).
_PRODUCERS = (
    "model/weights.py",
    "quant",
    "files/gguf.py",
    "files/gguf_reader.py",
    "model/from_gguf.py",
)


def cache_dir() -> Path | None:
    setting = os.environ.get(CACHE_ENV, "")
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if setting:
        return Path(setting).expanduser()
    from minfer_jax.files.model_source import model_cache_dir

    return model_cache_dir() / "weights"


def limit_bytes() -> int:
    return gib_from_env(LIMIT_ENV, DEFAULT_LIMIT_GB)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@functools.cache
def _producers_hash() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for name in _PRODUCERS:
        p = root / name
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(path: str, opts) -> str | None:
    """The digest of one GGUF file loaded with `opts`; None when there is no file to key on."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
        if not os.path.isfile(real):
            return None
        h = hashlib.sha256()
        with open(real, "rb") as f:
            h.update(f.read(_PROBE))
            f.seek(max(st.st_size - _PROBE, 0))
            h.update(f.read(_PROBE))
    except OSError:
        return None
    parts = [
        f"format={FORMAT}",
        f"file={real}",
        f"size={st.st_size}",
        f"mtime={st.st_mtime_ns}",
        f"probe={h.hexdigest()}",
        f"opts={opts!r}",
        f"jax={jax.__version__}",
        f"source={_producers_hash()}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class WeightsCache(FileStore):
    """Params on disk, one file per cache_key (file_store.py; the layout: the module docstring)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int | None = None):
        limit = limit_bytes() if max_bytes is None else max_bytes
        super().__init__(
            directory,
            limit,
            suffix=_SUFFIX,
            name="weights cache",
            instead="rebuilding the weights",
            log=_log,
        )

    def get(self, digest: str, device):
        """The params of an entry on `device` (mapped, not read, where the backend allows), or
        None."""
        f = self.open(digest)
        if f is None:
            return None
        try:
            with f:
                if f.read(len(_MAGIC)) != _MAGIC:
                    raise ValueError("not a weights cache entry")
                (n,) = struct.unpack("<Q", f.read(8))
                header = pickle.loads(f.read(n))
                if header.get("format") != FORMAT:
                    raise ValueError(f"entry format {header.get('format')!r}, expected {FORMAT}")
                start = _aligned(_PREFIX + n)
                size = os.fstat(f.fileno()).st_size
                if size != start + header["data_bytes"]:
                    raise ValueError(
                        f"{size} bytes, the header says {start + header['data_bytes']} (truncated?)"
                    )
                data = mmap.mmap(
                    f.fileno(), 0, access=mmap.ACCESS_READ
                )  # stays valid after the close
            host = [
                np.frombuffer(data, jnp.dtype(dtype), int(np.prod(shape)), start + offset).reshape(
                    shape
                )
                for offset, shape, dtype in header["leaves"]
            ]
            leaves = jax.device_put(host, device)
            params = jax.tree_util.tree_unflatten(header["treedef"], leaves)
        except Exception as e:  # noqa: BLE001  corrupt or foreign: a miss, rebuilt and overwritten
            self.unusable(digest, e)
            return None
        self.used(digest)
        return params

    def put(self, digest: str, params) -> bool:
        """Write the params' host bytes atomically; False when they do not fit the cache or the
        disk."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        layout, size = [], 0  # offsets relative to the data's start
        for x in leaves:
            size = _aligned(size)
            layout.append((size, tuple(int(s) for s in x.shape), jnp.dtype(x.dtype).name))
            size += int(x.size) * jnp.dtype(x.dtype).itemsize
        try:
            blob = pickle.dumps(
                dict(format=FORMAT, treedef=treedef, leaves=layout, data_bytes=size),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as e:  # noqa: BLE001  a pytree this jax cannot pickle: run without the cache
            _log.info("weights cache: cannot describe the params (%s: %s)", type(e).__name__, e)
            return False
        start = _aligned(_PREFIX + len(blob))
        total = start + size
        if total > self.max_bytes:
            _log.info(
                "weights cache: %.1f GB exceed %s=%g; not cached",
                total / 1e9,
                LIMIT_ENV,
                self.max_bytes / 2**30,
            )
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.prune(keep_free=total)
            free = shutil.disk_usage(self.directory).free
        except OSError as e:
            _log.warning("weights cache: cannot write %s (%s)", self.directory, e)
            return False
        if free < total + (1 << 30):  # leave the disk a GiB
            _log.info("weights cache: not enough free disk for %.1f GB; not cached", total / 1e9)
            return False

        def write(f) -> None:
            f.write(_MAGIC + struct.pack("<Q", len(blob)) + blob)
            for (off, _, _), x in zip(layout, leaves):
                f.seek(start + off)
                f.write(np.ascontiguousarray(np.asarray(x)).data.cast("B"))
            f.truncate(total)

        return self.write(digest, write)


class Entry:
    """One GGUF file + LoadOptions in the cache: get() its params or put() them."""

    def __init__(self, cache: WeightsCache, digest: str):
        self.cache, self.digest = cache, digest

    def get(self, device):
        return self.cache.get(self.digest, device)

    def put(self, params) -> bool:
        return self.cache.put(self.digest, params)

    def put_in_background(self, params) -> threading.Thread:
        """put() on a thread, so the first token does not wait for gigabytes of writes; the thread
        is not a daemon: the interpreter finishes the entry before it exits."""
        t = threading.Thread(target=self.put, args=(params,), name="minfer-weights-cache")
        t.start()
        return t


def entry_for(path: str, opts) -> Entry | None:
    """The cache entry of a GGUF file loaded with `opts` (None: cache off, or no file to key on)."""
    directory = cache_dir()
    if directory is None:
        return None
    digest = cache_key(path, opts)
    return None if digest is None else Entry(WeightsCache(directory), digest)
