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


@pytest.mark.parametrize("m", [1, 3, 4, 7, 13])
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
    if case["case"][0] == "Q4_K":
        assert mine is False and case["supported"] is True    # ggml repacks Q4_K; ggml_lite does not (07c)
    else:
        assert mine == case["supported"]


def test_refuses_partial_writes_and_reads():
    W, _, _ = _product(REF["x1"], R.backend_cpu_repack_buffer_type())
    for call in (lambda: ggml.backend_tensor_set(W, REF["w"].reshape(-1)[:288], 0, 288),
                 lambda: ggml.backend_tensor_set(W, REF["w"].reshape(-1)[:288], 288, 288),
                 lambda: ggml.backend_tensor_get(W)):
        with pytest.raises(ggml.GGMLError):
            call()
