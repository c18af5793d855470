"""Issue 54: hostile or broken JSON Schemas and grammars (the table in tests/hostile_grammars.py).

Each case, compiled at the engine layer (engine/grammar.py, with the real 0.5B's 151k-token
vocabulary): refused with a ConstraintError whose message has the case's words, or compiled
(matcher and first mask) within COMPILE_S seconds and PEAK_MIB of peak memory. A few go through
the HTTP server (tests/test_server.py, test_hostile_grammars_through_the_server), where a refusal
is a 400 naming its field, while a stream running beside the costliest compiles keeps its pace.
"""

from __future__ import annotations

import re

import pytest

from minfer_jax.engine.constraint import ConstraintError
from minfer_jax.engine.grammar import Grammars, GrammarSpec
from tests.clock import Stopwatch
from tests.hostile_grammars import CASES, Case

COMPILE_S = 20.0  # the slowest, 5000 properties, takes ~3 s alone on the 2-core CPU (~11 s loaded)
PEAK_MIB = 256  # the costliest, a 200k-character const, peaks at ~75 MiB

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def grammars(real_model):
    from minfer_jax.files.tokenizer import Tokenizer

    g = Grammars(Tokenizer.from_model(real_model), real_model.config.vocab_size, capacity=0)
    g.ll_tokenizer()  # built once, outside the timed compiles
    return g


def _spec(case: Case) -> GrammarSpec:
    value = case.build()
    return (
        GrammarSpec.json_schema(value) if case.kind == "json_schema" else GrammarSpec.grammar(value)
    )


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read())[1])


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM starts again from VmRSS
        f.write("5")
    return _peak_kib()


def test_the_table_has_100_cases_of_each_kind():
    names = [c.name for c in CASES]
    assert len(CASES) >= 100 and len(set(names)) == len(names)
    refused = [c for c in CASES if c.says is not None]
    assert len(refused) >= 50 and len(CASES) - len(refused) >= 30
    assert {c.kind for c in CASES} == {"json_schema", "grammar"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_case_is_refused_by_name_or_compiles_bounded(grammars, case):
    base = _reset_peak()
    clock = Stopwatch()  # the CPU time too: a loaded machine stretches the wall clock only
    try:
        mask = grammars.compile(_spec(case))
    except ConstraintError as e:
        assert case.says is not None, f"{case.name} was refused: {e}"
        assert case.says.lower() in str(e).lower(), (case.says, str(e))
    else:
        assert case.says is None, f"{case.name} compiled; expected a refusal ({case.says})"
        assert not mask.matcher.is_error() and mask.ready is not None and mask.ready.any()
    seconds, peak_mib = clock.seconds(), (_peak_kib() - base) / 1024
    assert seconds < COMPILE_S and peak_mib < PEAK_MIB, (case.name, str(clock), peak_mib)
