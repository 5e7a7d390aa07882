"""llamafile's sgemm (tinyBLAS) as ggml-cpu calls it, chapter 05: ggml_lite.backends.cpu.sgemm.
ggml-python's build has GGML_LLAMAFILE off, so no fixture of ggml's sgemm bits: numpy references
(far inside test-backend-ops' mul_mat limit), ggml's decline rules, and the arithmetic order (each output
one 8-lane fma dot, then hsum) checked against a scalar model of it, bit for bit."""
import numpy as np
import pytest

from ggml_lite.backends.cpu import sgemm as S
from ggml_lite.backends.cpu import sgemm_q0 as SQ
from ggml_lite.backends.cpu.vec import forward_mul_mat
from ggml_lite.types import Type


def _nmse(a, b):
    return float(((a.astype(np.float64) - b) ** 2).sum() / (b.astype(np.float64) ** 2).sum())


def _operands(rng, m, n, k, planes=(1, 1), bplanes=None):
    bplanes = bplanes or planes
    a = rng.standard_normal((*planes, m, k)).astype(np.float32)
    b = rng.standard_normal((*bplanes, n, k)).astype(np.float32)
    return a, b


@pytest.mark.parametrize("t", [Type.F32, Type.F16])
@pytest.mark.parametrize("m,n,k", [(64, 5, 32), (32, 7, 64), (48, 2, 16), (128, 64, 256), (12, 9, 40), (20, 4, 32)])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_against_numpy_within_mul_mat_limit(t, m, n, k, nth):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, b = _operands(rng, m, n, k)
    w = a if t == Type.F32 else a.astype(np.float16).view(np.uint16)
    d = np.full((1, 1, n, m), np.nan, np.float32)
    assert S.forward_mul_mat_sgemm(t, w, b, d, nth=nth)
    x, y = (a, b) if t == Type.F32 else (a.astype(np.float16), b.astype(np.float16))
    assert _nmse(d[0, 0], y[0, 0].astype(np.float64) @ x[0, 0].astype(np.float64).T) < 1e-10      # far inside mul_mat's 5e-4


def test_broadcast_planes_like_mul_mat():
    rng = np.random.default_rng(3)
    a, b = _operands(rng, 32, 6, 64, planes=(1, 2), bplanes=(3, 4))
    d = np.empty((3, 4, 6, 32), np.float32)
    assert S.forward_mul_mat_sgemm(Type.F32, a, b, d)
    for i13 in range(3):
        for i12 in range(4):
            ref = b[i13, i12].astype(np.float64) @ a[0, i12 // 2].astype(np.float64).T
            assert _nmse(d[i13, i12], ref) < 1e-12


@pytest.mark.parametrize("m,n,k,nth,want", [
    (16, 1, 32, 1, None),          # one column: decode stays with the dot products
    (18, 4, 32, 1, None),          # m % 4 != 0
    (16, 4, 30, 1, None),          # k % 8 != 0
    (64, 4, 32, 4, (2, 4)),        # m / 16 >= nth: bm = 4; BLOCK_SIZE<3>(4) = 2
    (64, 4, 32, 5, (2, 2)),        # m / 16 < nth, m % 8 == 0: bm = 2
    (20, 7, 32, 1, (3, 1)),        # m % 4 == 0 only: bm = 1
    (32, 2, 32, 1, (2, 4)),
])
def test_plan_is_llamafiles(m, n, k, nth, want):
    assert S.llamafile_sgemm_plan(m, n, k, nth, Type.F32, Type.F32) == want


def test_declines_other_types_and_leaves_dst_alone():
    for pair in ((Type.F16, Type.F32), (Type.F32, Type.F16), (Type.Q8_0, Type.F32), (Type.Q4_1, Type.Q8_1),
                 (Type.Q5_1, Type.Q8_1), (Type.Q4_0, Type.F32),
                 (Type.BF16, Type.BF16)):
        assert S.llamafile_sgemm_plan(64, 4, 32, 1, *pair) is None
    assert S.llamafile_sgemm_plan(64, 4, 32, 1, Type.F32, Type.F32, Type.F16) is None
    rng = np.random.default_rng(1)
    a, b = _operands(rng, 16, 1, 32)
    d = np.full((1, 1, 1, 16), np.nan, np.float32)
    assert not S.forward_mul_mat_sgemm(Type.F32, a, b, d)
    assert np.isnan(d).all()


def _model_dot(x, y):
    """One output as tinyBLAS's AVX2 build adds it: lane t sums x[l] * y[l] for l = t mod 8 by
    fma (float64 product + add, exact before the one rounding for these small-exponent inputs),
    then the lanes in halves: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1."""
    lanes = np.zeros(8, np.float32)
    for l in range(0, len(x), 8):
        lanes = (x[l:l + 8].astype(np.float64) * y[l:l + 8] + lanes).astype(np.float32)
    h = (lanes[:4] + lanes[4:]).astype(np.float32)
    h = (h[:2] + h[2:]).astype(np.float32)
    return np.float32(h[0] + h[1])


def test_each_output_in_ggmls_order_bit_for_bit():
    """Inputs on a grid of 2^-6 with |x| < 4: every product and partial sum is exact in float32
    and float64 alike, except where the sum outgrows 24 bits; so the model's fma is exact too,
    and any other order of additions could still only differ by rounding of large sums: use
    values whose sums do round (k large) to make the order visible."""
    rng = np.random.default_rng(11)
    m, n, k = 12, 5, 1024
    a = (rng.integers(-255, 256, (1, 1, m, k)) / 64).astype(np.float32) * np.float32(1.0001)
    b = (rng.integers(-255, 256, (1, 1, n, k)) / 64).astype(np.float32) * np.float32(0.9999)
    d = np.empty((1, 1, n, m), np.float32)
    assert S.forward_mul_mat_sgemm(Type.F32, a, b, d, nth=2)
    want = np.array([[_model_dot(a[0, 0, i], b[0, 0, j]) for i in range(m)] for j in range(n)], np.float32)
    assert np.array_equal(d[0, 0], want)
    plain = np.empty_like(d)
    forward_mul_mat(Type.F32, a, b, plain)
    assert not np.array_equal(plain, d)      # the chunk loop's order differs: the test can tell them apart


def test_mul_mat_offers_sgemm_only_where_ggml_is_built_with_llamafile():
    """GGML_LLAMAFILE is a build option of ggml (off in ggml's own build, on in llama.cpp's); here a
    CPU backend's setting: off, an F32 product runs the chunk loop (ggml 0.15.3's bits, as the RPC
    fixtures from real ggml check); on, it is a TASK_SGEMM of the compiled loop."""
    import ggml_lite as ggml
    from ggml_lite.backends.cpu import program as P
    from ggml_lite.backends.cpu.backend import backend_cpu_set_llamafile
    from ggml_lite.backends.cpu.compute import _PREPARED
    rng = np.random.default_rng(5)
    w, x = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((8, 32)).astype(np.float32)
    kinds = {}
    for on in (False, True):
        cpu = ggml.backend_cpu_init()
        ggml.backend_cpu_set_n_threads(cpu, 2)
        if on:
            backend_cpu_set_llamafile(cpu, True)
        ctx = ggml.init(mem_size=4 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
        a, b = ggml.new_tensor_2d(ctx, Type.F32, 32, 64), ggml.new_tensor_2d(ctx, Type.F32, 32, 8)
        y = ggml.mul_mat(ctx, a, b)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, y)
        buf = ggml.backend_alloc_ctx_tensors(ctx, cpu)
        ggml.backend_tensor_set(a, w)
        ggml.backend_tensor_set(b, x)
        _PREPARED.clear()
        ggml.backend_graph_compute(cpu, gf)
        got = ggml.backend_tensor_get(y).reshape(8, 64)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        assert ((got - want) ** 2).sum() / (want ** 2).sum() < 1e-12
        kinds[on] = {int(k) for p in _PREPARED.values() if p.native is not None for k in p.native.prog[:, P.KIND]}
        ggml.backend_buffer_free(buf)
        ggml.free(ctx)
    assert P.TASK_SGEMM not in kinds[False] and P.TASK_SGEMM in kinds[True], kinds


def _q8_0(a):
    import ggml_lite as ggml
    k = a.shape[-1]
    q = np.frombuffer(ggml.quantize_chunk(Type.Q8_0, a.reshape(-1, k)), np.uint8)
    return q.reshape(*a.shape[:-1], k // 32 * 34)


def test_q8_0_plan():
    assert S.llamafile_sgemm_plan(64, 4, 2, 1, Type.Q8_0, Type.Q8_0) == (0, 0)      # tinyBLAS_Q0: mnpack's tiles
    assert S.llamafile_sgemm_plan(6, 3, 1, 2, Type.Q8_0, Type.Q8_0) == (0, 0)       # any m, any k
    assert S.llamafile_sgemm_plan(64, 1, 2, 1, Type.Q8_0, Type.Q8_0) is None        # one column: decode
    assert S.llamafile_sgemm_plan(64, 4, 2, 1, Type.Q8_0, Type.Q8_0, Type.F16) is None


@pytest.mark.parametrize("m,n,k", [(64, 5, 64), (13, 7, 96), (6, 2, 32), (3, 9, 64), (128, 64, 256), (5, 3, 32)])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_q8_0_tiles_are_the_dot_products_bits(m, n, k, nth):
    """Every output of tinyBLAS_Q0 is ggml_vec_dot_q8_0_q8_0's, whichever tile and thread made it:
    equal to the chunk loop bit for bit, over shapes that leave rows and columns to mnpack's
    smaller tiles."""
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, b = _operands(rng, m, n, k)
    w = _q8_0(a)
    d, plain = np.full((1, 1, n, m), np.nan, np.float32), np.full((1, 1, n, m), np.nan, np.float32)
    assert S.forward_mul_mat_sgemm(Type.Q8_0, w, b, d, nth=nth)
    forward_mul_mat(Type.Q8_0, w, b, plain)
    assert np.array_equal(d, plain)


def test_q8_0_broadcast_planes():
    rng = np.random.default_rng(4)
    a, b = _operands(rng, 20, 6, 64, planes=(1, 2), bplanes=(3, 4))
    w = _q8_0(a)
    d, plain = np.empty((3, 4, 6, 20), np.float32), np.empty((3, 4, 6, 20), np.float32)
    assert S.forward_mul_mat_sgemm(Type.Q8_0, w, b, d, nth=2)
    forward_mul_mat(Type.Q8_0, w, b, plain)
    assert np.array_equal(d, plain)


def _on_and_off(t, wq, k, m, x, python_loop):
    """mul_mat of an m x k weight of type t (its bytes wq) by the F32 x (2 planes), on 2
    threads, with llamafile off and on: {on: result}, {on: the task keys of the compiled
    programs}."""
    import ggml_lite as ggml
    from ggml_lite.backends.cpu import tasks as T
    from ggml_lite.backends.cpu.compute import _PREPARED
    got, keys = {}, {}
    for on in (False, True):
        ctx = ggml.init(mem_size=8 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
        a, b = ggml.new_tensor_2d(ctx, t, k, m), ggml.new_tensor_3d(ctx, Type.F32, k, x.shape[1], 2)
        y = ggml.mul_mat(ctx, a, b)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, y)
        buf = ggml.backend_alloc_ctx_tensors(ctx, ggml.backend_cpu_init())
        ggml.backend_tensor_set(a, wq)
        ggml.backend_tensor_set(b, x)
        _PREPARED.clear()
        plan = ggml.graph_plan(gf, 2)
        plan.llamafile, plan.python_loop = on, python_loop
        plan.work_data = np.zeros(plan.work_size, np.uint8)
        ggml.graph_compute(gf, plan)
        got[on] = ggml.backend_tensor_get(y)
        keys[on] = {T.task_key(row) for p in _PREPARED.values() if p.native is not None
                    for row in p.native.prog}
        ggml.backend_buffer_free(buf)
        ggml.free(ctx)
    return got, keys


@pytest.mark.parametrize("python_loop", [False, True])
def test_mul_mat_q8_0_takes_the_tiles_with_llamafile_on(python_loop):
    """A Q8_0 weight against 8 F32 activation rows, src1 broadcast over 2 planes: with llamafile on,
    src1 is converted to Q8_0 and the product is tinyBLAS_Q0's (a TASK_SGEMM row keyed by Q8_0 in
    the compiled loop; the Python loop calls the same function), the same bits as with it off."""
    from ggml_lite.backends.cpu import program as P
    rng = np.random.default_rng(6)
    w, x = rng.standard_normal((1, 36, 64)).astype(np.float32), rng.standard_normal((2, 8, 64)).astype(np.float32)
    got, kinds = _on_and_off(Type.Q8_0, _q8_0(w), 64, 36, x, python_loop)
    assert np.array_equal(got[True], got[False])
    tiles = (P.TASK_SGEMM, int(Type.Q8_0))
    assert tiles in kinds[True] and tiles not in kinds[False], kinds


@pytest.mark.parametrize("wtype", ["Q4_0", "Q5_0"])
@pytest.mark.parametrize("python_loop", [False, True])
def test_q4_0_and_q5_0_weights_take_tinyblas_q0(wtype, python_loop):
    """ggml's llamafile_sgemm runs tinyBLAS_Q0_AVX for Q4_0 and Q5_0 weights against Q8_0
    activations too: the same integer sums and fused multiply-adds per block as the weight's
    dot product, so the same bits as with llamafile off; 37 weight rows (a tile of 4 and the
    leftovers), 7 activation rows in 2 planes, 2 threads."""
    import ggml_lite as ggml
    from ggml_lite.backends.cpu import program as P
    t = Type[wtype]
    rng = np.random.default_rng(7)
    w = rng.standard_normal((37, 96)).astype(np.float32)
    x = rng.standard_normal((2, 7, 96)).astype(np.float32)
    got, keys = _on_and_off(t, ggml.quantize_chunk(t, w), 96, 37, x, python_loop)
    assert np.array_equal(got[True], got[False])
    want = x @ ggml.types.dequantize_rows(t, ggml.quantize_chunk(t, w), 96).T
    # (the activations are rounded to Q8_0 on both paths)
    assert ((got[True] - want) ** 2).sum() / (want ** 2).sum() < 1e-4
    if not python_loop:
        assert (P.TASK_SGEMM, int(t)) in keys[True] and (P.TASK_SGEMM, int(t)) not in keys[False]
    assert S.llamafile_sgemm_plan(37, 7, 3, 2, t, Type.Q8_0) == (0, 0)
    assert S.llamafile_sgemm_plan(37, 7, 3, 2, Type.Q4_1, Type.Q8_1) is None     # not in ggml


@pytest.mark.parametrize("rn", [3, 4])
def test_q8_0_zmm_tiles_are_the_dot_products_bits(rn):
    """The 4 x 4 and 4 x 3 tiles with two columns per 512-bit register (taken with AVX512-VNNI;
    elsewhere the same lanes in plain IR) against the chunk loop's dot products, bit for bit."""
    from numba import njit
    rng = np.random.default_rng(40 + rn)
    a, b = _operands(rng, 4, rn, 96)
    from ggml_lite.backends.cpu.quants import quantize_row_q8_0
    k, lda = 3, 3 * SQ.Q8_0_BYTES
    w, x = _q8_0(a), np.empty(rn * lda, np.uint8)
    quantize_row_q8_0(b.reshape(-1), x)              # as the chunk loop converts src1
    dA4, U4 = np.empty(4 * k, np.float32), np.empty(128 * k, np.uint8)
    c = np.full(rn * 4, np.nan, np.float32)

    @njit
    def tile(A, B, C, dA4, U4, dB):                  # the weight's type, Q8_0, a constant
        SQ.q0_rows4(8, A, lda, 0, k, dA4, U4)
        SQ.q0_tile_zmm(8, U4, B, lda, C, 4, k, 0, 0, rn, dA4, dB)

    tile(w.reshape(-1), x, c, dA4, U4, SQ.q0_row_scales(x, lda, rn, k))
    assert np.array_equal(dA4, [SQ.q0_row_scales(w.reshape(-1), lda, 4, k)[i * k + l]
                                for l in range(k) for i in range(4)])
    plain = np.full((1, 1, rn, 4), np.nan, np.float32)
    forward_mul_mat(Type.Q8_0, w, b, plain)
    assert np.array_equal(c.reshape(rn, 4), plain[0, 0])


@pytest.mark.skipif(not SQ.AVX512_VNNI, reason="the CPU variant has no AVX512-VNNI: the Q8_0 tiles "
                    "stay AVX2's 4 x 2, on 256-bit registers")
def test_q8_0_zmm_tiles_taken_and_512_bit():
    from numba import njit

    @njit
    def dot64(a, b):
        acc = SQ.vzero(np.int32, 16) + np.int32(-7)
        return SQ.vget(SQ._dpbusd64(acc, SQ.vload(a, 0, 64), SQ.vload(b, 0, 64)), 1)

    x = np.arange(64, dtype=np.uint8) * np.uint8(37)      # bytes of both signs
    assert dot64(x, x) == -7 + sum(int(v) * int(np.int8(v)) for v in x[4:8])
    asm = next(iter(dot64.inspect_asm().values()))
    assert "vpdpbusd" in asm and "zmm" in asm
    assert SQ._ZMM and tuple(SQ._MNPACK[3, 3]) == (4, 4)


def _ymm_tiles(t, a, b):
    """The outputs of one plane as gemm_bloc, the AVX2 build's 4 x 1 tile, makes each: the
    oracle of gemm_bloc_zmm's bits."""
    from numba import njit

    @njit
    def run(A, B, C, m, n, k):
        for ii in range(0, m, 4):
            for jj in range(n):
                S.gemm_bloc(A, k, B, k, C, m, k, ii, jj, 1)

    m, k, n = a.shape[-2], a.shape[-1], b.shape[-2]
    x, y = (a, b) if t == Type.F32 else (a.astype(np.float16).view(np.uint16), b.astype(np.float16).view(np.uint16))
    c = np.full(n * m, np.nan, np.float32)
    run(np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(y).reshape(-1), c, m, n, k)
    return c.reshape(n, m)


@pytest.mark.parametrize("t", [Type.F32, Type.F16])
@pytest.mark.parametrize("m,n,k", [(16, 2, 8), (48, 7, 40), (20, 13, 24), (256, 64, 64), (64, 64, 256),
                                   (24, 9, 32), (16, 77, 16)])
@pytest.mark.parametrize("nth", [1, 2])
def test_float_tiles_keep_the_avx2_bits(t, m, n, k, nth):
    """Whatever tile computes them (with AVX-512 gemm_bloc_zmm: 8 x 6 outputs, two per 16-lane
    register, F16 rows widened per job; elsewhere gemm_bloc), jobs of 4, 8 or 16 rows, columns
    left over: every output is the AVX2 build's 8-lane sum, bit for bit."""
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, b = _operands(rng, m, n, k)
    w = a if t == Type.F32 else a.astype(np.float16).view(np.uint16)
    d = np.full((1, 1, n, m), np.nan, np.float32)
    bf = b if t == Type.F32 else b.astype(np.float16).astype(np.float32)
    assert S.forward_mul_mat_sgemm(t, w, bf, d, nth=nth)
    assert np.array_equal(d[0, 0], _ymm_tiles(t, a, bf))


def test_f16_tiles_keep_bits_across_planes():
    """Broadcast planes (r2 = 2, r3 = 1): each thread's widened columns belong to one plane's
    block and are widened again for the next."""
    rng = np.random.default_rng(17)
    a, b = _operands(rng, 32, 10, 48, planes=(1, 2), bplanes=(3, 4))
    w = a.astype(np.float16).view(np.uint16)
    bf = b.astype(np.float16).astype(np.float32)
    d = np.full((3, 4, 10, 32), np.nan, np.float32)
    assert S.forward_mul_mat_sgemm(Type.F16, w, bf, d, nth=2)
    for i13 in range(3):
        for i12 in range(4):
            assert np.array_equal(d[i13, i12], _ymm_tiles(Type.F16, a[0, i12 // 2], bf[i13, i12]))


@pytest.mark.skipif(not S.AVX512, reason="the CPU variant has no AVX-512: the float tiles stay AVX2's "
                    "4 x 3 on 256-bit registers")
def test_float_zmm_tiles_taken_and_512_bit():
    from numba import njit

    @njit
    def tile(a, c):                        # not cached: its machine code can be read
        S.gemm_bloc_zmm(a, 0, 16, a, 0, 16, c, 0, 8, 16, 8, 6)

    tile(np.zeros(8 * 16, np.float32), np.zeros(6 * 8, np.float32))
    asm = next(iter(tile.inspect_asm().values()))
    assert "vbroadcastf64x4" in asm and "vfmadd231ps\t%zmm" in asm
