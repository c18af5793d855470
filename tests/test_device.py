"""Device-keyed tuning (pallas/device.py): the H200 and the H100 get the measured numbers, another
GPU safe defaults (program targets scaled to its SMs, at most two pipeline stages, the GEMV rows'
toggles off), and those defaults compute the same sums."""

import jax
import pytest

from kernel_mode import INTERPRET
from minfer_jax.pallas import decode_attention, device, gemm, gemv, gemv_tuning
from minfer_jax.quant.planes import QType
from test_kernels import check, planes_for

A10 = device.Gpu(kind="NVIDIA A10", sms=72)


@pytest.fixture
def other_gpu(monkeypatch):
    """An untuned GPU; jit caches cleared on both sides (kernels read the device while tracing)."""
    jax.clear_caches()
    monkeypatch.setattr(device, "current", lambda: A10)
    yield
    jax.clear_caches()


def test_the_tuned_gpu_keeps_its_numbers():
    h200 = device.Gpu(kind="NVIDIA H200", sms=132)
    h100 = device.Gpu(kind="NVIDIA H100 80GB HBM3", sms=132)  # the same Hopper SM: tables apply
    assert h200.tuned and h100.tuned and device.TUNED.tuned and not A10.tuned
    if jax.default_backend() != "gpu":  # interpret mode traces what the H200 runs
        assert device.current() == device.TUNED
    if device.current().tuned and device.current().sms == device.TUNED_SMS:
        assert device.programs(gemm.FEW_TOKEN_PROGRAMS) == 528 and device.stages(4) == 4
        assert gemv_tuning.row(QType.Q4_K) is gemv_tuning.TUNING[QType.Q4_K]


def test_another_gpu_gets_safe_defaults(other_gpu):
    assert device.programs(gemm.FEW_TOKEN_PROGRAMS) == 4 * 72
    assert device.programs(gemv_tuning.TARGET_PROGRAMS) == 1024 * 72 // 132
    many, one = decode_attention.decode_config(2, 5), decode_attention.decode_config(1, 5)
    assert many.k_splits == 16  # 139 programs over 10 rows (H200: 256 -> 32)
    assert one.k_splits == 16  # one sequence's own target: 69 programs over 5 rows (H200: 32)
    assert many.num_stages == one.num_stages == device.GENERIC_MAX_STAGES
    for qtype in (QType.Q4_0, QType.Q4_K, QType.F16):
        for m in (16, 512):
            assert gemm.choose_config(qtype, m, 4096, 4096).num_stages <= device.GENERIC_MAX_STAGES
    for qtype, r in gemv_tuning.TUNING.items():
        g = gemv_tuning.row(qtype)
        if isinstance(r, gemv_tuning.Int8Row):  # numerics as measured, speed toggles off
            assert (g.exact_round, g.rows_one_token) == (r.exact_round, r.rows_one_token)
            assert (
                not g.prequant_3d and g.x_first_from == g.prequant_x_first_from == gemv_tuning.OFF
            )
        else:
            assert g == r


@pytest.mark.parametrize("nt", [1, 3, 8])
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_K], ids=lambda q: q.name)
def test_generic_gemv_rows_match_the_reference(other_gpu, qtype, nt):
    """Q4_0 and Q4_K are the rows whose measured toggles differ most from the generic ones."""
    n, k = (200, 896) if qtype == QType.Q4_0 else (200, 512)
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(nt), (nt, k))
    got = gemv.gemv_int8(x, w, qtype=qtype, n_out=n, interpret=INTERPRET)
    check(got, gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n), qtype)
