"""Tests of ggml_lite.ops: op ids, what each constructor records, shape rules, errors, no data touched.

Expected values come from real ggml 0.15.3 (ggml-python 0.0.45) through tests/data/graph_ref.json,
written by tests/ggml_ref/graph_ref.py from the calls in tests/ggml_ref/graph_scenarios.py (see
tests/test_graph.py). The tests do not need ggml-python.
"""
import inspect
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ggml_lite as ggml
from ggml_lite import GGMLError, GluOp, Op, Type, UnaryOp

sys.path.insert(0, str(Path(__file__).parent / "ggml_ref"))
import graph_scenarios as scenarios  # noqa: E402
from graph_lite import Lite, describe  # noqa: E402

REF = json.loads((Path(__file__).parent / "data" / "graph_ref.json").read_text())
G = Lite()
F32, F16, I32 = Type.F32, Type.F16, Type.I32


# --- ids and names ---------------------------------------------------------------------------------

def test_op_ids_names_symbols_match_ggml():
    assert Op.COUNT == len(REF["op_names"]) == 97                 # ggml 0.15.3: GGML_OP_COUNT
    for i, (name, symbol) in enumerate(zip(REF["op_names"], REF["op_symbols"])):
        assert Op(i).name == name == ggml.op_name(i)
        assert ggml.op_symbol(i) == symbol
    assert [UnaryOp(i).name for i in range(UnaryOp.COUNT)] == REF["unary_op_names"]
    assert [GluOp(i).name for i in range(GluOp.COUNT)] == REF["glu_op_names"]
    # the four ids the tensor chapter wrote as plain integers
    assert (Op.RESHAPE, Op.VIEW, Op.PERMUTE, Op.TRANSPOSE) == (36, 37, 38, 39)


def test_op_desc_and_family_getters():
    ctx = ggml.init(1 << 16, no_alloc=True)
    a = ggml.new_tensor_2d(ctx, F32, 8, 2)
    assert ggml.op_desc(ggml.silu(ctx, a)) == "SILU"
    assert ggml.op_desc(ggml.swiglu(ctx, a)) == "SWIGLU"
    assert ggml.op_desc(ggml.add(ctx, a, a)) == "ADD"
    assert ggml.get_unary_op(ggml.gelu(ctx, a)) is UnaryOp.GELU
    assert ggml.get_glu_op(ggml.geglu_split(ctx, a, a)) is GluOp.GEGLU
    with pytest.raises(GGMLError, match="has op ADD"):
        ggml.get_unary_op(ggml.add(ctx, a, a))
    with pytest.raises(GGMLError, match="has op SCALE"):
        ggml.get_glu_op(ggml.scale(ctx, a, 2.0))


# --- every recorded op against ggml ------------------------------------------------------------------

def _op_tensors():
    """(scenario, index) of every tensor with an op in the zoo and attention scenarios."""
    out = []
    for name in ("zoo", "attention", "select"):
        for i, t in enumerate(REF["scenarios"][name]["tensors"]):
            if t["op"] != 0:
                out.append(pytest.param(name, i, id=f"{name}-{i}-{REF['op_names'][t['op']]}"))
    return out


@pytest.fixture(scope="module")
def built():
    out = {}
    for name in ("zoo", "attention", "select"):
        ctx, graphs = scenarios.SCENARIOS[name](G)
        out[name] = describe(ctx, graphs)["tensors"]
        ggml.free(ctx)
    return out


@pytest.mark.parametrize("scenario,i", _op_tensors())
def test_recorded_op_matches_ggml(built, scenario, i):
    """type, shape, strides, op, op_params (all 16 words), sources, view, name and pool offsets."""
    mine, ref = built[scenario][i], REF["scenarios"][scenario]["tensors"][i]
    assert mine == ref, ", ".join(f"{k}: {mine[k]} != ggml's {ref[k]}" for k in ref if mine[k] != ref[k])


def test_every_constructor_is_covered_by_the_ggml_scenarios():
    """Each op constructor the ggml comparison exercises appears in the scenarios' source."""
    src = inspect.getsource(scenarios)
    compared = {"add", "add_inplace", "sub", "sub_inplace", "mul", "mul_inplace", "div", "div_inplace",
                "scale", "scale_inplace", "mul_mat", "get_rows", "rms_norm", "rms_norm_inplace", "norm",
                "soft_max", "soft_max_inplace", "soft_max_ext", "rope", "rope_inplace", "rope_ext",
                "cpy", "cont", "cont_1d", "cont_2d", "cont_3d", "cont_4d", "silu", "silu_inplace",
                "gelu", "gelu_inplace", "diag_mask_inf", "diag_mask_inf_inplace", "concat", "sum",
                "sum_rows", "mean", "repeat", "swiglu_split"}
    for name in compared:
        assert f"G.{name}(" in src, name
        assert callable(getattr(ggml, name))


def test_op_params_layouts_literal():
    """A few words spelled out (ggml: graph_ref.json, scenario "zoo")."""
    ctx, _ = scenarios.zoo(G)
    by_op = {}
    for t in ctx:
        by_op.setdefault(t.op, []).append(t)
    rope_neox = by_op[Op.ROPE][0]
    assert [ggml.tensor.get_op_params_i32(rope_neox, i) for i in (0, 1, 2, 3, 4)] == [0, 8, 2, 0, 2048]
    assert [ggml.tensor.get_op_params_f32(rope_neox, i) for i in range(5, 11)] == [500000.0, 0.25, 1.0, 1.0, 32.0, 1.0]
    assert list(rope_neox.op_params[11:]) == [0] * 5
    sm = by_op[Op.SOFT_MAX][-1]                                 # soft_max_ext(.., 0.5, 8.0)
    assert list(sm.op_params[:2]) == [1056964608, 1090519040]   # ggml: the float bits of 0.5, 8.0
    assert ggml.tensor.get_op_params_f32(by_op[Op.SCALE][0], 0) == 0.125
    assert ggml.tensor.get_op_params_f32(by_op[Op.RMS_NORM][0], 0) == np.float32(1e-5)
    assert [ggml.tensor.get_op_params_i32(t, 0) for t in by_op[Op.DIAG_MASK_INF]] == [2, 0]
    assert [ggml.tensor.get_op_params_i32(t, 0) for t in by_op[Op.CONCAT]] == [1, 2]
    assert [ggml.tensor.get_op_params_i32(t, 0) for t in by_op[Op.UNARY]] == [8, 10, 10, 8]   # GELU SILU SILU GELU
    assert list(by_op[Op.GLU][0].op_params[:2]) == [2, 0]      # SWIGLU, not swapped
    ggml.free(ctx)


# --- semantics spot checks -----------------------------------------------------------------------------

def test_inplace_results_are_views_of_a():
    ctx = ggml.init(1 << 20)
    a = ggml.set_name(ggml.new_tensor_3d(ctx, F32, 8, 4, 2), "a")
    b = ggml.new_tensor_1d(ctx, F32, 8)
    pos = ggml.new_tensor_1d(ctx, I32, 2)
    made = [ggml.add_inplace(ctx, a, b), ggml.sub_inplace(ctx, a, b), ggml.mul_inplace(ctx, a, b),
            ggml.div_inplace(ctx, a, b), ggml.scale_inplace(ctx, a, 2.0),
            ggml.scale_bias_inplace(ctx, a, 2.0, 1.0), ggml.norm_inplace(ctx, a, 1e-5),
            ggml.rms_norm_inplace(ctx, a, 1e-5), ggml.soft_max_inplace(ctx, a),
            ggml.soft_max_ext_inplace(ctx, a, None, 1.0, 0.0), ggml.diag_mask_inf_inplace(ctx, a, 0),
            ggml.rope_inplace(ctx, a, pos, 8, 0),
            ggml.rope_ext_inplace(ctx, a, pos, None, 8, 0, 0, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0),
            ggml.silu_inplace(ctx, a), ggml.gelu_inplace(ctx, a), ggml.unary_inplace(ctx, a, UnaryOp.NEG),
            ggml.dup_inplace(ctx, a)]
    for t in made:
        assert t.view_src is a and t.data == a.data and t.src[0] is a and t.name == "a (view)"
        assert t.ne == a.ne and t.nb == a.nb


def test_result_types_and_shapes():
    ctx = ggml.init(1 << 20, no_alloc=True)
    w4 = ggml.new_tensor_2d(ctx, Type.Q4_0, 64, 10)
    x = ggml.new_tensor_3d(ctx, F16, 64, 3, 2)
    mm = ggml.mul_mat(ctx, w4, x)
    assert mm.type == F32 and mm.ne == [10, 3, 2, 1] and mm.nb == [4, 40, 120, 240]
    ids = ggml.new_tensor_1d(ctx, I32, 4)
    assert ggml.get_rows(ctx, w4, ids).type == F32
    ia = ggml.new_tensor_2d(ctx, I32, 5, 10)
    assert ggml.get_rows(ctx, ia, ids).type == I32
    h = ggml.new_tensor_2d(ctx, F16, 6, 4)
    assert ggml.mean(ctx, h).type == F32 and ggml.sum_rows(ctx, h).type == F16
    assert ggml.sum(ctx, h).ne == [1, 1, 1, 1] and ggml.sum(ctx, h).type == F16
    assert ggml.swiglu(ctx, h).ne == [3, 4, 1, 1]
    c = ggml.cast(ctx, h, F32)
    assert c.type == F32 and c.src[1] is c and c.op == Op.CPY
    assert ggml.repeat_4d(ctx, ggml.new_tensor_1d(ctx, F32, 2), 4, 3, 2, 1).ne == [4, 3, 2, 1]
    assert ggml.concat(ctx, h, h, 0).ne == [12, 4, 1, 1]


def test_names_given_at_call_time():
    ctx = ggml.init(1 << 16, no_alloc=True)
    a = ggml.new_tensor_2d(ctx, F32, 4, 3)
    b = ggml.set_name(ggml.new_tensor_2d(ctx, F16, 4, 3), "dst")
    assert ggml.cpy(ctx, a, b).name == "dst (copy of )"
    assert ggml.cpy(ctx, a, ggml.new_tensor_2d(ctx, F16, 4, 3)).name == " (copy)"
    ggml.set_name(a, "a")
    assert ggml.cont(ctx, a).name == "a (cont)"
    assert ggml.cont_2d(ctx, a, 12, 1).name == "a (cont)"
    assert ggml.cast(ctx, a, F16).name == "a (copy)"
    assert ggml.add(ctx, a, a).name == ""              # named later, by the graph


def test_mul_mat_set_prec_and_sinks():
    ctx = ggml.init(1 << 16, no_alloc=True)
    a = ggml.new_tensor_2d(ctx, F32, 4, 3)
    mm = ggml.mul_mat(ctx, a, a)
    ggml.mul_mat_set_prec(mm, ggml.Prec.F32)
    assert ggml.tensor.get_op_params_i32(mm, 0) == 10
    with pytest.raises(GGMLError, match="mul_mat_set_prec"):
        ggml.mul_mat_set_prec(a, ggml.Prec.F32)
    kq = ggml.new_tensor_3d(ctx, F32, 8, 5, 4)
    sm = ggml.soft_max_ext(ctx, kq, None, 1.0, 0.0)
    sinks = ggml.new_tensor_1d(ctx, F32, 4)
    ggml.soft_max_add_sinks(sm, sinks)
    assert sm.src[2] is sinks
    with pytest.raises(GGMLError, match="sinks already set"):
        ggml.soft_max_add_sinks(sm, sinks)
    ggml.soft_max_add_sinks(sm, None)
    assert sm.src[2] is None
    with pytest.raises(GGMLError, match="4 heads but 3 sinks"):
        ggml.soft_max_add_sinks(sm, ggml.new_tensor_1d(ctx, F32, 3))


# --- nothing is computed ---------------------------------------------------------------------------------

def _every_constructor(c, a, b, w, idx, pos, m, sq, h16):
    """One call of every op constructor of ops.py (name -> result)."""
    return {
        "add": ggml.add(c, a, b), "add_inplace": ggml.add_inplace(c, a, b),
        "sub": ggml.sub(c, a, b), "sub_inplace": ggml.sub_inplace(c, a, b),
        "mul": ggml.mul(c, a, b), "mul_inplace": ggml.mul_inplace(c, a, b),
        "div": ggml.div(c, a, b), "div_inplace": ggml.div_inplace(c, a, b),
        "scale": ggml.scale(c, a, 2.0), "scale_inplace": ggml.scale_inplace(c, a, 2.0),
        "scale_bias": ggml.scale_bias(c, a, 2.0, 1.0),
        "scale_bias_inplace": ggml.scale_bias_inplace(c, a, 2.0, 1.0),
        "mul_mat": ggml.mul_mat(c, w, a), "get_rows": ggml.get_rows(c, a, idx),
        "norm": ggml.norm(c, a, 1e-5), "norm_inplace": ggml.norm_inplace(c, a, 1e-5),
        "rms_norm": ggml.rms_norm(c, a, 1e-5), "rms_norm_inplace": ggml.rms_norm_inplace(c, a, 1e-5),
        "soft_max": ggml.soft_max(c, a), "soft_max_inplace": ggml.soft_max_inplace(c, a),
        "soft_max_ext": ggml.soft_max_ext(c, a, m, 0.125, 0.0),
        "soft_max_ext_inplace": ggml.soft_max_ext_inplace(c, a, m, 0.125, 8.0),
        "diag_mask_inf": ggml.diag_mask_inf(c, a, 1), "diag_mask_inf_inplace": ggml.diag_mask_inf_inplace(c, a, 1),
        "rope": ggml.rope(c, a, pos, 8, 0), "rope_inplace": ggml.rope_inplace(c, a, pos, 8, 0),
        "rope_ext": ggml.rope_ext(c, a, pos, None, 8, 2, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0),
        "rope_ext_inplace": ggml.rope_ext_inplace(c, a, pos, None, 8, 2, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0),
        "rope_multi": ggml.rope_multi(c, sq, ggml.new_tensor_1d(c, I32, 16), None, 8, [2, 2, 0, 0],
                                      ggml.ROPE_TYPE_MROPE, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0),
        "dup": ggml.dup(c, a), "dup_inplace": ggml.dup_inplace(c, a),
        "cpy": ggml.cpy(c, a, h16), "cast": ggml.cast(c, a, F16), "cont": ggml.cont(c, ggml.transpose(c, a)),
        "cont_1d": ggml.cont_1d(c, a, 192), "cont_2d": ggml.cont_2d(c, a, 48, 4),
        "cont_3d": ggml.cont_3d(c, a, 8, 24, 1), "cont_4d": ggml.cont_4d(c, a, 2, 4, 6, 4),
        "unary": ggml.unary(c, a, UnaryOp.TANH), "unary_inplace": ggml.unary_inplace(c, a, UnaryOp.EXP),
        "silu": ggml.silu(c, a), "silu_inplace": ggml.silu_inplace(c, a), "gelu": ggml.gelu(c, a),
        "gelu_inplace": ggml.gelu_inplace(c, a), "gelu_erf": ggml.gelu_erf(c, a), "relu": ggml.relu(c, a),
        "glu": ggml.glu(c, a, GluOp.GEGLU, True), "glu_split": ggml.glu_split(c, a, a, GluOp.REGLU),
        "swiglu": ggml.swiglu(c, a), "swiglu_split": ggml.swiglu_split(c, a, a),
        "geglu_split": ggml.geglu_split(c, a, a),
        **{n: getattr(ggml, n)(c, a) for n in ("reglu", "reglu_swapped", "geglu", "geglu_swapped", "swiglu_swapped",
                                                "geglu_erf", "geglu_erf_swapped", "geglu_quick", "geglu_quick_swapped")},
        **{n: getattr(ggml, n)(c, a, a) for n in ("reglu_split", "geglu_erf_split", "geglu_quick_split")},
        "swiglu_oai": ggml.swiglu_oai(c, a, a, 1.702, 7.0),
        "sum": ggml.sum(c, a), "sum_rows": ggml.sum_rows(c, a), "mean": ggml.mean(c, a),
        "repeat": ggml.repeat(c, b, a), "repeat_4d": ggml.repeat_4d(c, b, 8, 6, 4, 2),
        "concat": ggml.concat(c, a, a, 2),
        "set_rows": ggml.set_rows(c, a, sq, ggml.new_tensor_1d(c, I32, 2)),
    }


def test_no_constructor_touches_data():
    pool = np.full(1 << 20, 0xA5, dtype=np.uint8)
    pool = pool[(-pool.ctypes.data) % 16:][: 1 << 19]
    c = ggml.init(len(pool), mem_buffer=pool)
    a = ggml.new_tensor_3d(c, F32, 8, 6, 4)
    b = ggml.new_tensor_1d(c, F32, 8)
    w = ggml.new_tensor_2d(c, F16, 8, 5)
    idx = ggml.new_tensor_2d(c, I32, 3, 4)
    pos = ggml.new_tensor_1d(c, I32, 4)
    m = ggml.new_tensor_2d(c, F32, 8, 6)
    sq = ggml.new_tensor_3d(c, F32, 8, 2, 4)
    h16 = ggml.new_tensor_3d(c, F16, 8, 6, 4)
    inputs = [a, b, w, idx, pos, m, sq, h16]
    for k, t in enumerate(inputs):
        t.numpy().view(np.uint8)[...] = 0x10 + k                   # sentinels
    made = _every_constructor(c, a, b, w, idx, pos, m, sq, h16)
    for k, t in enumerate(inputs):
        assert (t.numpy().view(np.uint8) == 0x10 + k).all(), f"input {k} was written"
    for name, t in made.items():
        if t.view_src is None:
            assert (t.numpy().view(np.uint8) == 0xA5).all(), f"{name} wrote its result"
    # every public constructor of ops.py and ops_copy.py is in the list
    constructors = {n for n in ggml.ops.__all__ + ggml.ops_copy.__all__
                    if inspect.isfunction(getattr(ggml.ops, n)) and "ctx" in inspect.signature(getattr(ggml.ops, n)).parameters}
    assert constructors == set(made)


# --- bad calls --------------------------------------------------------------------------------------

# (name in graph_scenarios.BAD_CALLS, text our message must contain besides ggml's assertion)
OPS_BAD_CALLS = [
    ("add_shape", ["add:", "b.ne=[3, 3, 1, 1]", "a.ne=[4, 3, 1, 1]"]),
    ("mul_mat_shape", ["mul_mat:", "a.ne=[4, 3, 1, 1]", "b.ne=[5, 3, 1, 1]"]),
    ("mul_mat_transposed", ["mul_mat:", "a.ne=[3, 4, 1, 1]", "nb=[16, 4, 48, 48]"]),
    ("get_rows_type", ["get_rows:", "f32"]),
    ("concat_shape", ["concat:", "a.ne=[4, 3, 1, 1]", "b.ne=[5, 3, 1, 1]", "dim 0"]),
    ("cpy_nelements", ["cpy:", "4 elements", "5"]),
    ("rope_positions", ["rope:", "a.ne=[8, 2, 3, 1]", "3 tokens", "4 positions"]),
    ("soft_max_mask", ["soft_max_ext:", "mask.ne=[8, 2, 1, 1]", "a.ne=[8, 3, 1, 1]"]),
]


def _run_bad(name):
    ctx = ggml.init(1 << 20)
    scope = {"G": G, "T": Type, "ctx": ctx}
    code = scenarios.BAD_CALLS[name]
    *setup, last = code.split("; ")
    exec("; ".join(setup), scope)                      # the operands
    before = ggml.used_mem(ctx)
    with pytest.raises(GGMLError) as e:
        exec(last, scope)
    return ctx, before, str(e.value)


@pytest.mark.parametrize("name,texts", OPS_BAD_CALLS, ids=[n for n, _ in OPS_BAD_CALLS])
def test_bad_call_raises_with_ggml_assertion_and_numbers(name, texts):
    ctx, before, msg = _run_bad(name)
    ggml_says = REF["bad_calls"][name]["stderr"][-1]                 # e.g. GGML_ASSERT(...) failed
    assert REF["bad_calls"][name]["returncode"] != 0                  # real ggml aborted
    assert ggml_says in msg
    for text in texts:
        assert text in msg
    assert ggml.used_mem(ctx) == before                              # nothing half-built
    x = ggml.new_tensor_2d(ctx, F32, 4, 3)                            # and the context works on
    assert ggml.add(ctx, x, x).op == Op.ADD


def test_tensor_chapter_bad_calls_from_ops_view():
    """Bad calls that fail in the tensor layer also leave the context usable (same numbers as ggml)."""
    ctx, before, msg = _run_bad("reshape_noncontiguous")
    assert "GGML_ASSERT(ggml_is_contiguous(a)) failed" in msg and ggml.used_mem(ctx) == before
    ctx, before, msg = _run_bad("view_out_of_bounds")
    assert "32 + 12 > 40" in msg and ggml.used_mem(ctx) == before
    ctx = ggml.init(1 << 20)
    scope = {"G": G, "T": Type, "ctx": ctx}
    with pytest.raises(GGMLError) as e:
        exec(scenarios.BAD_CALLS["pool_exhausted"], scope)
    ggml_says = REF["bad_calls"]["pool_exhausted"]["stderr"][0]       # the same needed/available bytes
    assert "new_tensor_1d: " + ggml_says.split("ggml_new_object: ")[1] == str(e.value)   # the call, not ggml_new_object


@pytest.mark.parametrize("make,text", [
    (lambda c, a: ggml.scale(c, ggml.transpose(c, a), 2.0), "ggml_is_padded_1d(a)"),
    (lambda c, a: ggml.soft_max(c, ggml.transpose(c, a)), "ggml_is_contiguous(a)"),
    (lambda c, a: ggml.soft_max_ext(c, a, None, 1.0, 8.0), "max_bias = 8.0 > 0 (ALiBi) needs a mask"),
    (lambda c, a: ggml.soft_max_ext(c, a, ggml.new_tensor_2d(c, I32, 8, 6), 1.0, 0.0), "the mask is i32"),
    (lambda c, a: ggml.rope(c, a, ggml.new_tensor_1d(c, I32, 6), 8, 1), "mode = 1"),
    (lambda c, a: ggml.rope(c, a, ggml.new_tensor_1d(c, F32, 6), 8, 0), "the positions are f32"),
    (lambda c, a: ggml.rope_ext(c, a, ggml.new_tensor_1d(c, I32, 1), ggml.new_tensor_1d(c, F32, 3),
                                8, 0, 0, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0), "3 frequency factors for n_dims = 8"),
    (lambda c, a: ggml.silu(c, ggml.transpose(c, a)), "silu: GGML_ASSERT(ggml_is_contiguous_rows(a))"),
    (lambda c, a: ggml.swiglu_split(c, a, ggml.new_tensor_2d(c, F32, 8, 5)), "a.ne=[8, 6, 1, 1], b.ne=[8, 5, 1, 1]"),
    (lambda c, a: ggml.swiglu_split(c, a, ggml.new_tensor_2d(c, F16, 8, 6)), "f32 and f16"),
    (lambda c, a: ggml.concat(c, a, a, 4), "dim = 4"),
    (lambda c, a: ggml.concat(c, a, ggml.new_tensor_2d(c, F16, 8, 6), 0), "f32 and f16"),
    (lambda c, a: ggml.repeat(c, a, ggml.new_tensor_2d(c, F32, 8, 4)), "a.ne=[8, 6, 1, 1] does not repeat into b.ne=[8, 4, 1, 1]"),
    (lambda c, a: ggml.repeat_4d(c, a, 8, 5, 1, 1), "[8, 5, 1, 1]"),
    (lambda c, a: ggml.get_rows(c, a, ggml.new_tensor_3d(c, I32, 2, 1, 2)), "a->ne[3] == b->ne[2]"),
    (lambda c, a: ggml.cont_3d(c, a, 7, 7, 1), "cont_3d:"),
])
def test_more_bad_calls(make, text):
    ctx = ggml.init(1 << 20)
    a = ggml.new_tensor_2d(ctx, F32, 8, 6)
    with pytest.raises(GGMLError) as e:
        make(ctx, a)
    assert text in str(e.value)
    assert ggml.add(ctx, a, a).ne == [8, 6, 1, 1]


# --- shape rules as properties ------------------------------------------------------------------------

dims = st.lists(st.integers(1, 6), min_size=4, max_size=4)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(a_ne=dims, b_ne=dims)
def test_binary_broadcast_rule(a_ne, b_ne):
    ctx = ggml.init(1 << 16, no_alloc=True)
    a = ggml.new_tensor_4d(ctx, F32, *a_ne)
    b = ggml.new_tensor_4d(ctx, F32, *b_ne)
    ok = all(x % y == 0 for x, y in zip(a_ne, b_ne))
    before = ggml.used_mem(ctx)
    for op in (ggml.add, ggml.sub, ggml.mul, ggml.div):
        if ok:
            r = op(ctx, a, b)
            assert r.ne == a_ne and r.type == F32 and r.src[:2] == [a, b] and r.view_src is None
        else:
            with pytest.raises(GGMLError, match="does not repeat into"):
                op(ctx, a, b)
            assert ggml.used_mem(ctx) == before


@settings(max_examples=150, deadline=None, derandomize=True)
@given(k=st.integers(1, 5), k2=st.integers(1, 5), m=st.integers(1, 5), n=st.integers(1, 5),
       a23=st.lists(st.integers(1, 4), min_size=2, max_size=2), b23=st.lists(st.integers(1, 4), min_size=2, max_size=2),
       transposed=st.booleans())
def test_mul_mat_rule(k, k2, m, n, a23, b23, transposed):
    ctx = ggml.init(1 << 16, no_alloc=True)
    a = ggml.new_tensor_4d(ctx, F16, k, m, *a23)
    if transposed:
        a = ggml.transpose(ctx, ggml.new_tensor_4d(ctx, F16, m, k, *a23))
    b = ggml.new_tensor_4d(ctx, F32, k2, n, *b23)
    shape_ok = k == k2 and b23[0] % a23[0] == 0 and b23[1] % a23[1] == 0
    is_t = a.nb[0] > a.nb[1]
    before = ggml.used_mem(ctx)
    if shape_ok and not is_t:
        r = ggml.mul_mat(ctx, a, b)
        assert r.ne == [m, n, *b23] and r.type == F32
    else:
        with pytest.raises(GGMLError, match="ggml_can_mul_mat" if not shape_ok else "transposed"):
            ggml.mul_mat(ctx, a, b)
        assert ggml.used_mem(ctx) == before


def test_float_params_are_float32():
    ctx = ggml.init(1 << 16, no_alloc=True)
    s = ggml.scale(ctx, ggml.new_tensor_1d(ctx, F32, 4), 0.1)
    assert s.op_params[0] == struct.unpack("<i", struct.pack("<f", 0.1))[0]
    assert ggml.tensor.get_op_params_f32(s, 0) == float(np.float32(0.1))


# --- every constructor's asserts, against real ggml (tests/data/asserts_ref.json) ---------------------

from asserts_scenarios import CASES as ASSERT_CASES, PRELUDE as ASSERT_PRELUDE  # noqa: E402

ASSERT_REF = json.loads((Path(__file__).parent / "data" / "asserts_ref.json").read_text())["cases"]


def _case_scope():
    ctx = ggml.init(1 << 20)
    scope = {"G": ggml, "T": Type, "ctx": ctx}
    exec(ASSERT_PRELUDE, scope)
    return ctx, scope


def _split_case(code):
    *setup, last = code.split("; ")
    return "; ".join(setup), last


def _descriptor(ctx, r):
    tensors = list(ctx)
    pos = {id(t): i for i, t in enumerate(tensors)}
    src = [pos[id(s)] if s is not None else None for s in r.src]
    while src and src[-1] is None:
        src.pop()
    return {"type": int(r.type), "op": int(r.op), "ne": list(r.ne), "nb": list(r.nb),
            "op_params": [int(w) for w in r.op_params], "src": src,
            "view_src": pos[id(r.view_src)] if r.view_src is not None else None,
            "view_offs": r.view_offs, "index": pos[id(r)], "used_mem": ggml.used_mem(ctx)}


def test_assert_cases_cover_every_constructor():
    assert set(ASSERT_REF) == set(ASSERT_CASES)
    assert all(ASSERT_REF[name]["code"] == code for name, code in ASSERT_CASES.items())
    called = {name for code in ASSERT_CASES.values() for name in
              __import__("re").findall(r"G\.(\w+)\(", _split_case(code)[1])}
    constructors = {n for n in ggml.ops.__all__ + ggml.ops_copy.__all__
                    if inspect.isfunction(getattr(ggml.ops, n))
                    and ("ctx" in inspect.signature(getattr(ggml.ops, n)).parameters
                         or n in ("mul_mat_set_prec", "soft_max_add_sinks"))}
    views = {"view_1d", "view_2d", "reshape", "reshape_1d", "reshape_2d", "reshape_3d", "reshape_4d",
             "permute", "transpose"}
    missing = (constructors | views) - called
    assert not missing, f"no good/bad call of {sorted(missing)} in asserts_scenarios.py"
    refused = [n for n, r in ASSERT_REF.items() if not r["ok"]]
    assert len(refused) >= 80 and len(ASSERT_REF) - len(refused) >= 60


@pytest.mark.parametrize("name", sorted(ASSERT_CASES))
def test_constructor_refuses_what_ggml_refuses(name):
    """ggml aborted (GGML_ASSERT, or SIGFPE on a zero divisor) <=> ggml_lite raises GGMLError naming
    the op and ggml's condition; nothing is added to the pool; a call ggml takes gives ggml's tensor."""
    ref = ASSERT_REF[name]
    ctx, scope = _case_scope()
    setup, last = _split_case(ASSERT_CASES[name])
    exec(setup, scope)
    before = ggml.used_mem(ctx)
    if ref["ok"]:
        exec(last, scope)
        assert _descriptor(ctx, scope["R"]) == ref["result"]
        return
    assert ref["returncode"] != 0
    with pytest.raises(GGMLError) as e:
        exec(last, scope)
    msg = str(e.value)
    op = __import__("re").findall(r"G\.(\w+)\(", last)[-1]
    assert msg.startswith(op + ":"), msg
    if ref["assert"]:                                  # ggml's own words (none for a SIGFPE)
        assert ref["assert"] in msg
    assert ggml.used_mem(ctx) == before
    assert ggml.add(ctx, ggml.new_tensor_1d(ctx, F32, 2), ggml.new_tensor_1d(ctx, F32, 1)).op == Op.ADD


@pytest.mark.parametrize("name", sorted(n for n in ASSERT_CASES if ASSERT_REF[n]["ok"]))
def test_constructor_refuses_an_operand_whose_memory_is_gone(name):
    """The good calls again, after ggml.reset: every operand is gone, so every constructor refuses,
    naming a tensor and why, and adds nothing to the (reset, still usable) context."""
    ctx, scope = _case_scope()
    setup, last = _split_case(ASSERT_CASES[name])
    exec(setup, scope)
    ggml.reset(ctx)
    with pytest.raises(GGMLError, match=r"tensor .* is gone: its context was reset \(ggml_reset\)"):
        exec(last, scope)
    assert ggml.used_mem(ctx) == 0


def test_enum_arguments_outside_ggml_enums_are_refused():
    ctx = ggml.init(1 << 16, no_alloc=True)
    a = ggml.new_tensor_2d(ctx, F32, 8, 6)
    for call, text in [(lambda: ggml.unary(ctx, a, 99), "unary: 99 is not a UnaryOp"),
                       (lambda: ggml.glu(ctx, a, 6, False), "glu: 6 is not a GluOp"),
                       (lambda: ggml.mul_mat_set_prec(ggml.mul_mat(ctx, a, a), 3), "3 is not a Prec")]:
        with pytest.raises(GGMLError, match=text):
            call()


# --- the GLU family of ggml.h, against real ggml (tests/data/glu_ctor_ref.json) -------------------

GLU_CTOR_REF = json.loads((Path(__file__).parent / "data" / "glu_ctor_ref.json").read_text())["constructors"]


@pytest.mark.parametrize("name", sorted(GLU_CTOR_REF))
def test_glu_constructor_records_what_ggml_records(name):
    ctx = ggml.init(1 << 20)
    if name.endswith("_split") or name == "swiglu_oai":
        a, b = (ggml.new_tensor_2d(ctx, Type.F32, 4, 3) for _ in range(2))
        args = (a, b, 1.702, 7.0) if name == "swiglu_oai" else (a, b)
    else:
        args = (ggml.new_tensor_2d(ctx, Type.F32, 8, 3),)
    r = getattr(ggml, name)(ctx, *args)
    want = GLU_CTOR_REF[name]
    assert (int(r.op), list(r.ne)) == (want["op"], want["ne"])
    assert [int(w) & 0xFFFFFFFF for w in r.op_params[:4]] == want["op_params"]
    ggml.free(ctx)


def test_swiglu_oai_computes_ggmls_formula():
    rng = np.random.default_rng(7)
    ctx = ggml.init(1 << 20)
    a, b = (ggml.new_tensor_2d(ctx, Type.F32, 16, 3) for _ in range(2))
    x, y = (rng.uniform(-12, 12, (3, 16)).astype(np.float32) for _ in range(2))
    a.numpy()[...] = x
    b.numpy()[...] = y
    out = ggml.swiglu_oai(ctx, a, b, 1.702, 7.0)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, out)
    ggml.graph_compute_with_ctx(ctx, gf, 2)
    xc = np.minimum(x, np.float32(7.0))
    want = xc / (np.float32(1) + np.exp(np.float32(1.702) * -xc)) * (np.clip(y, -7, 7) + np.float32(1))
    got = out.numpy()
    assert np.sum((got - want) ** 2) / np.sum(want ** 2) < 1e-12
    ggml.free(ctx)


@pytest.mark.parametrize("call, name", [
    (lambda ctx, t, x: ggml.add(ctx, x, t), "add: argument a"),
    (lambda ctx, t, x: ggml.add(ctx, t, x), "add: argument b"),
    (lambda ctx, t, x: ggml.mul_mat(ctx, t, x), "mul_mat: argument b"),
    (lambda ctx, t, x: ggml.get_rows(ctx, t, x), "get_rows: argument b"),
    (lambda ctx, t, x: ggml.soft_max_ext(ctx, t, x, 1.0, 0.0), "soft_max_ext: argument mask"),
    (lambda ctx, t, x: ggml.silu(ctx, x), "silu: argument a"),
])
def test_a_numpy_array_where_a_tensor_belongs_is_named(call, name):
    ctx = ggml.init(1 << 16)
    t = ggml.new_tensor_2d(ctx, F32, 4, 3)
    used = ggml.used_mem(ctx)
    with pytest.raises(GGMLError, match=f"^{name} is a numpy.ndarray, not a ggml tensor"):
        call(ctx, t, np.zeros((3, 4), np.float32))
    assert ggml.used_mem(ctx) == used                      # nothing half-built


def test_pack_in_place_and_its_size_limit():
    """op_record.pack writes the words straight into op_params; a layout longer than
    GGML_MAX_OP_PARAMS is refused with set_op_params' error, op_params left as it was."""
    from ggml_lite.op_record import pack
    ctx = ggml.init(1 << 16, no_alloc=True)
    t = ggml.new_tensor_1d(ctx, Type.F32, 4)
    pack(t, "if", 7, 0.5)
    assert t.op_params.dtype == np.int32 and t.op_params.shape == (16,)
    assert list(t.op_params[:3]) == [7, struct.unpack("<i", struct.pack("<f", 0.5))[0], 0]
    with pytest.raises(GGMLError, match=r"set_op_params: 68 bytes > GGML_MAX_OP_PARAMS = 64"):
        pack(t, "17i", *range(17))
    assert list(t.op_params[:2]) == [7, 1056964608] and not t.op_params[2:].any()
