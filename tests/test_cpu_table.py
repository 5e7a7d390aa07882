"""The CPU's kernel table (ggml_lite.backends.cpu.table.CPU_KERNELS) against every node of the
test-backend-ops cases (tests/backend_ops_cases.py) and a set of nodes it must refuse:

- supports_op true for every node of a case  <=>  the compute succeeds and matches the reference;
- a node it refuses  =>  graph_plan, graph_compute and graph_compute_with_ctx raise GGMLError
  naming that node, its op and its types, and no kernel ran: every tensor of the case, the
  output's sentinel bytes included, is byte-for-byte what it was.

The CPU device's supports_op (the backend chapter) answers from the same table.
"""
import numpy as np
import pytest

import backend_ops_cases as B
import ggml_lite as ggml
from ggml_lite import GGMLError, Op, Type
from ggml_lite.backends.cpu import table as T

CASES = B.make_test_cases()
CPU = ggml.backend_cpu_reg().get_device(0)


def _computed(built):
    return [n for n in built.gf.nodes if not ggml.backends.cpu.table.op_is_empty(n.op)]


# --- nodes the table must refuse (ggml computes some of them; ggml_lite's CPU does not) ---------

class _Refused(B.Case):
    """A graph of one computable node (scale) then the refused node built by make(b, x)."""

    def __init__(self, label, make):
        self.label, self.make, self.op = label, make, "REFUSED"

    def name(self):
        return f"REFUSED({self.label})"

    def build_graph(self, b):
        x = b.new_tensor(Type.F32, (64, 4, 2, 1), "x")
        self.first = ggml.scale(b.ctx, x, 2.0)
        return self.make(b, self.first)


def _build_refused(case):
    """The case's context, with a graph of its first node (the scale) and then the refused one."""
    built = B.build_case(case, extra_mem=1 << 20)
    built.gf = ggml.new_graph(built.ctx)
    ggml.build_forward_expand(built.gf, case.first)
    ggml.build_forward_expand(built.gf, built.out)
    return built


def _mrope(b, x):
    pos = b.new_tensor(Type.I32, (8,), "pos")
    return ggml.rope_multi(b.ctx, ggml.reshape_3d(b.ctx, x, 64, 4, 2), pos, None, 64, [16, 16, 0, 0], 8,
                           0, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0)


def _sinks(b, x):
    y = ggml.soft_max(b.ctx, x)
    ggml.soft_max_add_sinks(y, b.new_tensor(Type.F32, (2,), "sinks"))
    return y


def _xielu(b, x):
    y = ggml.unary(b.ctx, x, ggml.UnaryOp.SILU)
    ggml.tensor.set_op_params_i32(y, 0, int(ggml.UnaryOp.XIELU))         # a kind with no kernel here
    return y


def _out_prod(b, x):
    a, c = b.new_tensor(Type.F32, (16, 8), "a"), b.new_tensor(Type.F32, (12, 8), "c")
    t = ggml.new_tensor_4d(b.ctx, Type.F32, 16, 12, 1, 1)
    t.op, t.src[0], t.src[1] = Op.OUT_PROD, a, c
    return ggml.add(b.ctx, t, t)


REFUSED = [
    _Refused("cpy F32 to I32", lambda b, x: ggml.cpy(b.ctx, x, b.new_tensor(Type.I32, (64, 4, 2, 1), "d"))),
    _Refused("cpy Q4_0 to Q8_0", lambda b, x: ggml.cpy(
        b.ctx, ggml.cpy(b.ctx, x, b.new_tensor(Type.Q4_0, (64, 4, 2, 1), "q")),
        b.new_tensor(Type.Q8_0, (64, 4, 2, 1), "d"))),
    _Refused("cpy I32 to I32", lambda b, x: ggml.cpy(b.ctx, b.new_tensor(Type.I32, (8, 2), "i"),
                                                   b.new_tensor(Type.I32, (8, 2), "d"))),
    _Refused("add Q4_0 + F32", lambda b, x: ggml.add(b.ctx, b.new_tensor(Type.Q4_0, (64, 4, 2, 1), "q"), x)),
    _Refused("mul_mat Q8_1 weights", lambda b, x: ggml.mul_mat(b.ctx, b.new_tensor(Type.Q8_1, (64, 3), "w"), x)),
    _Refused("mul_mat F16 activations for Q4_0", lambda b, x: ggml.mul_mat(
        b.ctx, b.new_tensor(Type.Q4_0, (64, 3), "w"), b.new_tensor(Type.F16, (64, 5), "h"))),
    _Refused("mul_mat transposed src1", lambda b, x: ggml.mul_mat(
        b.ctx, b.new_tensor(Type.F32, (4, 3), "w"), ggml.transpose(b.ctx, b.new_tensor(Type.F32, (6, 4), "t")))),
    _Refused("rope_multi", _mrope),
    _Refused("soft_max with sinks", _sinks),
    _Refused("swiglu_oai F16", lambda b, x: ggml.glu(b.ctx, b.new_tensor(Type.F16, (64, 4), "h"),
                                                    ggml.GluOp.SWIGLU_OAI, False)),
    _Refused("scale F16", lambda b, x: ggml.scale(b.ctx, b.new_tensor(Type.F16, (64, 4), "h"), 2.0)),
    _Refused("rms_norm F16", lambda b, x: ggml.rms_norm(b.ctx, b.new_tensor(Type.F16, (64, 4), "h"), 1e-6)),
    _Refused("unary XIELU", _xielu),
    _Refused("sum_rows F16", lambda b, x: ggml.sum_rows(b.ctx, b.new_tensor(Type.F16, (64, 4), "h"))),
    _Refused("get_rows Q8_K", lambda b, x: ggml.get_rows(b.ctx, b.new_tensor(Type.Q8_K, (256, 4), "q"),
                                                       b.new_tensor(Type.I32, (2,), "i"))),
    _Refused("out_prod (no CPU kernel)", _out_prod),
]


def _snapshot(built):
    return [(t.name, B.read_raw(t).copy()) for t in built.ctx if t.view_src is None]


def _fill(built, rng):
    """Random inputs; every tensor without an input role (results, sentinels) set to 0xA5 bytes."""
    for t in built.ctx:
        if t.view_src is None:
            raw = B.read_raw(t)
            raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8) if t.op == Op.NONE else 0xA5
            B.write_raw(t, raw)


def _assert_refused_before_any_kernel(built, run):
    refused = next(n for n in _computed(built) if not ggml.backends.cpu.table.cpu_supports_op(n))
    before = _snapshot(built)
    with pytest.raises(GGMLError) as e:
        run()
    msg = str(e.value)
    assert f"'{refused.name}'" in msg and f"({ggml.op_desc(refused)})" in msg, msg
    assert ggml.type_name(refused.type) in msg and T.cpu_unsupported_reason(refused) in msg, msg
    for (name, raw), (_, now) in zip(before, _snapshot(built)):
        assert np.array_equal(raw, now), f"'{name}' was written: a kernel ran"


@pytest.mark.parametrize("case", CASES, ids=[c.name() for c in CASES])
def test_claim_equals_compute(case):
    """Every test-backend-ops case: each node is claimed (by the table and by the CPU device),
    and the compute then matches the reference with all four threads sharing every node."""
    built = B.build_case(case)
    try:
        for node in _computed(built):
            why = T.cpu_unsupported_reason(node)
            assert why is None, f"{case.name()}: '{node.name}' ({ggml.op_desc(node)}) refused: {why}"
            assert T.cpu_kernel(node) is ggml.backends.cpu.table.CPU_KERNELS[T.cpu_kernel_key(node)]
            assert ggml.backend_dev_supports_op(CPU, node)
        verdict = B.eval_built(built, B.cpu_compute(4))
        assert verdict.ok, f"{case.name()}: {verdict}"
    finally:
        B.free_built(built)


@pytest.mark.parametrize("case", REFUSED, ids=[c.name() for c in REFUSED])
@pytest.mark.parametrize("how", ["graph_plan", "graph_compute", "graph_compute_with_ctx"])
def test_refusal_comes_before_any_kernel(case, how):
    built = _build_refused(case)
    try:
        _fill(built, np.random.default_rng(0))
        bad = [n for n in _computed(built) if not ggml.backends.cpu.table.cpu_supports_op(n)]
        assert bad and all(not ggml.backend_dev_supports_op(CPU, n) for n in bad)
        assert ggml.backends.cpu.table.cpu_supports_op(_computed(built)[0])             # the scale before it is fine
        if how == "graph_plan":
            _assert_refused_before_any_kernel(built, lambda: ggml.graph_plan(built.gf, 2))
        elif how == "graph_compute":
            ok = ggml.new_graph(built.ctx)                             # a plan made for another graph
            plan = ggml.graph_plan(ok, 2)
            plan.work_data = np.zeros(1 << 16, np.uint8)
            _assert_refused_before_any_kernel(built, lambda: ggml.graph_compute(built.gf, plan))
        else:
            used = ggml.used_mem(built.ctx)
            _assert_refused_before_any_kernel(built, lambda: ggml.graph_compute_with_ctx(built.ctx, built.gf, 2))
            assert ggml.used_mem(built.ctx) == used                   # no work buffer taken either
    finally:
        B.free_built(built)


def test_every_row_of_the_table_is_exercised():
    """The cases reach every row: each op and kind of CPU_KERNELS computes in some case."""
    seen = set()
    for case in CASES:
        built = B.build_case(case, sentinels=False)
        try:
            seen |= {T.cpu_kernel_key(n) for n in _computed(built)}
        finally:
            B.free_built(built)
    missing = set(ggml.backends.cpu.table.CPU_KERNELS) - seen
    assert missing == {Op.DUP}, missing           # ggml_dup: no test-backend-ops case; below
    ctx = ggml.init(mem_size=1 << 20)
    a = ggml.new_tensor_2d(ctx, Type.F16, 8, 3)
    a.numpy()[...] = np.arange(24).reshape(1, 1, 3, 8)
    d = ggml.dup(ctx, a)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, d)
    assert ggml.backends.cpu.table.cpu_supports_op(d) and ggml.graph_compute_with_ctx(ctx, gf, 2) == ggml.Status.SUCCESS
    assert np.array_equal(d.numpy(), a.numpy())


def test_one_view_unary_and_glu_set():
    """The view-op, unary and GLU sets exist once, and the table and the backends read them."""
    from ggml_lite.backends import blas
    from ggml_lite.backends.cpu import compute as C
    from ggml_lite.backends.cpu import unary_ops as U
    assert ggml.backends.cpu.table.VIEW_OPS == {Op.NONE, Op.RESHAPE, Op.VIEW, Op.PERMUTE, Op.TRANSPOSE}
    assert blas.VIEW_OPS is T.VIEW_OPS
    assert {k for op, k in (key for key in ggml.backends.cpu.table.CPU_KERNELS if isinstance(key, tuple)) if op == Op.UNARY} == U.UNARY_OPS
    assert {k for op, k in (key for key in ggml.backends.cpu.table.CPU_KERNELS if isinstance(key, tuple)) if op == Op.GLU} == U.GLU_OPS
    assert U.GLU_OPS == {g for g in ggml.GluOp if g != ggml.GluOp.COUNT}
    for name in ("_CPU_OPS", "_CPU_UNARY", "_CPU_GLU", "_NO_COMPUTE", "_UNARY", "_ALL_THREADS"):
        for mod in (T, C, blas, __import__("ggml_lite.backends.cpu.backend", fromlist=["x"])):
            assert not hasattr(mod, name), (mod.__name__, name)


@pytest.mark.parametrize("n_threads", [1, 3])
def test_n_tasks_and_work_size_come_from_the_table(n_threads):
    """get_n_tasks and graph_plan's work size are the rows' functions (ggml's numbers)."""
    ctx = ggml.init(mem_size=1 << 22)
    x = ggml.new_tensor_2d(ctx, Type.F32, 256, 5)
    nodes = [ggml.sub(ctx, x, x), ggml.get_rows(ctx, x, ggml.new_tensor_1d(ctx, Type.I32, 2)),
             ggml.soft_max(ctx, x), ggml.cpy(ctx, x, ggml.new_tensor_2d(ctx, Type.Q8_0, 256, 5)),
             ggml.cpy(ctx, x, ggml.new_tensor_2d(ctx, Type.F16, 256, 5)),
             ggml.mul_mat(ctx, ggml.new_tensor_2d(ctx, Type.Q4_0, 256, 4), x)]
    want_tasks = [1, 1, min(n_threads, 5), n_threads, n_threads, n_threads]
    want_work = [0, 0, 4 * 256 * min(n_threads, 5), 4 * 256 * n_threads, 0, ggml.row_size(Type.Q8_0, 256 * 5)]
    for node, tasks, work in zip(nodes, want_tasks, want_work):
        row = T.cpu_kernel(node)
        assert ggml.backends.cpu.compute.get_n_tasks(node, n_threads) == row.n_tasks(node, n_threads) == tasks
        assert row.work_size(node, tasks) == work
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, node)
        plan = ggml.graph_plan(gf, n_threads)
        assert plan.work_size == (work + ggml.backends.cpu.table.CACHE_LINE_SIZE * n_threads if work else 0)


@pytest.mark.parametrize("wtype,xtype", [(Type.F32, Type.F32), (Type.F16, Type.F16), (Type.F16, Type.F32),
                                         (Type.BF16, Type.BF16), (Type.Q4_0, Type.F32), (Type.Q4_K, Type.F32),
                                         (Type.Q4_0, Type.Q8_0), (Type.Q4_K, Type.Q8_K), (Type.F32, Type.F16),
                                         (Type.Q8_0, Type.F16), (Type.Q5_0, Type.F32), (Type.Q5_1, Type.F32),
                                         (Type.Q2_K, Type.F32), (Type.Q3_K, Type.F32), (Type.Q5_K, Type.F32),
                                         (Type.Q5_0, Type.Q8_0), (Type.Q5_1, Type.Q8_1), (Type.Q5_K, Type.Q8_K)])
def test_mul_mat_claims_every_pair_it_computes(wtype, xtype):
    """mul_mat's row: claimed pairs compute the product of the stored values; the others (activations
    already quantized, F16 activations for F32 or quantized weights) are refused before any kernel."""
    rng = np.random.default_rng(3)
    ctx = ggml.init(mem_size=8 << 20)
    K, M, N = 256, 8, 6
    w, x = ggml.new_tensor_2d(ctx, wtype, K, M), ggml.new_tensor_2d(ctx, xtype, K, N)
    vals = {}
    for t, rows in ((w, M), (x, N)):
        f = rng.uniform(-1, 1, (rows, K)).astype(np.float32)
        if ggml.is_quantized(t.type):
            q = ggml.quantize_chunk(t.type, f)
            t.numpy()[0, 0] = q
            vals[id(t)] = ggml.types.dequantize_rows(t.type, q, K)
        else:
            B.write_raw(t, {Type.F32: f, Type.F16: f.astype(np.float16)}.get(t.type, B.bf16_bits(f)))
            vals[id(t)] = B.tensor_values(t)[0, 0]
    y = ggml.mul_mat(ctx, w, x)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    claimed = ggml.backends.cpu.table.cpu_supports_op(y)
    assert claimed == (xtype == Type.F32 or xtype == wtype and not ggml.is_quantized(xtype))
    if not claimed:
        y.numpy()[...] = 7.0
        with pytest.raises(GGMLError, match="MUL_MAT"):
            ggml.graph_compute_with_ctx(ctx, gf, 2)
        assert (y.numpy() == 7.0).all()
        return
    assert ggml.graph_compute_with_ctx(ctx, gf, 2) == ggml.Status.SUCCESS
    ref = vals[id(x)].astype(np.float64) @ vals[id(w)].astype(np.float64).T
    assert B.nmse(y.numpy()[0, 0], ref) < 5e-4


NEW_QTYPES = (Type.Q5_0, Type.Q5_1, Type.Q2_K, Type.Q3_K, Type.Q5_K)


@pytest.mark.parametrize("t", NEW_QTYPES)
def test_new_types_get_rows_cpy_set_rows_are_claimed_and_computed(t):
    """get_rows of t, cpy F32 -> t and t -> F32, and set_rows into t: each claimed by the table and
    computed by a graph to what the types chapter's quantizer and dequantizer give."""
    rng = np.random.default_rng(int(t))
    K, R = 256, 6
    f = rng.uniform(-1, 1, (R, K)).astype(np.float32)
    q = ggml.quantize_chunk(t, f)
    deq = ggml.types.dequantize_rows(t, q, K)
    ctx = ggml.init(mem_size=4 << 20)
    w, x = ggml.new_tensor_2d(ctx, t, K, R), ggml.new_tensor_2d(ctx, Type.F32, K, R)
    w.numpy()[0, 0] = q
    B.write_raw(x, f)
    idx = ggml.new_tensor_1d(ctx, Type.I32, 4)
    idx.numpy()[...] = [5, 0, 3, 3]
    dst_q = ggml.new_tensor_2d(ctx, t, K, R)
    rows = ggml.new_tensor_1d(ctx, Type.I64, R)
    rows.numpy()[...] = np.arange(R)[::-1]
    nodes = {"get_rows": ggml.get_rows(ctx, w, idx),
             "cpy to": ggml.cpy(ctx, x, ggml.new_tensor_2d(ctx, t, K, R)),
             "cpy from": ggml.cpy(ctx, w, ggml.new_tensor_2d(ctx, Type.F32, K, R)),
             "set_rows": ggml.set_rows(ctx, dst_q, x, rows)}
    gf = ggml.new_graph(ctx)
    for node in nodes.values():
        assert ggml.backends.cpu.table.cpu_supports_op(node), (node.op, T.cpu_unsupported_reason(node))
        ggml.build_forward_expand(gf, node)
    assert ggml.graph_compute_with_ctx(ctx, gf, 2) == ggml.Status.SUCCESS
    assert np.array_equal(nodes["get_rows"].numpy()[0, 0], deq[[5, 0, 3, 3]])
    assert np.array_equal(nodes["cpy to"].numpy()[0, 0], q)
    assert np.array_equal(nodes["cpy from"].numpy()[0, 0], deq)
    assert np.array_equal(nodes["set_rows"].numpy()[0, 0], q[::-1])


def test_a_kind_id_outside_ggmls_enum_is_refused_not_raised():
    """A UNARY or GLU node whose op_params[0] names no kind (a hostile or corrupt graph, e.g. from
    the RPC server) is answered False by supports_op and refused by compute with GGMLError."""
    ctx = ggml.init(1 << 20)
    a = ggml.new_tensor_2d(ctx, ggml.Type.F32, 4, 4)
    bad_unary, bad_glu = ggml.silu(ctx, a), ggml.swiglu(ctx, a)
    ggml.tensor.set_op_params_i32(bad_unary, 0, 99)
    ggml.tensor.set_op_params_i32(bad_glu, 0, 77)
    cpu = ggml.backend_cpu_init()
    for node, text in ((bad_unary, "UNARY of kind id 99"), (bad_glu, "GLU of kind id 77")):
        assert ggml.backend_supports_op(cpu, node) is False
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, node)
        with pytest.raises(ggml.GGMLError, match=text):
            ggml.graph_compute_with_ctx(ctx, gf, 1)
    ggml.free(ctx)
