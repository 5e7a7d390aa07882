"""The CPU device's extra buffer type CPU_REPACK (chapter 07c) against real ggml 0.15.3's
(tests/data/repack_ref.npz, .json: tests/ggml_ref/repack_ref.py)."""
import json
from pathlib import Path

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite import Type
from ggml_lite.backends.cpu import repack as R

DATA = Path(__file__).parent / "data"
REF = dict(np.load(DATA / "repack_ref.npz"))
META = json.loads((DATA / "repack_ref.json").read_text())
K, N = 512, 64


def _product(x, buft, n_threads=1, w=REF["w"], k=K, n=N):
    cpu = ggml.backend_cpu_init()
    cw = ggml.init(mem_size=2 * ggml.tensor_overhead(), no_alloc=True)
    W = ggml.new_tensor_2d(cw, Type.Q4_0, k, n)
    wbuf = ggml.backend_alloc_ctx_tensors_from_buft(cw, buft)
    ggml.backend_tensor_set(W, w)
    cx = ggml.init(mem_size=4 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    X = ggml.new_tensor_2d(cx, Type.F32, k, x.shape[0])
    Y = ggml.mul_mat(cx, W, X)
    gf = ggml.new_graph(cx)
    ggml.build_forward_expand(gf, Y)
    ggml.backend_alloc_ctx_tensors(cx, cpu)
    ggml.backend_tensor_set(X, x)
    ggml.backend_cpu_set_n_threads(cpu, n_threads)
    assert ggml.backend_graph_compute(cpu, gf) == ggml.Status.SUCCESS
    return W, wbuf, ggml.backend_tensor_get(Y).reshape(x.shape[0], n)


def test_extra_bufts_through_the_reg():
    reg = ggml.backend_cpu_reg()
    dev = ggml.backend_reg_dev_get(reg, 0)
    bufts = ggml.backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts")(dev)
    assert [ggml.backend_buft_name(b) for b in bufts] == META["extra_bufts"]
    b = bufts[0]
    assert ggml.backend_buft_is_host(b) == META["repack_buft"]["is_host"]
    assert ggml.backend_buft_get_alignment(b) == META["repack_buft"]["alignment"]
    assert ggml.backend_dev_supports_buft(dev, b)
    assert ggml.backend_buft_get_device(b) is dev


def test_repacked_bytes_are_ggmls():
    W, wbuf, _ = _product(REF["x1"], R.backend_cpu_repack_buffer_type())
    assert np.array_equal(wbuf.host_array()[:ggml.nbytes(W)], REF["repacked"])


@pytest.mark.parametrize("m", [1, 3, 4, 7, 13, 21])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_repacked_product_is_ggmls_bits(m, n_threads):
    _, _, y = _product(REF[f"x{m}"], R.backend_cpu_repack_buffer_type(), n_threads)
    assert np.array_equal(y, REF[f"out{m}"])


@pytest.mark.parametrize("m", [1, 7, 13])
def test_repacked_within_test_backend_ops_limit_of_plain(m):
    _, _, y = _product(REF[f"x{m}"], R.backend_cpu_repack_buffer_type())
    _, _, plain = _product(REF[f"x{m}"], ggml.backend_cpu_buffer_type())
    assert not np.array_equal(y, plain)            # two summation orders: the test can tell them apart
    assert ((plain - y) ** 2).sum() / (plain ** 2).sum() < 5e-4


def test_kernel_on_every_split_of_rows_and_columns():
    """gemm_q4_0_8x8_q8_0 on any sub-range of groups and rows gives those outputs of the whole."""
    rng = np.random.default_rng(5)
    from ggml_lite.backends.cpu.quants import quantize_row_q8_0
    x = rng.standard_normal((21, K)).astype(np.float32)
    y = np.empty(21 * (K // 32) * 34, np.uint8)
    quantize_row_q8_0(x.reshape(-1), y)
    rp = R.repack_q4_0_to_q4_0_8_bl(REF["w"].reshape(-1), N, K // 32)
    whole = np.zeros((21, N), np.float32)
    R.gemm_q4_0_8x8_q8_0(K, rp, rp.view(np.uint16), y, (K // 32) * 34, whole, 0, N // 8, 0, 21)
    for g0, g1, j0, j1 in ((0, 1, 0, 1), (3, 8, 2, 19), (1, 2, 5, 21), (7, 8, 0, 21)):
        part = np.full((21, N), np.nan, np.float32)
        R.gemm_q4_0_8x8_q8_0(K, rp, rp.view(np.uint16), y, (K // 32) * 34, part, g0, g1, j0, j1)
        assert np.array_equal(part[j0:j1, 8 * g0:8 * g1], whole[j0:j1, 8 * g0:8 * g1])
        assert np.isnan(part[:j0]).all() and np.isnan(part[:, 8 * g1:]).all()


needs_avx512 = pytest.mark.skipif(
    not R.AVX512, reason="the CPU variant has no AVX-512: the zmm kernel is not taken here "
    "(it would run, but split into 256-bit halves)")


def test_zmm_kernel_taken_where_the_variant_has_avx512():
    from ggml_lite.backends.cpu import variants as V
    assert R.AVX512 == ("AVX512" in V.CPU_VARIANTS[V.cpu_variant()])


@needs_avx512
def test_zmm_kernel_is_the_avx2_kernels_bits():
    """gemm_q4_0_8x8_q8_0_zmm (two weight groups per zmm register, as ggml's __AVX512F__
    body) gives the AVX2 kernel's bits on every range of groups (even and odd counts, so
    the odd last group's hand-over too) and of rows (8 at a time and the rest)."""
    rng = np.random.default_rng(11)
    from ggml_lite.backends.cpu.quants import quantize_row_q8_0
    x = (rng.standard_normal((21, K)) * rng.uniform(0.1, 4.0, (21, 1))).astype(np.float32)
    y = np.empty(21 * (K // 32) * 34, np.uint8)
    quantize_row_q8_0(x.reshape(-1), y)
    rp = R.repack_q4_0_to_q4_0_8_bl(REF["w"].reshape(-1), N, K // 32)
    for g0, g1, j0, j1 in ((0, 8, 0, 21), (0, 2, 0, 8), (3, 8, 2, 19), (1, 2, 5, 21),
                           (2, 7, 13, 14), (6, 8, 0, 9)):
        avx2 = np.full((21, N), np.nan, np.float32)
        zmm = avx2.copy()
        for kernel, out in ((R.gemm_q4_0_8x8_q8_0, avx2), (R.gemm_q4_0_8x8_q8_0_zmm, zmm)):
            kernel(K, rp, rp.view(np.uint16), y, (K // 32) * 34, out, g0, g1, j0, j1)
        assert np.array_equal(zmm, avx2, equal_nan=True), (g0, g1, j0, j1)
        assert not np.isnan(zmm[j0:j1, 8 * g0:8 * g1]).any()


def test_chunks_cover_every_row_once():
    for nr0 in (8, 16, 64, 72, 4096):
        for nth in (1, 2, 3, 4, 8, 16):
            nchunk0, dr0 = R.repack_chunks(nr0, nth)
            rows = []
            for c in range(nchunk0):
                s0, e0 = dr0 * c, min(dr0 * c + dr0, nr0)
                s0, e0 = -(-s0 // 8) * 8, min(-(-e0 // 8) * 8, nr0)
                rows += list(range(s0, e0))
            assert sorted(rows) == list(range(nr0)), (nr0, nth)


def _node(wtype, ne, op, src1_type, nd):
    cw = ggml.init(mem_size=2 * ggml.tensor_overhead(), no_alloc=True)
    w = ggml.new_tensor_2d(cw, Type[wtype], *ne[:2]) if nd == 2 else ggml.new_tensor_3d(cw, Type[wtype], *ne)
    ggml.backend_alloc_ctx_tensors_from_buft(cw, R.backend_cpu_repack_buffer_type())
    cx = ggml.init(mem_size=4 * ggml.tensor_overhead(), no_alloc=True)
    if op == "MUL_MAT":
        return ggml.mul_mat(cx, w, ggml.new_tensor_3d(cx, Type[src1_type], ne[0], 5, ne[2] if nd == 3 else 1))
    return ggml.get_rows(cx, w, ggml.new_tensor_1d(cx, Type.I32, 3))


@pytest.mark.parametrize("case", META["supports_op"], ids=lambda c: "-".join(map(str, c["case"][:3])))
def test_supports_op_as_ggml(case):
    dev = ggml.backend_reg_dev_get(ggml.backend_cpu_reg(), 0)
    mine = ggml.backend_dev_supports_op(dev, _node(*case["case"]))
    assert mine == case["supported"]


def test_refuses_partial_writes_and_reads():
    W, _, _ = _product(REF["x1"], R.backend_cpu_repack_buffer_type())
    for call in (lambda: ggml.backend_tensor_set(W, REF["w"].reshape(-1)[:288], 0, 288),
                 lambda: ggml.backend_tensor_set(W, REF["w"].reshape(-1)[:288], 288, 288),
                 lambda: ggml.backend_tensor_get(W)):
        with pytest.raises(ggml.GGMLError):
            call()


# --- Q4_K: block_q4_Kx8 and the x86 gemm/gemv of ggml 0.25.3 ---------------------------------------

from ggml_lite.backends.cpu import repack_k as RK          # noqa: E402
from ggml_lite.quants import quantize_row_q4_K_ref, quantize_row_q8_K_ref   # noqa: E402

KK, NK = 512, 32                     # two super-blocks per row, four groups of 8 weight rows


def _fma32(a, b, c):
    """float32 a * b + c rounded once, from float64: the product of two float32 is exact, the
    sum's rounding error is recovered (TwoSum) and decides a float32 tie."""
    a, b, c = float(np.float32(a)), float(np.float32(b)), float(np.float32(c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = np.float32(s)
    if e != 0 and float(r) != s:
        other = np.nextafter(r, np.float32(np.inf if float(r) < s else -np.inf))
        if (float(r) + float(other)) / 2 == s:
            r = max(r, other) if e > 0 else min(r, other)
    return np.float32(r)


def _q4_K_parts(w, nrow, n):
    """codes [row, block, 256], 6-bit scales and mins [row, block, 8], d and dmin [row, block]
    of plain block_q4_K bytes (chapter 01's layout, not the repacked one)."""
    b = w.reshape(nrow, n // 256, 144)
    d = b[..., 0:4].copy().view(np.float16).astype(np.float32)
    q = b[..., 4:16].astype(np.int64)
    sc, mn = np.zeros(q.shape[:2] + (8,), np.int64), np.zeros(q.shape[:2] + (8,), np.int64)
    for j in range(4):
        sc[..., j], mn[..., j] = q[..., j] & 63, q[..., j + 4] & 63
        sc[..., j + 4] = (q[..., j + 8] & 15) | ((q[..., j] >> 6) << 4)
        mn[..., j + 4] = (q[..., j + 8] >> 4) | ((q[..., j + 4] >> 6) << 4)
    qs = b[..., 16:].astype(np.int64).reshape(nrow, n // 256, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(nrow, n // 256, 256)
    return codes, sc, mn, d[..., 0], d[..., 1]


def _avx2_order(w, nrow, y, m, n, ngemm):
    """The AVX2 kernels' arithmetic written plainly: exact integer sums per sub-block; rows
    j < ngemm (the gemm's) multiply-add per pair of sub-blocks, the others (the gemv's) per
    super-block; out = acc - accm."""
    codes, sc, mn, dw, dmw = _q4_K_parts(w, nrow, n)
    b8 = y.reshape(m, n // 256, 292)
    da = b8[..., 0:4].copy().view(np.float32)[..., 0]
    qs = b8[..., 4:260].view(np.int8).astype(np.int64)
    out = np.zeros((m, nrow), np.float32)
    for j in range(m):
        for r in range(nrow):
            acc = accm = np.float32(0)
            for b in range(n // 256):
                a = qs[j, b].reshape(8, 32)
                ints = sc[r, b] * (codes[r, b].reshape(8, 32) * a).sum(1)
                mins = mn[r, b] * a.sum(1)
                dd, dm = np.float32(dw[r, b] * da[j, b]), np.float32(dmw[r, b] * da[j, b])
                parts = ((ints[0::2] + ints[1::2], mins[0::2] + mins[1::2]) if j < ngemm
                         else ([ints.sum()], [mins.sum()]))
                for i, mi in zip(*parts):
                    acc, accm = _fma32(np.float32(i), dd, acc), _fma32(np.float32(mi), dm, accm)
            out[j, r] = acc - accm
    return out


def _q4_K_weight(seed=11):
    rng = np.random.default_rng(seed)
    w = np.empty(NK * (KK // 256) * 144, np.uint8)
    quantize_row_q4_K_ref(rng.standard_normal(NK * KK).astype(np.float32), w)
    return w


def _q4_K_product(x, buft, n_threads):
    cpu = ggml.backend_cpu_init()
    cw = ggml.init(mem_size=2 * ggml.tensor_overhead(), no_alloc=True)
    W = ggml.new_tensor_2d(cw, Type.Q4_K, KK, NK)
    wbuf = ggml.backend_alloc_ctx_tensors_from_buft(cw, buft)
    ggml.backend_tensor_set(W, _q4_K_weight())
    cx = ggml.init(mem_size=4 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    X = ggml.new_tensor_2d(cx, Type.F32, KK, x.shape[0])
    Y = ggml.mul_mat(cx, W, X)
    gf = ggml.new_graph(cx)
    ggml.build_forward_expand(gf, Y)
    ggml.backend_alloc_ctx_tensors(cx, cpu)
    ggml.backend_tensor_set(X, x)
    ggml.backend_cpu_set_n_threads(cpu, n_threads)
    assert ggml.backend_graph_compute(cpu, gf) == ggml.Status.SUCCESS
    return W, wbuf, ggml.backend_tensor_get(Y).reshape(x.shape[0], NK)


def _activations(m, seed=0):
    x = np.random.default_rng(seed + m).standard_normal((m, KK)).astype(np.float32)
    return x * np.float32(300.0)                          # large, as a residual stream


needs_avx2 = pytest.mark.skipif(not R._HAS_AVX2, reason="CPU_REPACK takes Q4_K only with AVX2")


@needs_avx2
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("m", list(range(1, 10)))
def test_q4_K_repacked_product_is_the_avx2_order(m, n_threads):
    """The repacked Q4_K mul_mat, through the graph, against the AVX2 order written plainly, bit
    for bit; and against the plain kernel (vec_dot_q4_K_q8_K) within the mul_mat limit."""
    x = _activations(m)
    W, _, y = _q4_K_product(x, R.backend_cpu_repack_buffer_type(), n_threads)
    assert W.extra == "q4_K_8x8_q8_K"
    rs = (KK // 256) * 292
    q8 = np.empty(m * rs, np.uint8)
    for j in range(m):                           # no +-amax ties in these rows: the two agree
        quantize_row_q8_K_ref(x[j], q8[j * rs:(j + 1) * rs])
    ref = _avx2_order(_q4_K_weight(), NK, q8, m, KK, m - m % 4)
    assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))
    _, _, plain = _q4_K_product(x, ggml.backend_cpu_buffer_type(), n_threads)
    assert ((plain - y) ** 2).sum() / (plain ** 2).sum() < 5e-4


def test_q4_K_gemm_and_gemv_orders_differ():
    """The emulation can tell the gemm's order from the gemv's (else the test above proves
    less than it says)."""
    m, rs = 8, (KK // 256) * 292
    q8 = np.empty(m * rs, np.uint8)
    x = _activations(m, seed=3)
    for j in range(m):
        quantize_row_q8_K_ref(x[j], q8[j * rs:(j + 1) * rs])
    a, b = (_avx2_order(_q4_K_weight(), NK, q8, m, KK, g) for g in (m, 0))
    assert not np.array_equal(a, b)


def test_q4_K_repacked_layout():
    """block_q4_Kx8 read back by hand as ggml's make_block_q4_Kx8 writes it: the 8 rows' d, their
    dmin, per sub-block s 12 bytes packing the 8 rows' 6-bit scales and mins as a block_q4_K packs
    its 8 sub-blocks, then chunk c of 8 nibble bytes = bytes 8 * (c // 8) .. of row c % 8."""
    w = _q4_K_weight()
    rp = RK.repack_q4_K_to_q4_K_8_bl(w, NK, KK // 256).reshape(NK // 8, KK // 256, 1152)
    assert rp.size == w.size
    raw = w.reshape(NK, KK // 256, 144)
    _, sc, mn, d, dmin = _q4_K_parts(w, NK, KK)
    for g in range(NK // 8):
        for b in range(KK // 256):
            blk, rows = rp[g, b], slice(8 * g, 8 * g + 8)
            assert np.array_equal(blk[:16].view(np.float16).astype(np.float32), d[rows, b])
            assert np.array_equal(blk[16:32].view(np.float16).astype(np.float32), dmin[rows, b])
            for sub in range(8):
                q = blk[32 + 12 * sub:44 + 12 * sub].astype(np.int64)
                for r in range(8):               # row r where a block_q4_K has sub-block r
                    s6 = q[r] & 63 if r < 4 else (q[r + 4] & 15) | ((q[r - 4] >> 6) << 4)
                    m6 = q[r + 4] & 63 if r < 4 else (q[r + 4] >> 4) | ((q[r] >> 6) << 4)
                    assert (s6, m6) == (sc[8 * g + r, b, sub], mn[8 * g + r, b, sub])
            for c in range(128):
                assert np.array_equal(blk[128 + 8 * c:136 + 8 * c],
                                      raw[8 * g + c % 8, b, 16 + 8 * (c // 8):24 + 8 * (c // 8)])


def test_q4_K_activation_rows_in_groups_of_4_take_plus_amax():
    """ggml_quantize_mat_q8_K_4x8 (AVX2) and quantize_row_q8_K differ only where a super-block
    holds +amax and -amax: the first gives the scale the sign of +amax, the reference that of
    the first of the two. Rows 0..3 (a group of 4) take the first rule, row 4 (left over) the
    reference's."""
    x = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32)
    x[:, 10], x[:, 200] = -9.0, 9.0
    rs = 292
    w = np.empty(5 * rs, np.uint8)
    RK.quantize_src1_q8_K(x.reshape(1, 1, 5, 256), w, rs, 0, 1)
    ref = np.empty(rs, np.uint8)
    quantize_row_q8_K_ref(x[4], ref)
    assert np.array_equal(w[4 * rs:], ref)
    d = w.reshape(5, rs)[:, :4].copy().view(np.float32)[:, 0]
    assert (d[:4] < 0).all() and d[4] > 0         # -127 / (+9) versus -127 / (-9)
    q = w.reshape(5, rs)[:, 4:260].view(np.int8)
    assert (q[:4, 200] == -127).all() and q[4, 200] == 127


@needs_avx2
@pytest.mark.parametrize("m", [3, 9])
def test_q4_K_python_tasks_are_the_compiled_loops(m):
    """With no row for the compiled loop (lower answers None), the kernel's two Python tasks
    (_prepare_repacked_k) run, and give the same bits."""
    x = _activations(m, seed=9)
    _, _, compiled = _q4_K_product(x, R.backend_cpu_repack_buffer_type(), 2)
    kernel, lower = R.REPACK_Q4_K_8X8, R.REPACK_Q4_K_8X8.lower
    object.__setattr__(kernel, "lower", lambda node, p, nth: None)
    try:
        _, _, called_back = _q4_K_product(x, R.backend_cpu_repack_buffer_type(), 2)
    finally:
        object.__setattr__(kernel, "lower", lower)
    assert np.array_equal(compiled.view(np.uint32), called_back.view(np.uint32))
