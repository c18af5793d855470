"""The README and docs name only files that exist: every path-looking token in README.md,
docs/*.md and tools/README.md is a file or folder of the repository (globs and {a,b} braces
expanded; a path may be relative to the package, minfer_jax/; a bare file name may sit anywhere
in the tree, a raw benchmark output in docs/bench/),
or is qualified by the commit that holds it (`977b296:tools/kernel_probe.py`)."""

import functools
import glob
import itertools
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "README.md",
    "tools/README.md",
    *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
]
EXTENSIONS = "py|md|txt|json|jsonl|csv|toml|sh|yaml|yml|cfg"
# a path: folders/name.ext, or folders/ (a folder); REV: in front names a file of that commit
PATH = re.compile(
    rf"(?<![\w/.:~-])(?:(?P<rev>[0-9a-f]{{7,40}}):)?"
    rf"(?P<path>(?:[\w.*{{}},+-]+/)*[\w.*{{}},+-]+\.(?:{EXTENSIONS})(?:\.\w+)?"
    rf"|(?:[\w.-]+/)+)(?![\w/])"
)
TOP = ("minfer_jax/", "tests/", "tools/", "docs/", "scripts/", ".ci/")


def _braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(
        itertools.chain.from_iterable(
            _braces(path[: m.start()] + alt + path[m.end() :]) for alt in m.group(1).split(",")
        )
    )


@functools.cache
def _basenames() -> frozenset[str]:
    names = set()
    for _, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") or d == ".ci"]
        names.update(files)
    return frozenset(names)


def _exists(path: str, doc: str) -> bool:
    for p in _braces(path):
        here = os.path.dirname(os.path.join(ROOT, doc))
        bases = (ROOT, here, os.path.join(ROOT, "minfer_jax"), os.path.join(ROOT, "docs", "bench"))
        candidates = [os.path.join(base, p) for base in bases]
        if any(glob.glob(c) for c in candidates):
            continue
        if "/" not in p.rstrip("/") and not any(ch in p for ch in "*?") and p in _basenames():
            continue
        return False
    return True


def _in_commit(rev: str, path: str) -> bool:
    """Whether commit rev holds path (also true where the commit is not here: a tarball, a
    shallow clone)."""

    def git(obj: str) -> bool:
        cmd = ["git", "-C", ROOT, "cat-file", "-e", obj]
        return subprocess.run(cmd, capture_output=True).returncode == 0

    return git(f"{rev}:{path}") or not git(f"{rev}^{{commit}}")


def _tokens(text: str):
    for m in PATH.finditer(text):
        path = m.group("path")
        is_file = re.search(rf"\.(?:{EXTENSIONS})$", path)
        if "/" in path and not path.startswith(TOP) and not is_file:
            continue  # a folder-looking word that is not one of ours (e.g. "prefill/decode")
        if path.startswith(("http", "www.")) or path.endswith(".gguf"):
            continue
        yield m.group("rev"), path


def missing_paths(text: str, doc: str) -> list[str]:
    """The paths `text` (the contents of `doc`) names that are not in the repository."""
    missing = []
    for rev, path in _tokens(text):
        if rev is not None:
            if _in_commit(rev, path):
                continue
        elif _exists(path, doc):
            continue
        missing.append(f"{rev + ':' if rev else ''}{path}")
    return sorted(set(missing))


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_only_files_that_exist(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    missing = missing_paths(text, doc)
    assert not missing, f"{doc} names files that are not in the repository: {missing}"


def test_the_check_finds_missing_paths():
    """The check can fail: removed files, a missing folder, a file its commit does not hold."""
    text = (
        "See tools/kernel_probe.py, `minfer_jax/engine/nope.py`, docs/bench/nothing_here.md and "
        "tests/missing_dir/; 977b296:tools/kernel_probe.py is fine, 977b296:tools/never.py is not. "
        "Present: minfer_jax/engine/plan.py, docs/BENCHMARKS.md, tools/README.md, "
        "docs/bench/{cpu_real_0.5b,formats_dequant}.md, engine/plan.py, README.md."
    )
    assert missing_paths(text, "README.md") == [
        "977b296:tools/never.py",
        "docs/bench/nothing_here.md",
        "minfer_jax/engine/nope.py",
        "tests/missing_dir/",
        "tools/kernel_probe.py",
    ]
