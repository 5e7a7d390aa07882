"""ggml's tiled K-quant kernel (chapter 05, backends/cpu/tiled_kernel.py) against its definition.

tiled_dot (tiled.py) is the oracle: one output at a time, the microkernel's floats around the dot
products' integers. The kernel unpacks windows of weight rows and activation columns, multiplies
them with vpdpbusd (vpmaddubsw without VNNI) and must give every output's bits exactly, whatever
the window, the band, the plane or the thread that computed it. tests/test_cpu_kernels.py holds
the comparison with ggml 0.25.3 itself (tests/data/tiled_ref.npz), tests/test_cpu_variants.py
the AVX2 variant's kernel (vpmaddubsw) against the VNNI one.
"""
import threading

import numpy as np
import pytest
from numba import njit

import ggml_lite as ggml
from ggml_lite.backends.cpu import vec as V
from ggml_lite.backends.cpu.simd import vas, vload
from ggml_lite.backends.cpu.tiled import TILED, tiled_dot
from ggml_lite.backends.cpu.tiled_kernel import (dot2_i16, dot4_small, splat4, tiled_chunks,
                                                 vstore)
from ggml_lite.types import Type, quantize_chunk, row_size

K_QUANTS = [Type.Q2_K, Type.Q3_K, Type.Q4_K, Type.Q5_K, Type.Q6_K]


@pytest.fixture(autouse=True)
def _tiled_on(monkeypatch):
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    monkeypatch.delenv("GGML_CPU_TILED_MM_FORCE", raising=False)


@njit(cache=True)
def _oracle(t, n, a, w, rs, d):
    """d[i3, i2, c, r] = tiled_dot of weight row r of plane (i3 // r3, i2 // r2) with src1 row
    (i3, i2, c) of the Q8_K rows in w, one output at a time."""
    ne13, ne12, ne11 = d.shape[0], d.shape[1], d.shape[2]
    r2, r3 = ne12 // a.shape[1], ne13 // a.shape[0]
    for i3 in range(ne13):
        for i2 in range(ne12):
            for c in range(ne11):
                j = (i3 * ne12 + i2) * ne11 + c
                y = w[j * rs:(j + 1) * rs]
                for r in range(a.shape[2]):
                    d[i3, i2, c, r] = tiled_dot(t, n, a[i3 // r3, i2 // r2, r], y)


def _operands(t, m, k, n, planes=(1, 1), bcast=(1, 1), seed=0):
    rng = np.random.default_rng(seed)
    ne02, ne03 = planes
    ne12, ne13 = ne02 * bcast[0], ne03 * bcast[1]
    w = rng.standard_normal((ne03 * ne02 * m, k)).astype(np.float32)
    a = quantize_chunk(t, w).reshape(ne03, ne02, m, -1)
    b = rng.standard_normal((ne13, ne12, n, k)).astype(np.float32)
    return a, b


def _want(t, a, b):
    n = b.shape[3]
    rs = row_size(Type.Q8_K, n)
    w = np.zeros(b.shape[0] * b.shape[1] * b.shape[2] * rs, np.uint8)
    V.forward_mul_mat_src1(t, b, w)
    d = np.zeros(b.shape[:3] + (a.shape[2],), np.float32)
    _oracle(int(t), n, a, w, rs, d)
    return d


# rows and columns past a band of 8 and 16, past a window of 256, planes broadcast (r2, r3)
# and src1 planes thinner than a band (windows cut where a plane ends)
SHAPES = [(70, 512, 21, (1, 1), (1, 1), 1), (300, 256, 270, (1, 1), (1, 1), 2),
          (16, 768, 8, (2, 1), (2, 1), 3), (40, 256, 3, (1, 2), (2, 2), 2),
          (9, 512, 33, (1, 1), (1, 1), 4)]


@pytest.mark.parametrize("t", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("m, k, n, planes, bcast, nth", SHAPES)
def test_every_output_is_the_oracles(t, m, k, n, planes, bcast, nth, monkeypatch):
    if n < 8:                   # ggml takes the tiled product from 8 columns, or forced
        monkeypatch.setenv("GGML_CPU_TILED_MM_FORCE", "1")
    a, b = _operands(t, m, k, n, planes, bcast, seed=m * n + k)
    want = _want(t, a, b)
    got = np.full(want.shape, np.nan, np.float32)
    V.forward_mul_mat(t, a, b, got, nth=nth)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("t", [Type.Q4_K, Type.Q6_K], ids=lambda t: t.name)
def test_real_threads_and_the_compiled_program(t):
    """Two threads sharing the chunk counter, then a graph through the CPU backend (the compiled
    program): the same bits as the oracle."""
    a, b = _operands(t, 520, 512, 40, seed=5)
    want = _want(t, a, b)
    nth = 2
    w = np.empty(V.mul_mat_wsize(t, b), np.uint8)
    d = np.full(want.shape, np.nan, np.float32)
    counter = np.array([nth], np.int64)
    chunks = V.mul_mat_chunks_of(int(t) + TILED, 520, 40, nth)
    owner = np.full(chunks[0] * chunks[1], -1, np.int32)
    barrier = threading.Barrier(nth)

    def worker(ith):
        V.forward_mul_mat_src1(t, b, w, ith, nth)
        barrier.wait()
        V.forward_mul_mat_chunks(t, a, b, d, w, counter, ith, nth, owner)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(nth)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert np.array_equal(d.view(np.uint32), want.view(np.uint32))
    assert set(owner.tolist()) <= {0, 1} and (owner >= 0).all()

    ctx = ggml.init(mem_size=16 << 20)
    try:
        x = ggml.new_tensor_2d(ctx, t, 512, 520)
        y = ggml.new_tensor_2d(ctx, ggml.Type.F32, 512, 40)
        out = ggml.mul_mat(ctx, x, y)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, out)
        x.numpy()[...] = a.reshape(x.numpy().shape)
        y.numpy()[...] = b.reshape(y.numpy().shape)
        plan = ggml.graph_plan(gf, 2)
        plan.work_data = np.zeros(plan.work_size, np.uint8)
        ggml.graph_compute(gf, plan)
        got = out.numpy().reshape(want.shape).copy()
    finally:
        ggml.free(ctx)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_tiled_chunks_are_ggmls():
    """ggml_compute_forward_mul_mat_tiled_driver: chunks of 256, halved while there are fewer
    than 4 per thread and they are wider than 16."""
    assert tiled_chunks(4096, 32, 1) == (16, 1, 256, 32)
    assert tiled_chunks(4096, 32, 8) == (32, 1, 128, 32)
    assert tiled_chunks(64, 16, 2) == (4, 1, 16, 16)      # stops at 16: 4 chunks for 2 threads
    assert tiled_chunks(600, 600, 2) == (3, 3, 200, 200)
    for nr0, nr1, nth in [(1000, 9, 3), (17, 300, 4), (256, 256, 1)]:
        nc0, nc1, dr0, dr1 = tiled_chunks(nr0, nr1, nth)
        assert nc0 * dr0 >= nr0 and nc1 * dr1 >= nr1
        assert (nc0 - 1) * dr0 < nr0 and (nc1 - 1) * dr1 < nr1


@njit(cache=True)
def _dots(u, s, x, y, out4, out2):
    acc = vas(vload(out4, 0, 64), np.int32)
    vstore(out4, 0, vas(dot4_small(acc, vload(u, 0, 64), vas(vload(s, 0, 64), np.int8)),
                              np.uint8))
    acc = vas(vload(out2, 0, 64), np.int32)
    vstore(out2, 0, vas(dot2_i16(acc, vas(splat4(x, 0), np.int16),
                                       vas(vload(y, 0, 64), np.int16)), np.uint8))


def test_the_integer_steps_are_exact():
    """dot4_small: unsigned bytes below 64 times signed bytes, in fours, added to acc (with
    VNNI one vpdpbusd, else vpmaddubsw + vpmaddwd: no pair overflows 16 bits); dot2_i16: int16
    pairs (vpdpwssd); splat4: four bytes in every lane."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        u = rng.integers(0, 64, 64, dtype=np.uint8)
        s = rng.integers(-128, 128, 64).astype(np.int8)
        acc4 = rng.integers(-2**20, 2**20, 16).astype(np.int32)
        x = rng.integers(-2**15, 2**15, 2).astype(np.int16)
        y = rng.integers(-2**15, 2**15, 32).astype(np.int16)
        acc2 = rng.integers(-2**20, 2**20, 16).astype(np.int32)
        out4, out2 = acc4.copy().view(np.uint8), acc2.copy().view(np.uint8)
        _dots(u, s.view(np.uint8), x.view(np.uint8), y.view(np.uint8), out4, out2)
        want4 = acc4 + (u.astype(np.int64) * s).reshape(16, 4).sum(1)
        want2 = acc2 + (np.tile(x, 16).astype(np.int64) * y).reshape(16, 2).sum(1)
        assert np.array_equal(out4.view(np.int32), want4)
        assert np.array_equal(out2.view(np.int32), want2)

