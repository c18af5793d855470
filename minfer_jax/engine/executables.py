"""The executable store: compiled executables serialized on disk, so a restart loads instead of
tracing, lowering and compiling.

JAX's persistent compilation cache is keyed by the lowered program, so a warm start still traces
and lowers every executable (~7.5 s each for the 7B on the H200). This store is keyed by what
*produces* the program instead (`fingerprint`): the plan key, Config, Impl, cache dtype, tensor
parallel split, the params pytree (structure, leaf shapes and dtypes), jax/jaxlib versions, the
backend and device kind, XLA_FLAGS and a hash of this package's source files, so a code change
never loads a stale executable. An entry is one pickle (`jax.experimental.serialize_executable`'s
payload and pytrees); it lives under `<compilation cache dir>/minfer-executables/` (the same
directory as JAX's cache, `MINFER_COMPILATION_CACHE`) and the store keeps its total size under
`MINFER_EXECUTABLE_STORE_GB` (default 4) by dropping the least recently used entries.

Failure is never the user's problem: an unreadable entry is a miss (logged, then overwritten), and
a backend that cannot serialize or deserialize simply compiles every time.

An executable that JAX's persistent cache handed back is never stored: on the CPU (jax 0.10.2)
re-serializing it drops its code ("Function ... not found" when the loaded copy runs;
tests/test_startup.py checks that this path stays safe). So on a CPU the store replaces JAX's cache
(`jax_cache_useful`); on a GPU both stay on and only fresh compiles enter the store.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import jax

from minfer_jax.engine.file_store import FileStore
from minfer_jax.sizes import gib_from_env

_log = logging.getLogger(__name__)

STORE_SUBDIR = "minfer-executables"
STORE_LIMIT_ENV = "MINFER_EXECUTABLE_STORE_GB"
DEFAULT_LIMIT_GB = 4.0
FORMAT = 1  # bump when the entry layout changes
_SUFFIX = ".exe"


@dataclasses.dataclass(frozen=True)
class ExecutableRecord:
    """Where one executable came from and what it cost (seconds)."""

    label: str
    # "store" (deserialized) | "compiled" (traced, lowered, compiled) | "jax-cache" (traced,
    # lowered, then loaded from JAX's persistent cache: not stored, see the module docstring)
    source: str
    lower_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0  # reading + deserializing a store entry (also spent on a failed read)
    save_s: float = 0.0  # serializing + writing the entry after a compile

    @property
    def total_s(self) -> float:
        return self.lower_s + self.compile_s + self.load_s + self.save_s


@functools.cache
def source_hash() -> str:
    """sha256 over this package's .py files (paths and bytes): a code change misses the store."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def jax_cache_useful(platform: str) -> bool:
    """Whether JAX's persistent cache should run beside the store: not on a CPU, where only the
    engine's executables compile long enough to be cached and a cache hit cannot enter the store."""
    return platform != "cpu"


# jax settings that change what a traced program computes (read defensively: names move between
# versions)
_PROGRAM_FLAGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_threefry_partitionable",
)
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()  # JAX records the event in the compiling thread: count per thread


def _count_hit(event: str, **kwargs) -> None:
    if event == JAX_CACHE_HIT_EVENT:
        _hits.n = getattr(_hits, "n", 0) + 1


@functools.cache
def _watch_jax_cache_hits() -> None:
    jax.monitoring.register_event_listener(_count_hit)


def execution_devices(model) -> list:
    """The devices the model's executables run on, in mesh order."""
    if model.tp is not None:
        return list(model.tp.mesh.devices.flat)
    leaf = jax.tree_util.tree_leaves(model.params)[0]
    return sorted(leaf.devices(), key=lambda d: d.id)


def fingerprint(model, key) -> str:
    """The store key of one executable: everything that changes the program it compiles to."""
    devices = execution_devices(model)
    leaves, treedef = jax.tree_util.tree_flatten(model.params)
    tp = model.tp
    parts = [
        f"format={FORMAT}",
        f"key={key!r}",
        f"config={model.config!r}",
        f"impl={model.impl!r}",
        f"cache_dtype={model.cache_dtype} kv_types={model.kv_types} rot={model.kv_rotation}",
        "tp=none"
        if tp is None
        else f"tp={tp.split!r} local={tp.local!r} mesh={dict(tp.mesh.shape)}",
        f"params={treedef}",
        *(f"{tuple(x.shape)}:{x.dtype}:{x.sharding if tp is not None else ''}" for x in leaves),
        f"jax={jax.__version__} jaxlib={_jaxlib_version()}",
        f"devices={[(d.platform, d.device_kind, d.id) for d in devices]}",
        f"platform_version={devices[0].client.platform_version}",
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}",
        *(f"{flag}={getattr(jax.config, flag, None)}" for flag in _PROGRAM_FLAGS),
        f"source={source_hash()}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _jaxlib_version() -> str:
    import jaxlib

    return getattr(jaxlib, "__version__", "?")


def limit_bytes() -> int:
    """The store's size bound (MINFER_EXECUTABLE_STORE_GB, default 4); 0 keeps nothing."""
    return gib_from_env(STORE_LIMIT_ENV, DEFAULT_LIMIT_GB)


class ExecutableStore(FileStore):
    """Serialized executables in one directory, one file per fingerprint (file_store.py)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int | None = None):
        limit = limit_bytes() if max_bytes is None else max_bytes
        super().__init__(
            directory, limit, suffix=_SUFFIX, name="executable store", instead="compiling", log=_log
        )

    @classmethod
    def in_cache_dir(cls, cache_dir: str | os.PathLike | None) -> ExecutableStore | None:
        """The store beside JAX's persistent cache (None when the cache is off)."""
        return None if cache_dir is None else cls(Path(cache_dir) / STORE_SUBDIR)

    def holds(self, model, key) -> bool:
        try:
            return self.path(fingerprint(model, key)).is_file()
        except Exception:  # noqa: BLE001  no fingerprint: it would compile
            return False

    def get(self, digest: str, devices):
        """The deserialized executable, or None (absent, unreadable or not loadable here)."""
        f = self.open(digest)
        if f is None:
            return None
        try:
            with f:
                entry = pickle.loads(f.read())
            if entry.get("format") != FORMAT:
                raise ValueError(f"entry format {entry.get('format')!r}, expected {FORMAT}")
            from jax.experimental import serialize_executable

            exe = serialize_executable.deserialize_and_load(
                entry["payload"],
                entry["in_tree"],
                entry["out_tree"],
                backend=devices[0].client,
                execution_devices=devices,
            )
        except Exception as e:  # noqa: BLE001  corrupt, truncated, or a backend that cannot load: a miss
            self.unusable(digest, e)
            return None
        self.used(digest)
        return exe

    def put(self, digest: str, compiled, label: str) -> bool:
        """Serialize and write atomically; False when this backend cannot serialize, or the
        entry does not fit."""
        if self.max_bytes <= 0:
            return False
        try:
            from jax.experimental import serialize_executable

            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = pickle.dumps(
                dict(
                    format=FORMAT, label=label, payload=payload, in_tree=in_tree, out_tree=out_tree
                ),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as e:  # noqa: BLE001  e.g. a backend without serialization: compile every time
            _log.info(
                "executable store: %s cannot be serialized here (%s: %s)",
                label,
                type(e).__name__,
                e,
            )
            return False
        if len(blob) > self.max_bytes or not self.write(digest, lambda f: f.write(blob)):
            return False
        self.prune()
        return True


@dataclasses.dataclass
class Lowered:
    """A key traced and lowered (Python: holds the GIL), not yet compiled; `compile()` (XLA:
    releases the GIL) may run on another thread, e.g. a niced one (engine/warmup.py)."""

    label: str
    lowered: Any
    store: ExecutableStore | None
    digest: str | None
    load_s: float
    lower_s: float

    def compile(self):
        """XLA's compile (then the store's save): (exe, ExecutableRecord)."""
        hits = getattr(_hits, "n", 0)
        t1 = time.perf_counter()
        exe = self.lowered.compile()
        t2 = time.perf_counter()
        source = "jax-cache" if getattr(_hits, "n", 0) > hits else "compiled"
        if self.store is not None and self.digest is not None and source == "compiled":
            self.store.put(self.digest, exe, self.label)
        t3 = time.perf_counter()
        return exe, ExecutableRecord(
            self.label, source, lower_s=self.lower_s, compile_s=t2 - t1, load_s=self.load_s,
            save_s=t3 - t2,
        )  # fmt: skip


def prepare(model, key, store: ExecutableStore | None):
    """A plan key's executable from the store as (exe, ExecutableRecord), else the key lowered
    (`Lowered`, compiled by its caller)."""
    label = getattr(key, "label", repr(key))
    digest = load_s = None
    if store is not None:
        t0 = time.perf_counter()
        try:
            digest = fingerprint(model, key)
            exe = store.get(digest, execution_devices(model))
        except Exception as e:  # noqa: BLE001  a fingerprint that cannot be computed: compile, never fail
            _log.warning("executable store: no key for %s (%s: %s)", label, type(e).__name__, e)
            digest, exe = None, None
        load_s = time.perf_counter() - t0
        if exe is not None:
            return exe, ExecutableRecord(label, "store", load_s=load_s)
    _watch_jax_cache_hits()
    t0 = time.perf_counter()
    lowered = key.lower(model)
    return Lowered(label, lowered, store, digest, load_s or 0.0, time.perf_counter() - t0)


def obtain(model, key, store: ExecutableStore | None):
    """The executable for a plan key: from the store, else lowered + compiled (and saved).
    Returns (exe, ExecutableRecord)."""
    got = prepare(model, key, store)
    return got.compile() if isinstance(got, Lowered) else got
