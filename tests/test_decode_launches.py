"""Each family's decode step launches the Pallas kernels it launched when the table was recorded
(tests/data/decode_launches.json, `PYTHONPATH=. python -m minfer_bench.launches --json`): the
fused-decode choices (minfer_jax/residual.py, model/attention.py) may move, the launches on the
GPU may not. The step is traced with kernels="pallas" (jax.make_jaxpr: nothing is lowered or run).
Recorded on main a752f56; changed since: gemma4 / gemma4moe's dense GeGLU takes glu_partials (one
launch more per layer, 2026-12-07)."""

import json
from pathlib import Path

import pytest

from minfer_bench.launches import FAMILY_SPECS, decode_launches, family_model

TABLE = json.loads((Path(__file__).parent / "data" / "decode_launches.json").read_text())


@pytest.mark.parametrize("name", list(FAMILY_SPECS))
def test_a_decode_step_launches_the_recorded_kernels(name):
    gm = family_model(FAMILY_SPECS[name])
    assert decode_launches(gm, fused=True) == TABLE[name]
    assert decode_launches(gm, fused=False) == TABLE[f"{name} unfused"]
