"""The CUDA backend's kernels executed on the CPU by the emulated device (GGML_LITE_CUDA_EMU=1):
every harness case the backend claims, computed by the real .cu kernels under two schedules of a
block's threads, against the numpy references; the kernels the harness does not reach, directly;
the scheduler over CUDA (emulated) + CPU; and the emulator's own promises (races and deadlocks
caught, launches checked as the PTX declares them). Needs a C++ compiler (g++), no GPU."""
import os
import re
import sys

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite import GGMLError, Type
from ggml_lite.backends.cuda import backend as cb
from ggml_lite.backends.cuda import emu
from ggml_lite.backends.cuda import kernels as ck

pytestmark = pytest.mark.skipif(emu.emu_compiler() is None, reason="no C++ compiler (g++ or $CXX) for the emulated device")
B = pytest.importorskip("backend_ops_cases", reason="the harness of the cpu chapters is not here")

SCHEDULES = ("forward", "warps")             # each catches races the other misses (see chapter 11)
HARNESS_CASES = B.make_test_cases()


def _claimed(case):
    """supports_op is pure Python: the claim is known without any device."""
    built = B.build_case(case, no_alloc=True, sentinels=False)
    try:
        return all(cb.cuda_supports_op(t, 0) for t in built.ctx)
    finally:
        B.free_built(built)


CLAIMED = [c for c in HARNESS_CASES if _claimed(c)]
LAUNCHED = set()                             # kernel names launched by the tests of this module


@pytest.fixture(scope="module")
def cuda():
    old = os.environ.get(emu.EMU_ENV)
    os.environ[emu.EMU_ENV] = "1"
    real_call = emu.EmuFunction.__call__

    def recording_call(self, *args, **kwargs):
        LAUNCHED.add(self.name)
        return real_call(self, *args, **kwargs)

    emu.EmuFunction.__call__ = recording_call
    try:
        backend = ggml.backend_cuda_init(0)
        assert ggml.backend_cuda_get_device_description(0) == emu.EMU_DESCRIPTION
        yield backend
    finally:
        emu.EmuFunction.__call__ = real_call
        if old is None:
            os.environ.pop(emu.EMU_ENV, None)
        else:
            os.environ[emu.EMU_ENV] = old


def _through(backend):
    return dict(compute=lambda gf, ctx: ggml.backend_graph_compute(backend, gf), no_alloc=True,
                alloc=lambda ctx: ggml.backend_alloc_ctx_tensors(ctx, backend))


def test_the_backend_claims_the_harness_cases_it_did():
    ops = {c.op for c in CLAIMED}
    assert len(CLAIMED) >= 900 and {"MUL_MAT", "SOFT_MAX", "ROPE", "CPY", "GET_ROWS", "RMS_NORM"} <= ops


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CLAIMED, ids=[c.name() for c in CLAIMED])
def test_harness_case_on_the_emulated_device(cuda, case, schedule):
    with emu.emu_schedule(schedule):
        verdict = B.eval_case(case, **_through(cuda))
    assert verdict.ok, f"{case.name()} on CUDA0 (emulated, {schedule} schedule): {verdict}"


# ---------------------------------------------------------------------------------------------
# What the harness does not reach: the F32 dequantizers (mul_mat at F32 precision) and cpy_i32_i32
# ---------------------------------------------------------------------------------------------

def _compute(backend, build, inputs):
    c = ggml.init(mem_size=16 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    try:
        out, srcs = build(c)
        gf = ggml.new_graph(c)
        ggml.build_forward_expand(gf, out)
        assert all(cb.cuda_supports_op(n, 0) for n in gf.nodes)
        buf = ggml.backend_alloc_ctx_tensors(c, backend)
        for t, v in zip(srcs, inputs):
            ggml.backend_tensor_set(t, v)
        assert ggml.backend_graph_compute(backend, gf) == ggml.Status.SUCCESS
        got = ggml.backend_tensor_get(out)
        ggml.backend_buffer_free(buf)
        return got
    finally:
        ggml.free(c)


# the types ggml_lite.types quantizes (the others' F32 dequantizers are tested below with gguf's)
_CONVERTED = [t for t in ck.DEQUANTIZE_TYPES if ggml.get_type_traits(t).from_float is not None]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("type_", _CONVERTED)
def test_f32_dequantizers_through_mul_mat_at_f32_precision(cuda, type_, schedule):
    rng = np.random.default_rng(int(type_))
    w = rng.standard_normal((40, 512)).astype(np.float32)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    rows = ggml.quantize_chunk(type_, w)

    def build(c):
        a, b = ggml.new_tensor_2d(c, type_, 512, 40), ggml.new_tensor_2d(c, Type.F32, 512, 16)
        out = ggml.mul_mat(c, a, b)                       # 16 columns: not the mat-vec, the cuBLAS path
        ggml.mul_mat_set_prec(out, ggml.Prec.F32)         # weights dequantized to F32
        return out, (a, b)

    with emu.emu_schedule(schedule):
        got = _compute(cuda, build, (rows, x)).reshape(16, 40)
    want = x @ ggml.types.dequantize_rows(type_, rows, 512).T
    assert np.sum((got - want) ** 2) / np.sum(want ** 2) < 1e-10      # F32 all the way: no F16 rounding
    assert f"dequantize_{ck.DEQUANTIZE_TYPES[type_]}_f32" in LAUNCHED


def test_cpy_i32_i32_transposes_exactly(cuda):
    v = np.arange(-40, 35, dtype=np.int32).reshape(5, 15)

    def build(c):
        a = ggml.new_tensor_2d(c, Type.I32, 15, 5)
        return ggml.cont(c, ggml.transpose(c, a)), (a,)

    assert np.array_equal(_compute(cuda, build, (v,)).reshape(15, 5), v.T)
    assert "cpy_i32_i32" in LAUNCHED


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("idx_type", [Type.I64, Type.I32])
@pytest.mark.parametrize("dst_type", [Type.F32, Type.F16, Type.BF16])
def test_set_rows_equals_the_cpu(cuda, dst_type, idx_type, schedule):
    """set_rows (the KV cache's writes) on the emulated device: the CPU's bits, rows not named untouched."""
    rng = np.random.default_rng(int(dst_type) * 100 + int(idx_type))
    old = rng.standard_normal((10, 64)).astype(np.float32)
    rows = rng.standard_normal((4, 64)).astype(np.float32)
    idx = np.array([7, 0, 9, 3], np.int64 if idx_type == Type.I64 else np.int32)

    def build(c):
        dst = ggml.new_tensor_2d(c, dst_type, 64, 10)
        src = ggml.new_tensor_2d(c, Type.F32, 64, 4)
        ids = ggml.new_tensor_1d(c, idx_type, 4)
        return ggml.set_rows(c, dst, src, ids), (dst, src, ids)

    start = {Type.F32: old, Type.F16: old.astype(np.float16),                  # dst's bytes before
             Type.BF16: (old.view(np.uint32) >> 16).astype(np.uint16)}[dst_type]
    want = _compute(ggml.backend_cpu_init(), build, (start, rows, idx))
    with emu.emu_schedule(schedule):
        got = _compute(cuda, build, (start, rows, idx))
    assert got.tobytes() == want.tobytes()
    untouched = [i for i in range(10) if i not in idx]
    assert got.reshape(10, -1)[untouched].tobytes() == start.reshape(10, -1)[untouched].tobytes()
    assert f"set_rows_{ggml.type_name(dst_type)}_{ggml.type_name(idx_type)}" in LAUNCHED


# ---------------------------------------------------------------------------------------------
# Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, which the harness does not make: the mat-vec for 1..8 columns, the
# batched product (weights dequantized to F16, and to F32), GET_ROWS of Q5_0/Q5_1. The oracle is
# numpy on gguf's dequantized values (gguf.quants.dequantize).
# ---------------------------------------------------------------------------------------------

NEW_TYPES = (Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q2_K, Type.Q3_K, Type.Q5_K)
_HALF_SCALES = {Type.Q2_K: (80, 82), Type.Q3_K: (108,), Type.Q5_K: (0, 2)}   # byte offsets of d (and dmin)


def _gguf_type(type_):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType(int(type_))               # ggml's ids in both


def _new_type_weights(type_, shape, rng):
    """(blocks as uint8 rows, their values in float64) for weights of `shape` (..., k). Q4_1, Q5_0
    and Q5_1 by gguf's quantizers from uniform [-1, 1], as test-backend-ops makes weights; the K-quants,
    which gguf only dequantizes, from random bytes (every byte pattern is a block) with F16 scales
    d and dmin in [0.002, 0.02]."""
    from gguf import quants
    *outer, k = shape
    if type_ in (Type.Q4_1, Type.Q5_0, Type.Q5_1):
        blocks = quants.quantize(rng.uniform(-1, 1, (int(np.prod(outer)), k)).astype(np.float32),
                                 _gguf_type(type_))
    else:
        b = rng.integers(0, 256, (int(np.prod(outer)), k // 256, ggml.type_size(type_)), dtype=np.uint8)
        for off in _HALF_SCALES[type_]:
            b[..., off:off + 2] = rng.uniform(0.002, 0.02, b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        blocks = b.reshape(b.shape[0], -1)
    values = quants.dequantize(blocks, _gguf_type(type_)).astype(np.float64)
    return blocks, values.reshape(*outer, k)


def _exact_q8_1(rng, shape):
    """Activations Q8_1 holds exactly: multiples of 1/128, each block of 32 with max |x| = 127/128
    (so d = 1/128) and a sum exact in F16. The mat-vec's result is then the dot product of the
    dequantized weights with them, up to F32 rounding: any misplaced word or scale shows."""
    v = rng.integers(-50, 51, (*shape[:-1], shape[-1] // 32, 32))
    v[..., rng.integers(0, 32)] = 127
    return (v.reshape(shape) / 128).astype(np.float32)


def _nmse(got, want):
    return float(np.sum((got - want) ** 2) / np.sum(want ** 2))


def _mul_mat(backend, type_, blocks, x, w_shape, prec=None):
    """mul_mat(w, x) with w (k, rows, channels) of type_, x (k, cols, channels * ratio) F32."""
    k, rows, channels = w_shape
    ch_x, cols = x.shape[0], x.shape[1]

    def build(c):
        a = ggml.new_tensor_3d(c, type_, k, rows, channels)
        b = ggml.new_tensor_3d(c, Type.F32, k, cols, ch_x)
        out = ggml.mul_mat(c, a, b)
        if prec is not None:
            ggml.mul_mat_set_prec(out, prec)
        return out, (a, b)

    return _compute(backend, build, (blocks, x)).reshape(ch_x, cols, rows)


def _oracle(values, x):
    """values (channels, rows, k) broadcast over x's channels (ch_x, cols, k): (ch_x, cols, rows)."""
    ratio = x.shape[0] // values.shape[0]
    return np.einsum("crk,cjk->cjr", values[np.arange(x.shape[0]) // ratio], x.astype(np.float64))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("type_", NEW_TYPES, ids=[ggml.type_name(t) for t in NEW_TYPES])
def test_mat_vec_of_the_new_types_for_1_to_8_columns(cuda, type_, schedule):
    """k = 2304: 9 super-blocks or 72 blocks, more than one step of every thread's loop, and a row
    padded to 2560 for Q8_1; 5 rows (the odd last row of 2-row blocks); weights broadcast over 2
    channels of activations (channel_ratio 2)."""
    rng = np.random.default_rng(100 + int(type_))
    k, rows = 2304, 5
    blocks, values = _new_type_weights(type_, (1, rows, k), rng)
    for cols in range(1, 9):
        with emu.emu_schedule(schedule):
            x = _exact_q8_1(rng, (2, cols, k))
            exact = _nmse(_mul_mat(cuda, type_, blocks, x, (k, rows, 1)), _oracle(values, x))
            x = rng.uniform(-1, 1, (2, cols, k)).astype(np.float32)
            ggml_limit = _nmse(_mul_mat(cuda, type_, blocks, x, (k, rows, 1)), _oracle(values, x))
        assert exact < 1e-10, (cols, exact)                        # the kernel's own arithmetic
        assert ggml_limit < 5e-4, (cols, ggml_limit)               # with Q8_1's rounding: ggml's limit
        assert f"mul_mat_vec_{ck.MMVQ_TYPES[type_]}_q8_1_{cols}" in LAUNCHED


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("type_", NEW_TYPES, ids=[ggml.type_name(t) for t in NEW_TYPES])
def test_batched_product_of_the_new_types(cuda, type_, schedule):
    """16 columns: convert.cu's dequantizer, then the GEMM; weights of 2 channels, rows of 512."""
    rng = np.random.default_rng(200 + int(type_))
    k, rows = 512, 40
    blocks, values = _new_type_weights(type_, (2, rows, k), rng)
    x = rng.uniform(-1, 1, (2, 16, k)).astype(np.float32)
    want = _oracle(values, x)
    with emu.emu_schedule(schedule):
        f16 = _nmse(_mul_mat(cuda, type_, blocks, x, (k, rows, 2)), want)
        f32 = _nmse(_mul_mat(cuda, type_, blocks, x, (k, rows, 2), ggml.Prec.F32), want)
    assert f16 < 5e-4 and f32 < 1e-10, (f16, f32)    # F16 weights and activations; F32 throughout
    name = ck.DEQUANTIZE_TYPES[type_]
    assert {f"dequantize_{name}_f16", f"dequantize_{name}_f32"} <= LAUNCHED


@pytest.mark.parametrize("type_", [Type.Q5_0, Type.Q5_1], ids=["q5_0", "q5_1"])
def test_get_rows_of_q5_0_and_q5_1(cuda, type_):
    rng = np.random.default_rng(300 + int(type_))
    blocks, values = _new_type_weights(type_, (10, 96), rng)
    ids = np.array([7, 0, 9, 3, 3], np.int32)

    def build(c):
        table, idx = ggml.new_tensor_2d(c, type_, 96, 10), ggml.new_tensor_1d(c, Type.I32, 5)
        return ggml.get_rows(c, table, idx), (table, idx)

    got = _compute(cuda, build, (blocks, ids)).reshape(5, 96)
    np.testing.assert_allclose(got, values[ids], rtol=1e-6, atol=1e-7)     # a fused multiply-add at most
    assert f"get_rows_{ggml.type_name(type_)}" in LAUNCHED


# mmvf.cu: F32 and F16 weights by few columns (ggml_cuda_should_use_mmvf's rule for NVIDIA since
# Ampere), and the fused RMS_NORM + MUL of norm.cu
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("wtype,cols", [(Type.F32, 1), (Type.F32, 2), (Type.F32, 3), (Type.F16, 1)])
def test_mat_vec_of_float_weights(cuda, wtype, cols, schedule):
    """k = 1000 (500 pairs: 256 threads, two passes for some), 37 rows, weights of 2 channels
    broadcast over 4 and 2 samples kept apart; against float64 products of the same values."""
    rng = np.random.default_rng(cols + 10 * int(wtype))
    k, rows = 1000, 37
    w = rng.standard_normal((2, 2, rows, k)).astype(np.float32)
    w = w.astype(np.float16) if wtype == Type.F16 else w
    x = rng.standard_normal((2, 4, cols, k)).astype(np.float32)

    def build(c):
        a = ggml.new_tensor_4d(c, wtype, k, rows, 2, 2)
        b = ggml.new_tensor_4d(c, Type.F32, k, cols, 4, 2)
        out = ggml.mul_mat(c, a, b)
        assert ck.cuda_should_use_mmvf(out) and not ck.cuda_mul_mat_uses_cublas(out)
        return out, (a, b)

    with emu.emu_schedule(schedule):
        got = _compute(cuda, build, (w, x)).reshape(2, 4, cols, rows)
    want = np.einsum("scrk,scjk->scjr", np.repeat(w.astype(np.float64), 2, axis=1), x.astype(np.float64))
    assert np.sum((got - want) ** 2) / np.sum(want ** 2) < 1e-12        # F32 sums of exact products
    assert f"mul_mat_vec_{ck.MMVF_TYPES[wtype]}_{cols}" in LAUNCHED


def test_which_float_products_take_the_mat_vec(cuda):
    """ggml's rule: F32 up to 3 columns; F16 one column of at most 512 rows or one matrix; odd rows
    and strides that are not whole pairs go to cuBLAS."""
    c = ggml.init(mem_size=32 * ggml.tensor_overhead(), no_alloc=True)
    try:
        def mm(wtype, k, rows, mats, cols):
            return ggml.mul_mat(c, ggml.new_tensor_3d(c, wtype, k, rows, mats),
                                ggml.new_tensor_3d(c, Type.F32, k, cols, mats))
        assert ck.cuda_should_use_mmvf(mm(Type.F32, 64, 1000, 4, 3))
        assert not ck.cuda_should_use_mmvf(mm(Type.F32, 64, 8, 1, 4))
        assert ck.cuda_should_use_mmvf(mm(Type.F16, 64, 512, 8, 1))
        assert ck.cuda_should_use_mmvf(mm(Type.F16, 64, 4096, 1, 1))
        assert not ck.cuda_should_use_mmvf(mm(Type.F16, 64, 513, 2, 1))
        assert not ck.cuda_should_use_mmvf(mm(Type.F16, 64, 16, 1, 2))
        assert not ck.cuda_should_use_mmvf(mm(Type.F32, 63, 16, 1, 1))
        assert ck.cuda_mul_mat_uses_cublas(mm(Type.F16, 64, 16, 1, 2))
        assert not ck.cuda_mul_mat_uses_cublas(mm(Type.Q8_0, 64, 16, 1, 8))
        assert ck.cuda_mul_mat_uses_cublas(mm(Type.Q8_0, 64, 16, 1, 9))
    finally:
        ggml.free(c)


def _norm_times(c, x, g, mul_first=False, extra_use=False):
    n = ggml.rms_norm(c, x, 1e-6)
    out = ggml.mul(c, g, n) if mul_first else ggml.mul(c, n, g)
    return ggml.add(c, out, n) if extra_use else out


@pytest.mark.parametrize("shape,gshape,mul_first", [((1500, 3, 2), (1500,), False), ((64, 5, 1), (64, 5, 1), True),
                                                    ((64, 4, 3), (64, 1, 3), False)])
def test_rms_norm_mul_fused_is_bit_for_bit_the_two_kernels(cuda, shape, gshape, mul_first, monkeypatch):
    """The gain broadcast over rows, or over rows of one channel; the norm as MUL's first or second
    operand. Fused: one launch fewer, and the same bits as with GGML_CUDA_DISABLE_FUSION=1."""
    rng = np.random.default_rng(len(shape) + shape[0])
    x = rng.standard_normal(shape[::-1]).astype(np.float32)
    g = rng.uniform(0.5, 1.5, gshape[::-1]).astype(np.float32)

    def build(c):
        a = ggml.new_tensor(c, Type.F32, 3, list(shape))
        b = ggml.new_tensor(c, Type.F32, len(gshape), list(gshape))
        return _norm_times(c, a, b, mul_first), (a, b)

    def run():
        before = emu.EMU_STATS["launches"]
        got = _compute(cuda, build, (x, g))
        return got, emu.EMU_STATS["launches"] - before

    fused, n_fused = run()
    monkeypatch.setenv("GGML_CUDA_DISABLE_FUSION", "1")
    unfused, n_unfused = run()
    assert "rms_norm_mul_f32" in LAUNCHED
    assert (n_fused, n_unfused) == (1, 2)
    assert np.array_equal(fused.view(np.uint32), unfused.view(np.uint32))
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6) * g
    assert np.max(np.abs(fused - want)) < 1e-5


def test_rms_norm_used_twice_is_not_fused(cuda):
    from ggml_lite.backends.cuda import graphs
    c = ggml.init(mem_size=16 * ggml.tensor_overhead() + 2 * ggml.graph_overhead(), no_alloc=True)
    try:
        x, g = ggml.new_tensor_2d(c, Type.F32, 64, 2), ggml.new_tensor_1d(c, Type.F32, 64)
        for extra_use, fusable in ((False, True), (True, False)):
            gf = ggml.new_graph(c)
            ggml.build_forward_expand(gf, _norm_times(c, x, g, extra_use=extra_use))
            i = next(i for i, n in enumerate(gf.nodes) if n.op == ggml.Op.RMS_NORM)
            assert graphs.cuda_can_fuse_rms_norm_mul(gf, i) is fusable
    finally:
        ggml.free(c)


def test_every_kernel_of_the_sources_ran(cuda):
    """Run last in this module (pytest keeps file order): the harness and the tests above together
    launched every kernel the .cu files define."""
    if len(LAUNCHED) < 20:
        pytest.skip("only part of this module ran")
    defined = set()
    for f in ck.KERNEL_FILES:
        defined |= set(ck._raw_module(0, f, True).kernels)
    assert len(defined) >= 83 and defined <= LAUNCHED, sorted(defined - LAUNCHED)


# ---------------------------------------------------------------------------------------------
# The scheduler over CUDA (emulated) + CPU
# ---------------------------------------------------------------------------------------------

def _two_layers(c, w_bufts, n_embd, n_tok, rng):
    x = ggml.new_tensor_2d(c, Type.F32, n_embd, n_tok)
    ggml.set_input(x)
    bufs, cur = [], x
    for buft in w_bufts:
        wc = ggml.init(mem_size=4 * ggml.tensor_overhead(), no_alloc=True)
        g, a = ggml.new_tensor_1d(wc, Type.F32, n_embd), ggml.new_tensor_2d(wc, Type.F32, n_embd, n_embd)
        b = ggml.new_tensor_2d(wc, Type.Q8_0, n_embd, n_embd)
        buf = ggml.backend_alloc_ctx_tensors_from_buft(wc, buft)
        ggml.backend_buffer_set_usage(buf, ggml.BackendBufferUsage.WEIGHTS)
        ggml.backend_tensor_set(g, rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
        ggml.backend_tensor_set(a, (rng.standard_normal((n_embd, n_embd)) / np.sqrt(n_embd)).astype(np.float32))
        ggml.backend_tensor_set(b, ggml.quantize_chunk(Type.Q8_0, (rng.standard_normal((n_embd, n_embd)) / np.sqrt(n_embd)).astype(np.float32)))
        bufs.append((buf, wc))
        h = ggml.mul_mat(c, b, ggml.silu(c, ggml.mul_mat(c, a, ggml.mul(c, ggml.rms_norm(c, cur, 1e-5), g))))
        cur = ggml.add(c, cur, h)
    gf = ggml.new_graph(c)
    ggml.build_forward_expand(gf, cur)
    return gf, x, cur, bufs


def _run_sched(backends, w_bufts, n_tok):
    c = ggml.init(mem_size=64 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    gf, x, out, bufs = _two_layers(c, w_bufts, 256, n_tok, np.random.default_rng(0))
    sched = ggml.backend_sched_new(backends, None, len(backends), ggml.DEFAULT_GRAPH_SIZE, False, True)
    assert ggml.backend_sched_alloc_graph(sched, gf)
    ggml.backend_tensor_set(x, np.random.default_rng(n_tok).standard_normal((n_tok, 256)).astype(np.float32))
    assert ggml.backend_sched_graph_compute(sched, gf) == ggml.Status.SUCCESS
    result, n_splits = ggml.backend_tensor_get(out), ggml.backend_sched_get_n_splits(sched)
    ggml.backend_sched_free(sched)
    for buf, wc in bufs:
        ggml.backend_buffer_free(buf)
        ggml.free(wc)
    ggml.free(c)
    return result, n_splits


@pytest.mark.skipif(not hasattr(ggml, "backend_sched_new"), reason="ggml_lite has no scheduler in this checkout")
def test_scheduler_over_emulated_cuda_and_cpu_equals_the_cpu(cuda):
    cpu = ggml.backend_cpu_init()
    host, dev = ggml.backend_cpu_buffer_type(), ggml.backend_get_default_buffer_type(cuda)
    for n_tok, splits in ((1, 2), (64, 4)):                   # as chapter 11 and test_cuda predict
        mixed, n = _run_sched([cuda, cpu], [host, dev], n_tok)
        alone, _ = _run_sched([cpu], [host, host], n_tok)
        assert n == splits, (n_tok, n)
        assert np.sum((mixed - alone) ** 2) / np.sum(alone ** 2) < 5e-4


# ---------------------------------------------------------------------------------------------
# The emulator's promises
# ---------------------------------------------------------------------------------------------

def _norm_module(tmp_path, edit):
    """norm.cu against a copy of common.cuh changed by edit(text)."""
    common = (ck.KERNEL_DIR / "common.cuh").read_text()
    changed = edit(common)
    assert changed != common, "the edit changed nothing"
    (tmp_path / "common.cuh").write_text(changed)
    return emu.EmuModule((ck.KERNEL_DIR / "norm.cu").read_text(), (f"-I{tmp_path}",))


def _norm_rows(module, schedule, ncols=4096, nrows=3):
    x = np.random.default_rng(1).standard_normal((nrows, ncols)).astype(np.float32)
    y = np.zeros_like(x)
    args = (np.uint64(x.ctypes.data), np.uint64(y.ctypes.data), np.int32(ncols), np.int64(ncols), np.int64(0),
            np.int64(0), np.float32(1e-5))
    with emu.emu_schedule(schedule):
        module.get_function("norm_f32")((nrows, 1, 1), (1024,), args)
    want = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    return bool(np.all(np.abs(y - want) < 1e-3))


def test_a_removed_barrier_is_caught_by_the_schedules_the_harness_uses(tmp_path):
    """block_reduce's two __syncthreads, each removed in turn: the schedules of SCHEDULES together
    catch both (norm with 1024 threads runs two reductions over one shared array)."""
    first, second = "__syncthreads();                      // shared may", "__syncthreads();\n        x = lane_id"
    intact = emu.EmuModule((ck.KERNEL_DIR / "norm.cu").read_text(), (f"-I{ck.KERNEL_DIR}",))
    assert all(_norm_rows(intact, s) for s in emu.EMU_SCHEDULES)
    for barrier in (first, second):
        module = _norm_module(tmp_path, lambda t: t.replace(barrier, "/* removed */" + barrier[len("__syncthreads();"):], 1))
        assert not all(_norm_rows(module, s) for s in SCHEDULES), f"removing {barrier!r} went unnoticed"


def test_a_barrier_half_a_warp_never_reaches_is_a_deadlock_not_a_hang():
    """Lanes 0-15 wait at __syncthreads, lanes 16-31 at a shuffle that needs the whole warp."""
    code = ('extern "C" __global__ void k(float * x) {\n'
            '    float v = threadIdx.x;\n'
            '    if (threadIdx.x < 16) { __syncthreads(); }\n'
            '    else { v = __shfl_xor_sync(0xffffffff, v, 1); __syncthreads(); }\n'
            '    x[threadIdx.x] = v;\n}\n')
    m = emu.EmuModule(code)
    x = np.zeros(32, np.float32)
    with pytest.raises(GGMLError, match=r"deadlock in block \(0, 0, 0\): 16 of 32 threads wait at "
                                        r"__syncthreads, 16 at a warp-wide operation"):
        m.get_function("k")((1,), (32,), (np.uint64(x.ctypes.data),))


def test_a_launch_is_checked_as_the_kernel_declares_it():
    m = emu.EmuModule('extern "C" __global__ void k(float * x, const int n, const float s) {\n'
                      '    const int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
                      '    if (i < n) { x[i] = s * i; }\n}\n')
    k = m.get_function("k")
    x = np.zeros(100, np.float32)
    p = np.uint64(x.ctypes.data)
    k((4,), (32,), (p, np.int32(100), np.float32(0.5)))
    assert np.array_equal(x, 0.5 * np.arange(100, dtype=np.float32))
    for args, what in (((p, np.int64(100), np.float32(0.5)), "argument 1 is int64"),
                       ((p, np.int32(100), np.float64(0.5)), "argument 2 is float64"),
                       ((p, np.int32(100)), "2 arguments, the kernel takes 3")):
        with pytest.raises(GGMLError, match=what):
            k((4,), (32,), args)
    with pytest.raises(GGMLError, match="more threads per block"):
        k((1,), (2048,), (p, np.int32(100), np.float32(0.5)))
    with pytest.raises(GGMLError, match="no kernel 'nope' in this module"):
        m.get_function("nope")


def test_shuffles_follow_cuda_rules_for_width_and_returned_lanes():
    m = emu.EmuModule('extern "C" __global__ void k(float * out) {\n'
                      '    const int l = threadIdx.x;\n'
                      '    out[l] = __shfl_xor_sync(0xffffffff, (float) l, 8, 16);\n'
                      '    out[32 + l] = __shfl_down_sync(0xffffffff, (float) l, 4, 16);\n'
                      '    if (l >= 24) return;\n'
                      '    out[64 + l] = __shfl_sync(0xffffffff, (float) l, 30);\n}\n')
    out = np.zeros(96, np.float32)
    m.get_function("k")((1,), (32,), (np.uint64(out.ctypes.data),))
    lanes = np.arange(32)
    assert np.array_equal(out[:32], lanes ^ 8)
    assert np.array_equal(out[32:64], np.where(lanes % 16 + 4 < 16, lanes + 4, lanes))
    assert np.isnan(out[64:88]).all()                # lane 30 has returned: nothing to read


def test_the_compiled_module_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code = 'extern "C" __global__ void k(int * x) { x[threadIdx.x] = 7; }\n'
    a = emu.emu_compile(code)
    assert a.parent == tmp_path / "ggml_lite" / "cuda_emu" and emu.emu_compile(code) == a
    assert emu.emu_compile(code.replace("7", "8")) != a
