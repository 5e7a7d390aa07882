"""set_rows: ggml's shape rules and errors, the CPU kernel on every destination type, in a graph."""
import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite.backends.cpu.cpy import forward_set_rows
from ggml_lite.backends.cpu.table import cpu_supports_op
from ggml_lite.core import GGMLError
from ggml_lite.types import Type, blck_size, dequantize_rows, fp32_to_bf16_array, quantize_chunk

F32, I64, I32 = Type.F32, Type.I64, Type.I32


@pytest.fixture
def ctx():
    c = ggml.init(mem_size=1 << 20)
    yield c
    ggml.free(c)


def test_i64_is_ggmls_type():
    assert int(Type.I64) == 27 and ggml.type_size(Type.I64) == 8 and ggml.type_name(Type.I64) == "i64"


def test_set_rows_records_a_view_of_a(ctx):
    a = ggml.new_tensor_3d(ctx, Type.F16, 8, 16, 2)
    b = ggml.new_tensor_3d(ctx, F32, 8, 3, 2)
    c = ggml.new_tensor_1d(ctx, I64, 3)
    r = ggml.set_rows(ctx, a, b, c)
    assert r.op == ggml.Op.SET_ROWS and int(ggml.Op.SET_ROWS) == 42
    assert r.view_src is a and r.type == a.type and r.ne == a.ne and r.nb == a.nb
    assert r.src[0] is b and r.src[1] is c and r.src[2] is a


@pytest.mark.parametrize("bad, assertion", [
    (dict(a=(8, 16, 2, 1), b=(4, 3, 2, 1)), "a->ne[0] == b->ne[0]"),
    (dict(a=(8, 16, 2, 1), b=(8, 3, 1, 1)), "a->ne[2] == b->ne[2]"),
    (dict(a=(8, 16, 2, 2), b=(8, 3, 2, 1)), "a->ne[3] == b->ne[3]"),
    (dict(c=(2, 1, 1, 1)), "b->ne[1] == c->ne[0]"),
    (dict(a=(8, 16, 3, 1), b=(8, 3, 3, 1), c=(3, 2, 1, 1)), "b->ne[2] % c->ne[1] == 0"),
    (dict(a=(8, 16, 1, 3), b=(8, 3, 1, 3), c=(3, 1, 2, 1)), "b->ne[3] % c->ne[2] == 0"),
    (dict(c=(3, 1, 1, 2)), "c->ne[3] == 1"),
    (dict(bt=Type.F16), "b->type == GGML_TYPE_F32"),
    (dict(ct=Type.F32), "c->type == GGML_TYPE_I64"),
])
def test_set_rows_asserts(ctx, bad, assertion):
    a = ggml.new_tensor_4d(ctx, Type.F16, *bad.get("a", (8, 16, 2, 1)))
    b = ggml.new_tensor_4d(ctx, bad.get("bt", F32), *bad.get("b", (8, 3, 2, 1)))
    c = ggml.new_tensor_4d(ctx, bad.get("ct", I64), *bad.get("c", (3, 1, 1, 1)))
    with pytest.raises(GGMLError, match=assertion.replace("[", r"\[").replace("]", r"\]")):
        ggml.set_rows(ctx, a, b, c)


def test_set_rows_needs_dense_rows(ctx):
    a = ggml.new_tensor_2d(ctx, F32, 8, 16)
    b = ggml.new_tensor_2d(ctx, F32, 3, 8)
    c = ggml.new_tensor_1d(ctx, I32, 3)
    with pytest.raises(GGMLError, match="ggml_is_contiguous_rows"):
        ggml.set_rows(ctx, a, ggml.transpose(ctx, b), c)


def _values(t, d, n):
    if t == Type.F32:
        return d
    if t == Type.F16:
        return d.astype(np.float32)
    if t == Type.BF16:
        return (d.astype(np.uint32) << 16).view(np.float32)
    return dequantize_rows(t, d.reshape(-1, d.shape[-1]), n).reshape(d.shape[:3] + (n,))


def _store(t, x):
    if t == Type.F32:
        return x.copy()
    if t == Type.F16:
        return x.astype(np.float16)
    if t == Type.BF16:
        return fp32_to_bf16_array(x)
    return quantize_chunk(t, x.reshape(-1, x.shape[-1])).reshape(x.shape[:3] + (-1,))


TYPES = [Type.F32, Type.F16, Type.BF16, Type.Q4_0, Type.Q4_1, Type.Q8_0, Type.Q8_1, Type.Q4_K, Type.Q6_K, Type.Q8_K]


@pytest.mark.parametrize("t", TYPES, ids=lambda t: ggml.type_name(t))
@pytest.mark.parametrize("it", [np.int64, np.int32])
def test_kernel_every_destination(t, it):
    rng = np.random.default_rng(int(t))
    n = 16 if blck_size(t) == 1 else blck_size(t)
    rows = rng.uniform(-1, 1, (2, 3, 4, n)).astype(np.float32)          # ne2 = 3, ne3 = 2
    before = _store(t, rng.uniform(-1, 1, (2, 3, 7, n)).astype(np.float32))
    idx = np.array([[[[6, 0, 3, 1]]]], it)                                # broadcast over ne2, ne3
    for nth in (1, 2, 3):
        d = before.copy()
        for ith in range(nth):
            forward_set_rows(rows, idx, d, ith, nth, t)
        want = _values(t, _store(t, rows), n)
        got = _values(t, d, n)
        for i, cell in enumerate((6, 0, 3, 1)):
            if t == Type.F32:
                assert np.array_equal(got[:, :, cell], want[:, :, i])
            else:   # the CPU's Q8 quantizers round as x86 ggml does, the reference ones may differ by a step
                err = ((got[:, :, cell] - want[:, :, i]) ** 2).sum() / (want[:, :, i] ** 2).sum()
                assert err < 1e-4 if t in (Type.Q8_0, Type.Q8_1, Type.Q8_K) else err < 1e-7, err
        assert np.array_equal(d[:, :, [2, 4, 5]], before[:, :, [2, 4, 5]])


def test_kernel_q4_0_bytes_are_ggmls_reference():
    rng = np.random.default_rng(3)
    rows = rng.uniform(-1, 1, (1, 1, 2, 64)).astype(np.float32)
    d = np.zeros((1, 1, 5, 36), np.uint8)
    forward_set_rows(rows, np.array([[[[3, 1]]]], np.int64), d, dst_type=Type.Q4_0)
    assert np.array_equal(d[0, 0, [3, 1]], quantize_chunk(Type.Q4_0, rows[0, 0]))


@pytest.mark.parametrize("bad", [-1, 7, 1 << 40])
def test_index_out_of_range_writes_nothing(bad):
    rows = np.ones((1, 1, 3, 8), np.float32)
    d = np.zeros((1, 1, 7, 8), np.float32)
    guard = np.zeros((1, 1, 9, 8), np.float32)              # d with a row either side
    d = guard[:, :, 1:8]
    with pytest.raises(GGMLError, match=rf"row index {bad} at src1\[2, 0, 0\] is out of range \[0, 7\)"):
        forward_set_rows(rows, np.array([[[[1, 2, bad]]]], np.int64), d, 0, 1)
    assert not guard.any()


def test_cpu_supports_set_rows(ctx):
    a = ggml.new_tensor_2d(ctx, Type.Q4_0, 32, 4)
    b = ggml.new_tensor_2d(ctx, F32, 32, 2)
    assert cpu_supports_op(ggml.set_rows(ctx, a, b, ggml.new_tensor_1d(ctx, I64, 2)))
    assert cpu_supports_op(ggml.set_rows(ctx, a, b, ggml.new_tensor_1d(ctx, I32, 2)))
    a16 = ggml.new_tensor_2d(ctx, Type.I16, 32, 4)
    assert not cpu_supports_op(ggml.set_rows(ctx, a16, b, ggml.new_tensor_1d(ctx, I64, 2)))


@pytest.mark.parametrize("python_loop", [False, True])
def test_graph_writes_cells(python_loop):
    """A cache [8, 16] F16 written by set_rows in a graph, twice with other cells: one graph."""
    ctx = ggml.init(mem_size=1 << 22)
    cache = ggml.new_tensor_2d(ctx, Type.F16, 8, 16)
    cache.numpy()[:] = 0
    rows = ggml.new_tensor_2d(ctx, F32, 8, 2)
    idx = ggml.new_tensor_1d(ctx, I64, 2)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, ggml.set_rows(ctx, cache, rows, idx))
    for cells in ([3, 9], [15, 0]):
        rows.numpy()[:] = np.arange(16, dtype=np.float32).reshape(1, 1, 2, 8) + cells[0]
        idx.numpy()[:] = cells
        plan = ggml.graph_plan(gf, 2)
        plan.python_loop = python_loop
        assert ggml.graph_compute(gf, plan) == ggml.Status.SUCCESS
        got = cache.numpy()[0, 0].astype(np.float32)
        assert np.array_equal(got[cells], rows.numpy()[0, 0])
    assert np.count_nonzero(cache.numpy().reshape(16, 8).any(axis=1)) == 4
    idx.numpy()[:] = [1, 16]
    with pytest.raises(GGMLError, match="out of range"):
        ggml.graph_compute(gf, ggml.graph_plan(gf, 2))
    ggml.free(ctx)


def test_set_rows_through_rpc():
    """A ggml_lite RPC server computes SET_ROWS (op id 42 on the wire, 0.15.3's), and an index
    outside the destination is refused by its kernel before any row is written."""
    from rpc_helpers import LiteServer
    server = LiteServer(lifetime=120)
    try:
        backend = ggml.backend_rpc_init(server.endpoint, 0)
        ctx = ggml.init(mem_size=8 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
        cache = ggml.new_tensor_2d(ctx, Type.F16, 8, 16)
        rows = ggml.new_tensor_2d(ctx, F32, 8, 2)
        idx = ggml.new_tensor_1d(ctx, I64, 2)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, ggml.set_rows(ctx, cache, rows, idx))
        buf = ggml.backend_alloc_ctx_tensors(ctx, backend)
        ggml.backend_tensor_set(cache, np.zeros((16, 8), np.float16))
        ggml.backend_tensor_set(rows, np.arange(16, dtype=np.float32))
        ggml.backend_tensor_set(idx, np.array([5, 2], np.int64))
        assert ggml.backend_graph_compute(backend, gf) == ggml.Status.SUCCESS
        got = ggml.backend_tensor_get(cache).view(np.float16).reshape(16, 8).astype(np.float32)
        assert np.array_equal(got[[5, 2]], np.arange(16, dtype=np.float32).reshape(2, 8))
        assert np.count_nonzero(got.any(axis=1)) == 2
        ggml.backend_tensor_set(idx, np.array([3, 16], np.int64))
        try:                  # GRAPH_COMPUTE has no reply: the server's refusal shows at the next request
            ggml.backend_graph_compute(backend, gf)
            ggml.backend_tensor_get(cache)
            raised = False
        except GGMLError:
            raised = True
        import time
        for _ in range(50):
            if "out of range [0, 16)" in server.log():
                break
            time.sleep(0.1)
        assert "set_rows: row index 16 at src1[1, 0, 0] is out of range [0, 16)" in server.log(), server.log()
        assert raised and server.alive()                                # the connection closed, not the server
    finally:
        server.stop()
