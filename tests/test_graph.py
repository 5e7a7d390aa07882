"""Tests of ggml_lite.graph: the GRAPH object in the pool, build_forward_expand, the size limit, dumps.

Expected values come from real ggml 0.15.3 (ggml-python 0.0.45): tests/ggml_ref/graph_ref.py runs
the calls of tests/ggml_ref/graph_scenarios.py through ggml and stores what it computed in
tests/data/graph_ref.json; here the very same calls run through ggml_lite. Numbers written out
below as literals ("ggml:") were read off that file. The tests do not need ggml-python.
"""
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import ggml_lite as ggml
import ggml_lite.viz  # noqa: F401  (the pictures are not in the package face)
from ggml_lite import GGMLError, GraphFullError, Op, TensorFlag, Type

sys.path.insert(0, str(Path(__file__).parent / "ggml_ref"))
import graph_scenarios as scenarios  # noqa: E402
from graph_lite import Lite, describe  # noqa: E402

REF = json.loads((Path(__file__).parent / "data" / "graph_ref.json").read_text())
G = Lite()
F32 = Type.F32


@pytest.fixture(scope="module")
def lite():
    """Every scenario built with ggml_lite and described like graph_ref.py describes ggml's."""
    out = {}
    for name, build in scenarios.SCENARIOS.items():
        ctx, graphs = build(G)
        out[name] = describe(ctx, graphs)
        ggml.free(ctx)
    return out


SCENARIO_NAMES = list(scenarios.SCENARIOS)


def test_reference_is_ggml_0_15_3():
    assert REF["ggml_version"] == "0.15.3"
    assert set(REF["scenarios"]) == set(SCENARIO_NAMES)


# --- what a graph costs in the pool ------------------------------------------------------------

def test_graph_overhead():
    assert ggml.graph_overhead() == 82608 == REF["graph_overhead"]       # ggml: ggml_graph_overhead()
    assert ggml.tensor_overhead() == REF["tensor_overhead"] == 368


@pytest.mark.parametrize("size,grads,expected", REF["graph_overhead_custom"])
def test_graph_overhead_custom(size, grads, expected):
    assert ggml.graph_overhead_custom(size, grads) == expected


@pytest.mark.parametrize("n,expected", REF["hash_size"])
def test_hash_size(n, expected):
    assert ggml.graph.hash_size(n) == expected


def test_new_graph_is_one_pool_object():
    ctx = ggml.init(1 << 20, no_alloc=True)
    x = ggml.new_tensor_1d(ctx, F32, 3)
    g1 = ggml.new_graph(ctx)
    g2 = ggml.new_graph_custom(ctx, 10, True)
    assert g1.offs == 368 + 32                           # right after x's object
    assert g2.offs == g1.offs + ggml.graph_overhead()
    assert ggml.used_mem(ctx) == 368 + ggml.graph_overhead() + ggml.graph_overhead_custom(10, True)
    assert [t for t in ctx] == [x]                       # graphs are not tensors
    assert g2.grads == {} and g1.grads is None


def test_pool_too_small_for_the_graph():
    ctx = ggml.init(ggml.tensor_overhead() + ggml.graph_overhead_custom(64) - 16, no_alloc=True)
    ggml.new_tensor_1d(ctx, F32, 3)
    with pytest.raises(GGMLError) as e:
        ggml.new_graph_custom(ctx, 64)
    needed = 368 + ggml.graph_overhead_custom(64)
    assert f"(needed {needed}, available {needed - 16})" in str(e.value)
    assert ggml.used_mem(ctx) == 368                     # nothing half-made
    gf = ggml.new_graph_custom(ctx, 32)                  # a smaller one fits
    assert gf.size == 32


# --- every scenario against ggml -----------------------------------------------------------------

@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_used_mem_matches_ggml(lite, name):
    assert lite[name]["used_mem"] == REF["scenarios"][name]["used_mem"]
    assert lite[name]["mem_size"] == REF["scenarios"][name]["mem_size"]


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_every_tensor_matches_ggml(lite, name):
    mine, ref = lite[name]["tensors"], REF["scenarios"][name]["tensors"]
    assert len(mine) == len(ref)
    for i, (a, b) in enumerate(zip(mine, ref)):
        assert a == b, f"tensor {i} ({b['name']!r}): " + ", ".join(
            f"{k}: {a[k]} != ggml's {b[k]}" for k in b if a[k] != b[k])


@pytest.mark.parametrize("name", SCENARIO_NAMES)
@pytest.mark.parametrize("field", ["size", "n_nodes", "n_leafs", "nodes", "leafs", "use_counts", "offs"])
def test_graph_matches_ggml(lite, name, field):
    for gname, ref in REF["scenarios"][name]["graphs"].items():
        assert lite[name]["graphs"][gname][field] == ref[field], gname


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_graph_print_matches_ggml(lite, name):
    for gname, ref in REF["scenarios"][name]["graphs"].items():
        assert lite[name]["graphs"][gname]["print"] == ref["print"]


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_graph_dump_dot_matches_ggml(lite, name):
    for gname, ref in REF["scenarios"][name]["graphs"].items():
        assert lite[name]["graphs"][gname]["dot"] == ref["dot"]


# The attention block, spelled out (ggml: graph_ref.json, scenario "attention").
ATTENTION_NODE_OPS = [
    "GET_ROWS", "RMS_NORM", "MUL", "MUL_MAT", "RESHAPE", "ROPE", "VIEW", "CPY",          # K -> cache
    "MUL_MAT", "TRANSPOSE", "VIEW", "CPY",                                               # V -> cache
    "VIEW", "VIEW", "MUL_MAT", "RESHAPE", "ROPE", "PERMUTE", "MUL_MAT", "SOFT_MAX",      # attention
    "MUL_MAT", "PERMUTE", "CONT", "MUL_MAT", "ADD",
    "RMS_NORM", "MUL", "MUL_MAT", "MUL_MAT", "GLU", "MUL_MAT", "ADD",                    # FFN
    "RMS_NORM", "MUL", "MUL_MAT",                                                        # head
]
ATTENTION_LEAFS = [
    "attn_k.weight", "token_embd.weight", "inp_tokens", "attn_norm.weight", "inp_pos", "cache_k",
    "attn_v.weight", "cache_v", "output.weight", "ffn_down.weight", "ffn_gate.weight",
    "attn_output.weight", "attn_q.weight", "kq_mask", "ffn_norm.weight", "ffn_up.weight",
    "output_norm.weight",
]


def test_attention_block_literal_values():
    ctx, graphs = scenarios.attention(G, no_alloc=True)
    gf = graphs["gf"]
    assert [ggml.op_name(n.op) for n in gf.nodes] == ATTENTION_NODE_OPS
    assert [t.name for t in gf.leafs] == ATTENTION_LEAFS
    assert ggml.used_mem(ctx) == 101744                              # ggml (no_alloc)
    assert gf.nodes[7].name == "cache_k (view) (copy of )"           # ggml names it so
    assert gf.nodes[4].name == " (reshaped)" and gf.nodes[3].name == "node_3"
    kq = gf.nodes[18]
    assert kq.ne == [8, 5, 4, 1] and kq.nb == [4, 32, 160, 640]      # ggml
    assert gf.nodes[-1].name == "result_output" and gf.nodes[-1].flags == 18   # OUTPUT | COMPUTE
    ggml.free(ctx)
    ctx, graphs = scenarios.attention(G, no_alloc=False)
    assert ggml.used_mem(ctx) == 247888                              # ggml (with data)
    ggml.free(ctx)


def test_axb_literal_values():
    ctx, graphs = scenarios.axb(G)
    gf = graphs["gf"]
    assert [ggml.op_name(n.op) for n in gf.nodes] == ["MUL", "MUL", "ADD"]
    assert [n.name for n in gf.nodes] == ["node_0", "node_1", "node_2"]
    assert [t.name for t in gf.leafs] == ["a", "x", "leaf_2"]
    assert ggml.used_mem(ctx) == 84912                               # ggml
    ctx2, graphs2 = scenarios.axb(G, order=1)                        # RIGHT_TO_LEFT
    assert [t.name for t in graphs2["gf"].leafs] == ["leaf_0", "x", "a"]


def test_fits_exactly():
    ctx, _ = scenarios.fits_exactly(G)
    assert ggml.used_mem(ctx) == ggml.get_mem_size(ctx) == 3312      # ggml
    with pytest.raises(GGMLError, match=r"needed 3680, available 3312"):
        ggml.new_tensor_1d(ctx, F32, 1)


# --- the walk ------------------------------------------------------------------------------------

def _chain(ctx, n, x=None):
    x = x if x is not None else ggml.new_tensor_1d(ctx, F32, 4)
    y = x
    for _ in range(n):
        y = ggml.add(ctx, y, x)
    return x, y


def test_nothing_is_computed():
    """The llama block built in a pool pre-filled with 0xA5 writes no data byte; with sentinels in
    its leafs, a second graph over the same tensors leaves every byte as it was."""
    pool = np.full(1 << 20, 0xA5, dtype=np.uint8)
    pool = pool[(-pool.ctypes.data) % 16:][: 1 << 19]

    class Pooled(Lite):
        @staticmethod
        def init(mem_size, mem_buffer=None, no_alloc=False):
            return ggml.init(len(pool), mem_buffer=pool)

    ctx, graphs = scenarios.attention(Pooled())
    gf = graphs["gf"]
    fresh = [t for t in gf.leafs + gf.nodes if t.view_src is None]
    assert len(fresh) == 17 + 24           # 11 of the 35 nodes are views
    for t in fresh:
        assert (t.numpy().view(np.uint8) == 0xA5).all(), t.name
    for k, leaf in enumerate(gf.leafs):
        leaf.numpy().view(np.uint8)[...] = k + 1
    gf2 = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf2, gf.nodes[-1])
    for k, leaf in enumerate(gf.leafs):
        assert (leaf.numpy().view(np.uint8) == k + 1).all(), leaf.name
    for node in gf.nodes:
        if node.view_src is None:
            assert (node.numpy().view(np.uint8) == 0xA5).all(), node.name


def test_shared_subexpressions_appear_once():
    ctx = ggml.init(1 << 20, no_alloc=True)
    x = ggml.new_tensor_1d(ctx, F32, 4)
    s = ggml.mul(ctx, x, x)
    out = ggml.add(ctx, ggml.add(ctx, s, s), s)
    gf = ggml.new_graph_custom(ctx, 8)
    ggml.build_forward_expand(gf, out)
    assert gf.n_nodes == 3 and gf.n_leafs == 1
    assert gf.use_counts[id(s)] == 3 and gf.use_counts[id(x)] == 2
    ggml.build_forward_expand(gf, out)                 # again: nothing new
    ggml.build_forward_expand(gf, s)
    assert gf.n_nodes == 3
    assert [ggml.graph.node_get_use_count(gf, i) for i in range(3)] == [3, 1, 0]


def test_compute_flag_and_param_leaf():
    ctx = ggml.init(1 << 20, no_alloc=True)
    w = ggml.new_tensor_2d(ctx, F32, 4, 4)
    ggml.set_param(w)
    x = ggml.new_tensor_1d(ctx, F32, 4)
    y = ggml.mul_mat(ctx, w, x)
    gf = ggml.new_graph_custom(ctx, 4)
    ggml.build_forward_expand(gf, y)
    assert gf.nodes == [w, y] and gf.leafs == [x]     # a parameter is a node, not a leaf
    assert w.name == "node_0" and x.name == "leaf_0"
    assert not w.flags & TensorFlag.COMPUTE           # op NONE: never computed
    assert y.flags & TensorFlag.COMPUTE
    out = io.StringIO()
    ggml.graph_print(gf, file=out)
    assert " -   0: [     4,     4,     1]             NONE x" in out.getvalue()


def test_build_forward_select_flags():
    ctx, graphs = scenarios.select(G, then_expand=False)
    gf = graphs["gf"]
    flagged = [bool(n.flags & TensorFlag.COMPUTE) for n in gf.nodes]
    assert [ggml.op_desc(n) for n in gf.nodes] == ["SILU", "SCALE", "MUL", "GELU"]
    assert flagged == [False, True, False, False]     # ggml: only the selected branch
    with pytest.raises(GGMLError, match="idx = 3, n_tensors = 3"):
        ggml.build_forward_select(gf, gf.nodes, 3, 3)


def test_deep_chain_has_no_recursion_limit():
    n = 5000
    ctx = ggml.init(n * 400 + ggml.graph_overhead_custom(n + 1) + 4096, no_alloc=True)
    x, y = _chain(ctx, n)
    gf = ggml.new_graph_custom(ctx, n + 1)
    ggml.build_forward_expand(gf, y)
    assert gf.n_nodes == n and gf.n_leafs == 1
    assert gf.nodes[0].src[0] is x and ggml.graph_node(gf, -1) is y
    assert all(gf.nodes[i].src[0] is gf.nodes[i - 1] for i in range(1, n))


# --- the size limit --------------------------------------------------------------------------------

def test_graph_full_changes_nothing():
    ctx = ggml.init(1 << 20, no_alloc=True)
    x, y = _chain(ctx, 6)
    gf = ggml.new_graph_custom(ctx, 8)
    x2, z = _chain(ctx, 3)
    ggml.build_forward_expand(gf, z)                   # 3 nodes fit
    flags_before = [t.flags for t in ctx]
    names_before = [t.name for t in ctx]
    with pytest.raises(GraphFullError) as e:
        ggml.build_forward_expand(gf, y)
    msg = str(e.value)
    assert "graph is full: n_nodes >= size=8" in msg
    assert "GGML_ASSERT(cgraph->n_nodes < cgraph->size) failed" in msg   # ggml's assertion
    assert "holds 3" in msg and "needs 6 more" in msg and "size >= 9" in msg
    assert isinstance(e.value, GGMLError)
    assert gf.n_nodes == 3 and gf.n_leafs == 1
    assert [t.flags for t in ctx] == flags_before and [t.name for t in ctx] == names_before
    assert id(y) not in gf.visited_hash_set
    big = ggml.new_graph_custom(ctx, 9)               # the fix: a graph that is big enough
    ggml.build_forward_expand(big, z)
    ggml.build_forward_expand(big, y)
    assert big.n_nodes == 9


def test_leafs_have_the_same_limit():
    ctx = ggml.init(1 << 20, no_alloc=True)
    a, b, c = (ggml.new_tensor_1d(ctx, F32, 2) for _ in range(3))
    out = ggml.add(ctx, ggml.add(ctx, a, b), c)
    gf = ggml.new_graph_custom(ctx, 2)
    with pytest.raises(GraphFullError, match=r"n_leafs >= size=2 .*holds 0 .*needs 3 more"):
        ggml.build_forward_expand(gf, out)
    assert gf.n_nodes == 0 and gf.n_leafs == 0


def test_graph_full_bad_call_as_in_ggml():
    ctx = ggml.init(1 << 20)
    with pytest.raises(GraphFullError) as e:
        exec(scenarios.BAD_CALLS["graph_full"], {"G": G, "T": Type, "ctx": ctx})
    assert REF["bad_calls"]["graph_full"]["stderr"][-1] == "GGML_ASSERT(cgraph->n_nodes < cgraph->size) failed"
    assert "GGML_ASSERT(cgraph->n_nodes < cgraph->size) failed" in str(e.value)
    assert "size=4" in str(e.value) and "needs 5 more" in str(e.value)


# --- accessors ---------------------------------------------------------------------------------------

def test_graph_node_and_lookup():
    ctx = ggml.init(1 << 20, no_alloc=True)
    x, y = _chain(ctx, 3)
    ggml.set_name(x, "node_1")                          # a leaf with a node's name: leafs win
    gf = ggml.new_graph_custom(ctx, 8)
    ggml.build_forward_expand(gf, y)
    assert ggml.graph_n_nodes(gf) == 3 and ggml.graph_size(gf) == 8
    assert ggml.graph_node(gf, -1) is y and ggml.graph_node(gf, -3) is gf.nodes[0]
    assert ggml.graph_node(gf, 2) is y
    for bad, text in ((3, "i = 3, n_nodes = 3"), (-4, "i = -4, n_nodes = 3")):
        with pytest.raises(GGMLError, match=text):
            ggml.graph_node(gf, bad)
    assert ggml.graph_get_tensor(gf, "node_1") is x
    assert ggml.graph_get_tensor(gf, "node_2") is y
    assert ggml.graph_get_tensor(gf, "nope") is None
    assert ggml.graph_nodes(gf) is gf.nodes


def test_graph_view_cpy_dup_clear_add_node():
    ctx = ggml.init(1 << 20, no_alloc=True)
    x, y = _chain(ctx, 5)
    gf = ggml.new_graph_custom(ctx, 8)
    ggml.build_forward_expand(gf, y)
    v = ggml.graph.graph_view(gf, 1, 4)
    assert v.size == 0 and v.nodes == gf.nodes[1:4] and v.n_leafs == 0
    assert v.visited_hash_set is gf.visited_hash_set
    with pytest.raises(GraphFullError):
        ggml.build_forward_expand(v, ggml.add(ctx, y, x))
    d = ggml.graph_dup(ctx, gf)
    assert d.nodes == gf.nodes and d.leafs == gf.leafs and d.size == 8 and d is not gf
    assert d.use_counts == gf.use_counts and d.use_counts is not gf.use_counts
    with pytest.raises(GraphFullError, match="n_nodes 5 > 3"):
        ggml.graph_cpy(gf, ggml.new_graph_custom(ctx, 3))
    ggml.graph_clear(d)
    assert d.n_nodes == 0 and d.n_leafs == 0 and not d.visited_hash_set
    ggml.graph_add_node(d, y)                          # by hand: no walk, no flag
    assert d.nodes == [y]
    tiny = ggml.new_graph_custom(ctx, 0)
    with pytest.raises(GraphFullError, match="size=0"):
        ggml.graph_add_node(tiny, y)


def test_graph_dies_with_its_context():
    ctx = ggml.init(1 << 20, no_alloc=True)
    x, y = _chain(ctx, 2)
    gf = ggml.new_graph(ctx)
    ggml.reset(ctx)
    with pytest.raises(GGMLError, match=r"build_forward_expand: the graph is gone: its context was reset"):
        ggml.build_forward_expand(gf, y)
    owned = ggml.init(1 << 20)
    x, y = _chain(owned, 2)
    gf = ggml.new_graph(owned)
    ggml.build_forward_expand(gf, y)
    ggml.free(owned)
    with pytest.raises(GGMLError, match=r"graph_check_alive: the graph is gone: its context was freed "
                                        r"\(ggml_free\) together with the memory pool it owned"):
        ggml.graph.graph_check_alive(gf, "graph_check_alive")


def _callers_pool(nbytes):
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    return raw[(-raw.ctypes.data) % 64:][:nbytes]


def test_graph_in_callers_memory_outlives_free():
    """As examples/simple/simple-backend.cpp: build in a context over the caller's buffer, ggml_free, then use."""
    buf = _callers_pool(1 << 16)
    ctx = ggml.init(len(buf), mem_buffer=buf)
    x, y = _chain(ctx, 3)
    gf = ggml.new_graph_custom(ctx, 16)
    ggml.build_forward_expand(gf, y)
    ggml.set_f32(x, 1.5)
    ggml.free(ctx)
    ggml.graph.graph_check_alive(gf, "test")                          # no error: the memory is the caller's
    assert [n.op for n in ggml.graph_nodes(gf)] == [Op.ADD] * 3 and x.numpy().ravel().tolist() == [1.5] * 4
    other = ggml.init(1 << 16)                                   # the graph grows from a live context
    z = ggml.mul(other, y, x)
    ggml.build_forward_expand(gf, z)
    assert gf.n_nodes == 4 and ggml.graph_node(gf, -1) is z
    assert '"0x' in ggml.graph_dump_dot(gf, None, None)         # descriptors still have addresses
    with pytest.raises(GGMLError, match="no new object"):
        ggml.new_graph(ctx)


def test_build_refuses_a_dead_tensor_and_changes_nothing():
    dead = ggml.init(1 << 16)
    w = ggml.set_name(ggml.new_tensor_1d(dead, F32, 4), "w")
    live = ggml.init(1 << 16)
    x = ggml.new_tensor_1d(live, F32, 4)
    gf = ggml.new_graph_custom(live, 16)
    ggml.build_forward_expand(gf, ggml.add(live, x, x))
    y = ggml.mul(live, ggml.add(live, x, x), w)
    ggml.free(dead)
    with pytest.raises(GGMLError, match=r"build_forward_expand: tensor 'w' is gone: its context was freed"):
        ggml.build_forward_expand(gf, y)
    assert gf.n_nodes == 1 and gf.n_leafs == 1                   # the graph is as it was
    gf.nodes.append(y)                                           # a dead tensor smuggled in by hand
    with pytest.raises(GGMLError, match="'w' is gone"):
        ggml.graph.graph_check_alive(gf, "compute")


def test_a_numbered_graph_is_walked_once_and_still_refused_when_a_pool_goes():
    """graph_check_alive of a graph with a uid (the scheduler's) walks its tensors once per uid and
    then checks only their pools: freeing or resetting any of those pools is still caught, each time,
    and a new uid walks again."""
    weights, work = ggml.init(1 << 16), ggml.init(1 << 16)
    w = ggml.set_name(ggml.new_tensor_1d(weights, F32, 4), "w")
    v = ggml.set_name(ggml.view_1d(weights, w, 2, 0), "v")
    x = ggml.new_tensor_1d(work, F32, 4)
    gf = ggml.new_graph_custom(work, 16)
    ggml.build_forward_expand(gf, ggml.add(work, ggml.mul(work, x, w), x))
    gf.uid = ggml.graph.graph_next_uid()
    ggml.graph.graph_check_alive(gf, "compute")
    assert gf._alive_pools[0] == gf.uid and {c for c, _ in gf._alive_pools[1]} == {weights, work}
    gf.nodes[0].src[1] = v                       # unseen by the uid's cache: the pools still cover it
    ggml.reset(weights)
    with pytest.raises(GGMLError, match="compute: tensor 'w' is gone: its context was reset"):
        ggml.graph.graph_check_alive(gf, "compute")
    with pytest.raises(GGMLError, match="'w' is gone"):            # refused again, not remembered as fine
        ggml.graph.graph_check_alive(gf, "compute")
    other = ggml.init(1 << 16)
    u = ggml.set_name(ggml.new_tensor_1d(other, F32, 4), "u")
    g2 = ggml.new_graph_custom(work, 16)
    ggml.build_forward_expand(g2, ggml.add(work, x, x))
    g2.uid = ggml.graph.graph_next_uid()
    ggml.graph.graph_check_alive(g2, "compute")
    assert {c for c, _ in g2._alive_pools[1]} == {work}
    g2.nodes[0].src[1] = u                       # a pool the cache has not seen ...
    g2.uid = ggml.graph.graph_next_uid()         # ... is seen once the graph is numbered anew
    ggml.graph.graph_check_alive(g2, "compute")
    assert {c for c, _ in g2._alive_pools[1]} == {other, work}
    ggml.free(other)
    with pytest.raises(GGMLError, match="'u' is gone: its context was freed"):
        ggml.graph.graph_check_alive(g2, "compute")


def test_dump_dot_call_forms(tmp_path):
    ctx, graphs = scenarios.axb(G)
    gf = graphs["gf"]
    text = ggml.graph_dump_dot(gf, None, None)
    p1, p2 = tmp_path / "a.dot", tmp_path / "b.dot"
    assert ggml.graph_dump_dot(gf, None, str(p1)) == text == p1.read_text()
    assert ggml.graph_dump_dot(gf, p2) == text == p2.read_text()      # (gb, filename)
    assert text.startswith("digraph G {\n  newrank = true;\n  rankdir = TB;\n") and text.endswith("}\n")
    base = ctx.base
    assert f'"{base + 32:#x}" [ style = filled; fillcolor = pink' in text   # x: first object of the pool


def test_draw_graph():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx, graphs = scenarios.attention(G, no_alloc=True)
    gf = graphs["gf"]
    ax = ggml.viz.draw_graph(gf, title="t")
    assert len(ax.patches) == gf.n_nodes + gf.n_leafs
    texts = [t.get_text() for t in ax.texts]
    assert "#0 GET_ROWS\nnode_0" in texts and "#34 MUL_MAT\nresult_output" in texts
    members, level, pos = ggml.viz._layout(gf)
    for n in gf.nodes:                                  # every edge points downwards
        for s in n.src:
            if s is not None:
                assert level[id(s)] < level[id(n)]
    plt.close("all")


def test_graph_functions_refuse_a_graph_whose_memory_is_gone():
    ctx = ggml.init(1 << 20)
    x, y = _chain(ctx, 2)
    gf = ggml.new_graph_custom(ctx, 16)
    ggml.build_forward_expand(gf, y)
    other = ggml.init(1 << 20)
    dst = ggml.new_graph_custom(other, 16)
    ggml.reset(ctx)
    for where, call in [("graph_print", lambda: ggml.graph_print(gf, io.StringIO())),
                        ("graph_dump_dot", lambda: ggml.graph_dump_dot(gf, None, None)),
                        ("graph_cpy", lambda: ggml.graph_cpy(gf, dst)), ("graph_view", lambda: ggml.graph.graph_view(gf, 0, 1)),
                        ("graph_dup", lambda: ggml.graph_dup(other, gf)),
                        ("graph_add_node", lambda: ggml.graph_add_node(gf, ggml.new_tensor_1d(other, F32, 4)))]:
        with pytest.raises(GGMLError, match=rf"^{where}: the graph is gone: its context was reset"):
            call()
    assert dst.n_nodes == 0


def test_compute_flag_on_flags_tensorflag_does_not_name():
    """build_forward_expand looks flags | COMPUTE up in a table of TensorFlag values; a
    flags value with a bit TensorFlag has no name for (an int, as the RPC server may set)
    still gets COMPUTE and keeps its bits; a plain int in the table becomes the member."""
    ctx = ggml.init(1 << 20, no_alloc=True)
    a = ggml.new_tensor_1d(ctx, F32, 4)
    b, c = ggml.add(ctx, a, a), ggml.mul(ctx, a, a)
    b.flags, c.flags = 64 | 2, 2
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, b)
    ggml.build_forward_expand(gf, c)
    assert int(b.flags) == 64 | 2 | 16 and b.flags & TensorFlag.COMPUTE
    assert c.flags is TensorFlag.OUTPUT | TensorFlag.COMPUTE
