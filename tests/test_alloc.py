"""Tests of ggml_lite.alloc: the planner (dyn_tallocr) and the graph allocator (gallocr).

Expected values come from real ggml 0.15.3 (ggml-python 0.0.45): tests/ggml_ref/alloc_ref.py builds
the graphs of tests/ggml_ref/alloc_scenarios.py with ggml, plans them with ggml's gallocr and
stores the buffer sizes and the place of every tensor in tests/data/alloc_ref.json; here the very
same calls run through ggml_lite. GGML_SIZES below are ggml's buffer sizes, written out. The
tests do not need ggml-python. The overlap check is independent of both allocators: it derives
every tensor's live range from the graph alone.
"""
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ggml_lite as ggml
from ggml_lite import GGMLError, Op, TensorFlag, Type

sys.path.insert(0, str(Path(__file__).parent / "ggml_ref"))
import alloc_scenarios as scenarios  # noqa: E402
from graph_lite import Lite  # noqa: E402

REF = json.loads((Path(__file__).parent / "data" / "alloc_ref.json").read_text())
G = Lite()
F32 = Type.F32
CPU = ggml.backend_cpu_buffer_type()

# ggml: ggml_gallocr_get_buffer_size for every buffer id after each step of the scenario
GGML_SIZES = {
    'chain': [[69632]], 'inplace_chain': [[4416]], 'inplace_chain_input': [[4416]],
    'inplace_chain_output': [[8000]], 'inplace_chain_all_output': [[24416]],
    'not_inplace_chain': [[8000]], 'diamond': [[12288]], 'diamond_input': [[12288]],
    'diamond_output': [[12288]], 'wide_diamond': [[51360]], 'late_input': [[43520]],
    'late_input_no_flag': [[39424]], 'input_nodes': [[7168]], 'views': [[7776]], 'view_inplace': [[32768]],
    'output_view': [[4096]], 'output_view_read': [[4096]], 'attention': [[75648]], 'attention_preloaded': [[16000]],
    'mlp': [[36864]], 'mlp_all_weights': [[942080]], 'quantized': [[21888]],
    'llama_layer': [[116704]], 'zoo': [[10496]], 'realloc': [[18432], [36864], [36864], [36864]],
    'alloc_only': [[75648]], 'two_buffers': [[75648, 0]], 'chunks': [[32768]],
    'chunks_big_tensor': [[1212416]], 'wide_alignment': [[12288]], 'random_0': [[32320]],
    'random_1': [[12288]], 'random_2': [[14592]], 'random_3': [[25600]], 'random_4': [[5888]],
    'random_5': [[4960]], 'random_6': [[18336]], 'random_7': [[7424]], 'random_8': [[25856]],
    'random_9': [[14656]], 'random_10': [[12032]], 'random_11': [[16768]], 'random_12': [[6752]],
    'random_13': [[17920]], 'random_14': [[3136]], 'random_15': [[34080]], 'random_16': [[6144]],
    'random_17': [[17152]], 'random_18': [[11008]], 'random_19': [[14880]], 'random_20': [[4544]],
    'random_21': [[22272]], 'random_22': [[31488]], 'random_23': [[19456]], 'random_24': [[26880]],
    'random_25': [[6208]], 'random_26': [[17088]], 'random_27': [[3296]], 'random_28': [[8576]],
    'random_29': [[30976]], 'random_30': [[5600]], 'random_31': [[7968]], 'random_32': [[10176]],
    'random_33': [[56576]], 'random_34': [[19360]], 'random_35': [[10752]], 'random_36': [[11584]],
    'random_37': [[8352]], 'random_38': [[35840]], 'random_39': [[13056]],
}


class CustomBuft(ggml.BackendBufferType):
    """The CPU buffer type with another alignment and max_size (alloc_ref.py patches ggml's alike)."""

    def __init__(self, alignment, max_size):
        super().__init__()
        self.alignment, self.max_size = alignment, max_size

    def get_name(self):
        return "CPU_custom"

    def alloc_buffer(self, size):
        buf = CPU.alloc_buffer(size)
        buf.buft = self
        return buf

    def get_alignment(self):
        return self.alignment

    def get_max_size(self):
        return self.max_size

    def is_host(self):
        return True


# --- running a scenario the way alloc_ref.py runs it ------------------------------------------

def placement(t, galloc):
    if not t.data:
        return None
    for buffer_id, vbuf in enumerate(galloc.buffers):
        if vbuf is not None:
            for chunk, buf in enumerate(vbuf.chunks):
                if t.buffer is buf:
                    return [buffer_id, chunk, t.data - ggml.backend_buffer_get_base(buf)]
    return "ext"


def run(name):
    s = scenarios.SCENARIOS[name](G)
    n_bufs = s.get("n_bufs", 1)
    buft = CustomBuft(*s["buft"]) if "buft" in s else CPU
    galloc = ggml.gallocr_new_n([buft] * n_bufs, n_bufs)
    steps = s.get("steps", ["reserve"] + ["alloc"] * (len(s["graphs"]) - 1))
    out = {"sizes": []}
    for step, gf in zip(steps, s["graphs"]):
        if step == "reserve":
            ok = ggml.gallocr_reserve_n(galloc, gf, s.get("node_ids"), None)
        else:
            ok = ggml.gallocr_alloc_graph(galloc, gf)
        assert ok, step
        out["sizes"].append([ggml.gallocr_get_buffer_size(galloc, i) for i in range(n_bufs)])
    gf = s["graphs"][-1]
    if steps[-1] == "reserve":
        assert ggml.gallocr_alloc_graph(galloc, gf)
    out["n_chunks"] = [len(b.chunks) for b in galloc.buffers]
    out["chunk_sizes"] = [[ggml.backend_buffer_get_size(c) for c in b.chunks] for b in galloc.buffers]
    out["leafs"] = [placement(t, galloc) for t in gf.leafs]
    out["nodes"] = [placement(t, galloc) for t in gf.nodes]
    out["names"] = [t.name for t in gf.nodes]
    return out, s, galloc, gf


@pytest.fixture(scope="module")
def runs():
    return {name: run(name) for name in scenarios.SCENARIOS}


NAMES = list(scenarios.SCENARIOS)


def test_fixture_is_ggml_0_15_3():
    assert REF["ggml_version"] == "0.15.3"
    assert set(REF["scenarios"]) == set(NAMES) == set(GGML_SIZES)


@pytest.mark.parametrize("name", NAMES)
def test_buffer_sizes_are_ggmls(runs, name):
    assert runs[name][0]["sizes"] == GGML_SIZES[name]
    assert REF["scenarios"][name]["sizes"] == GGML_SIZES[name]


@pytest.mark.parametrize("name", NAMES)
def test_every_tensor_where_ggml_puts_it(runs, name):
    got, ref = runs[name][0], REF["scenarios"][name]
    for key in ("n_chunks", "chunk_sizes", "names", "leafs", "nodes"):
        assert got[key] == ref[key], key


def test_op_can_inplace_is_ggmls_list():
    got = sorted(op.name for op in Op if op != Op.COUNT and ggml.alloc.op_can_inplace(op))
    assert got == sorted(REF["inplace_ops"])
    assert not ggml.alloc.op_can_inplace(Op.MUL_MAT) and not ggml.alloc.op_can_inplace(Op.NORM)


# --- no two live tensors overlap (independent of the allocator) ---------------------------------

def live_ranges(gf, view_output_keeps_source=True):
    """{id(tensor): (first, last)} from the graph alone: written at its node (before the graph for
    leafs and INPUT), needed until its last reader (reading a view reads its source), and past
    the end when OUTPUT, or when nobody reads it. An OUTPUT view keeps its source past the end
    too — what a user expects; ggml 0.15.3 only does so while no node reads the view
    (view_output_keeps_source=False checks that weaker promise)."""
    n = len(gf.nodes)
    root = lambda t: t.view_src if t.view_src is not None else t  # noqa: E731
    first, last = {}, {}
    for t in gf.leafs:
        first[id(root(t))] = -1
    readers = {}
    for i, node in enumerate(gf.nodes):
        first.setdefault(id(root(node)), -1 if node.flags & TensorFlag.INPUT else i)
        last[id(root(node))] = max(last.get(id(root(node)), i), i)
        for s in node.src:
            if s is not None:
                readers.setdefault(id(s), []).append(i)
                last[id(root(s))] = max(last.get(id(root(s)), -1), i)
    for node in gf.nodes:
        unread = id(node) not in readers
        if unread or (node.flags & TensorFlag.OUTPUT and (view_output_keeps_source or node.view_src is None)):
            last[id(root(node))] = n
    return {k: (first[k], last.get(k, -1)) for k in first}


def overlaps(gf, galloc, view_output_keeps_source=True):
    """Pairs of placed tensors whose bytes intersect while both must hold their values; a node
    that works in place over the operand it reads last is the one allowed exception."""
    ranges = live_ranges(gf, view_output_keeps_source)
    placed = []
    for t in list(gf.leafs) + list(gf.nodes):
        p = placement(t, galloc)
        if t.view_src is None and isinstance(p, list) and all(t is not q[0] for q in placed):
            size = ggml.backend_buft_get_alloc_size(galloc.bufts[p[0]], t)
            placed.append((t, (p[0], p[1]), p[2], p[2] + size))
    bad = []
    for i, (a, ka, a0, a1) in enumerate(placed):
        for b, kb, b0, b1 in placed[i + 1:]:
            if ka != kb or a1 <= b0 or b1 <= a0 or a1 == a0 or b1 == b0:
                continue
            (fa, la), (fb, lb) = ranges[id(a)], ranges[id(b)]
            if la < fb or lb < fa:
                continue
            handover = a0 == b0 and (
                (la == fb and any(s is a for s in b.src) and ggml.alloc.op_can_inplace(b.op)) or
                (lb == fa and any(s is b for s in a.src) and ggml.alloc.op_can_inplace(a.op)))
            if not handover:
                bad.append((a.name, b.name))
    return bad


def read_output_views(gf):
    """Names of the tensors that have an OUTPUT view which some node reads."""
    read = {id(s) for n in gf.nodes for s in n.src if s is not None}
    return {n.view_src.name for n in gf.nodes
            if n.view_src is not None and n.flags & TensorFlag.OUTPUT and id(n) in read}


@pytest.mark.parametrize("name", NAMES)
def test_no_two_live_tensors_overlap(runs, name):
    _, _, galloc, gf = runs[name]
    assert overlaps(gf, galloc, view_output_keeps_source=False) == []
    quirk = read_output_views(gf)
    assert all(a in quirk or b in quirk for a, b in overlaps(gf, galloc))


def test_an_output_view_that_is_read_does_not_keep_its_source():
    """ggml 0.15.3 frees a view's source after the view's last reader even if the view is OUTPUT
    (ggml_set_output flags only the view; free_node looks at the tensor it frees). The fixture
    shows ggml putting w over y; ggml_lite does the same."""
    got, _, galloc, gf = run("output_view_read")
    assert got["nodes"] == REF["scenarios"]["output_view_read"]["nodes"]
    y, v = gf.nodes[1], gf.nodes[2]
    assert v.view_src is y and v.flags & TensorFlag.OUTPUT
    assert overlaps(gf, galloc, view_output_keeps_source=False) == []
    assert overlaps(gf, galloc) == [(y.name, gf.nodes[4].name), (y.name, gf.nodes[5].name)]


def test_overlap_check_can_fail():
    """The checker is not vacuous: move one tensor onto another live one and it complains."""
    _, _, galloc, gf = run("diamond")
    a, b = gf.nodes[0], gf.nodes[1]              # silu(x) and scale(x): both live until add
    assert overlaps(gf, galloc) == []
    b.data = a.data
    assert overlaps(gf, galloc) == [(a.name, b.name)]


def test_in_place_chain_shares_one_slot(runs):
    _, _, galloc, gf = runs["inplace_chain"]
    assert {t.data for t in gf.nodes} == {gf.leafs[0].data}       # x's bytes, taken over
    _, _, galloc, gf = runs["inplace_chain_output"]
    h3, h4 = gf.nodes[2], gf.nodes[3]
    assert h3.flags & TensorFlag.OUTPUT and h4.data != h3.data


def test_views_point_into_their_source(runs):
    _, _, galloc, gf = runs["views"]
    views = [t for t in gf.nodes if t.view_src is not None]
    assert views
    for v in views:
        assert v.buffer is v.view_src.buffer and v.data == v.view_src.data + v.view_offs


def test_external_memory_is_left_alone(runs):
    _, s, galloc, gf = runs["attention_preloaded"]
    weights = list(s["wctx"])
    assert weights and all(placement(w, galloc) == "ext" and w.buffer is None for w in weights)


# --- reserve, re-reserve, several buffers, errors -----------------------------------------------

def mlp(n_tokens):
    return scenarios.mlp(G, n_tokens)


def test_alloc_graph_reuses_the_plan_while_it_fits():
    s16, s8, s32 = mlp(16), mlp(8), mlp(32)
    galloc = ggml.gallocr_new(CPU)
    assert ggml.gallocr_reserve(galloc, s16["graphs"][0])
    buf = galloc.buffers[0]
    assert ggml.gallocr_alloc_graph(galloc, s8["graphs"][0])
    assert galloc.buffers[0] is buf and ggml.gallocr_get_buffer_size(galloc, 0) == 36864
    assert ggml.gallocr_alloc_graph(galloc, s32["graphs"][0])          # larger: planned again
    assert galloc.buffers[0] is not buf
    assert ggml.gallocr_get_buffer_size(galloc, 0) == 2 * 36864
    assert overlaps(s32["graphs"][0], galloc) == []


def test_several_buffers_ask_for_reserve():
    a, b = scenarios.attention_block(G), mlp(16)
    galloc = ggml.gallocr_new_n([CPU, CPU])
    n = len(a["graphs"][0].nodes)
    assert ggml.gallocr_reserve_n(galloc, a["graphs"][0], [i % 2 for i in range(n)], None)
    with pytest.raises(ggml.GallocrNeedsReserveError, match="call reserve.*different number of nodes"):
        ggml.gallocr_alloc_graph(galloc, b["graphs"][0])
    assert isinstance(ggml.GallocrNeedsReserveError("x"), GGMLError)
    assert all(t.buffer is None and not t.data for t in b["graphs"][0].nodes)   # nothing placed
    assert ggml.gallocr_alloc_graph(galloc, a["graphs"][0])


def test_reserve_n_size_allocates_nothing():
    s = mlp(16)
    galloc = ggml.gallocr_new(CPU)
    assert ggml.gallocr_reserve_n_size(galloc, s["graphs"][0]) == [36864]
    assert galloc.buffers == [None] and ggml.gallocr_get_buffer_size(galloc, 0) == 0
    two = ggml.gallocr_new_n([CPU, CPU])
    a = scenarios.attention_block(G)["graphs"][0]
    ids = [i % 2 for i in range(len(a.nodes))]
    assert ggml.gallocr_reserve_n_size(two, a, ids, None) == [75648, 75648]   # ggml counts it twice


def test_bad_buffer_ids_leave_the_allocator_as_it_was():
    s = mlp(16)
    gf = s["graphs"][0]
    galloc = ggml.gallocr_new_n([CPU, CustomBuft(64, 2**64 - 1)])
    ids = [0] * len(gf.nodes)
    assert ggml.gallocr_reserve_n(galloc, gf, ids, None)
    before = [ggml.gallocr_get_buffer_size(galloc, i) for i in range(2)]
    with pytest.raises(GGMLError, match="buffer id 2 is not in 0..1"):
        ggml.gallocr_reserve_n(galloc, gf, [2] * len(gf.nodes), None)
    with pytest.raises(GGMLError, match="3 node buffer ids for 13 nodes"):
        ggml.gallocr_reserve_n(galloc, gf, [0, 1, 0], None)
    assert [ggml.gallocr_get_buffer_size(galloc, i) for i in range(2)] == before
    assert ggml.gallocr_alloc_graph(galloc, gf)


def test_get_buffer_size_checks_the_id_and_new_n_the_count():
    galloc = ggml.gallocr_new(CPU)
    with pytest.raises(GGMLError, match="buffer_id 1 is not in 0..0"):
        ggml.gallocr_get_buffer_size(galloc, 1)
    with pytest.raises(GGMLError, match="n_bufs = 3"):
        ggml.gallocr_new_n([CPU, CPU], 3)


def test_free_releases_the_buffers():
    s = mlp(16)
    galloc = ggml.gallocr_new_n([CPU, CPU])
    assert ggml.gallocr_reserve(galloc, s["graphs"][0])
    buf = galloc.buffers[0].chunks[0]
    ggml.gallocr_free(galloc)
    assert buf._freed and galloc.buffers == [None, None]
    ggml.gallocr_free(None)


def test_two_buffer_types_get_two_buffers():
    s = scenarios.attention_block(G)
    gf = s["graphs"][0]
    other = CustomBuft(64, 2**64 - 1)
    galloc = ggml.gallocr_new_n([CPU, other])
    ids = [i % 2 for i in range(len(gf.nodes))]
    assert ggml.gallocr_reserve_n(galloc, gf, ids, [1] * len(gf.leafs))
    assert ggml.gallocr_alloc_graph(galloc, gf)
    sizes = [ggml.gallocr_get_buffer_size(galloc, i) for i in range(2)]
    assert all(sizes) and sizes[1] % 64 == 0
    assert all(t.buffer.buft is other for t in gf.leafs)
    assert overlaps(gf, galloc) == []


# --- the planner ---------------------------------------------------------------------------------

def blocks(p, chunk=0):
    return [(b.offset, b.size) for b in p.chunks[chunk].free_blocks]


TAIL = 2**63 - 1            # SIZE_MAX/2: the size of a fresh chunk's tail


def test_alignment_rounds_every_size():
    p = ggml.dyn_tallocr.dyn_tallocr_new(32)
    assert [ggml.dyn_tallocr.dyn_tallocr_alloc(p, n).offset for n in (1, 32, 33, 0, 5)] == [0, 32, 64, 128, 128]
    assert ggml.dyn_tallocr.dyn_tallocr_max_size(p, 0) == 160 and ggml.dyn_tallocr.dyn_tallocr_max_size(p, 1) == 0
    with pytest.raises(GGMLError, match="not a power of 2"):
        ggml.dyn_tallocr.dyn_tallocr_new(48)


def test_best_fit_prefers_the_smallest_hole_and_on_a_tie_the_later_one():
    p = ggml.dyn_tallocr.dyn_tallocr_new(32)
    a = [ggml.dyn_tallocr.dyn_tallocr_alloc(p, n) for n in (96, 32, 64, 32, 64, 32, 128, 32)]
    for i in (0, 2, 4, 6):
        ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, a[i], [96, 0, 64, 0, 64, 0, 128][i])
    assert blocks(p)[:-1] == [(0, 96), (128, 64), (224, 64), (320, 128)]
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 40).offset == 224      # 64 and 64 tie: the later hole
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 40).offset == 128
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 90).offset == 0        # 96 is smaller than 128
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 200).offset == 480     # no hole fits: the tail grows
    assert ggml.dyn_tallocr.dyn_tallocr_max_size(p, 0) == 704


def test_free_merges_with_both_neighbours_and_the_tail():
    p = ggml.dyn_tallocr.dyn_tallocr_new(32)
    a, b, c, d = (ggml.dyn_tallocr.dyn_tallocr_alloc(p, 32) for _ in range(4))
    ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, a, 32)
    ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, c, 32)
    assert blocks(p) == [(0, 32), (64, 32), (128, TAIL - 128)]
    ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, b, 32)                    # closes the gap: one block 0..96
    assert blocks(p) == [(0, 96), (128, TAIL - 128)]
    ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, d, 32)                    # joins the tail, and the tail the block
    assert blocks(p) == [(0, TAIL)]
    assert ggml.dyn_tallocr.dyn_tallocr_max_size(p, 0) == 128            # the high-water mark stays


def test_free_before_a_block_merges_backwards():
    p = ggml.dyn_tallocr.dyn_tallocr_new(16)
    a, b, c = (ggml.dyn_tallocr.dyn_tallocr_alloc(p, 16) for _ in range(3))
    ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, b, 16)
    ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, a, 16)                    # runs into b's block
    assert blocks(p) == [(0, 32), (48, TAIL - 48)]


def test_chunks_split_at_max_size_and_tails_compete():
    p = ggml.dyn_tallocr.dyn_tallocr_new(32, 256)
    addrs = [ggml.dyn_tallocr.dyn_tallocr_alloc(p, n) for n in (100, 100, 100, 600, 20)]
    assert addrs == [(0, 0), (0, 128), (1, 0), (2, 0), (1, 128)]
    assert [ggml.dyn_tallocr.dyn_tallocr_max_size(p, c) for c in range(3)] == [256, 160, 608]
    ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, addrs[3], 600)
    # chunk 2's tail holds 512 within its max_size (reuse 96 >= 0); chunk 1 would have to grow
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 500) == (2, 0)
    # chunk 2's tail fits 96 exactly (reuse 0), better than growing chunk 1 by 96 (reuse -96)
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 96) == (2, 512)
    # only chunk 1 has a tail left: it grows
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 64) == (1, 160)
    assert [ggml.dyn_tallocr.dyn_tallocr_max_size(p, c) for c in range(3)] == [256, 224, 608]


def test_the_sixteenth_chunk_is_unbounded():
    p = ggml.dyn_tallocr.dyn_tallocr_new(32, 64)
    for _ in range(ggml.dyn_tallocr.VBUFFER_MAX_CHUNKS - 1):
        ggml.dyn_tallocr.dyn_tallocr_alloc(p, 64)
    assert len(p.chunks) == 15
    last = ggml.dyn_tallocr.dyn_tallocr_alloc(p, 64)
    assert last == (15, 0) and blocks(p, 15) == [(64, TAIL - 64)]
    assert ggml.dyn_tallocr.dyn_tallocr_alloc(p, 10**6) == (15, 64)


def test_out_of_free_blocks_is_an_error_and_changes_nothing():
    p = ggml.dyn_tallocr.dyn_tallocr_new(16)
    addrs = [ggml.dyn_tallocr.dyn_tallocr_alloc(p, 16) for _ in range(2 * ggml.dyn_tallocr.MAX_FREE_BLOCKS + 2)]
    for a in addrs[0:2 * ggml.dyn_tallocr.MAX_FREE_BLOCKS - 2:2]:          # every other one: 255 holes + tail
        ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, a, 16)
    assert len(p.chunks[0].free_blocks) == ggml.dyn_tallocr.MAX_FREE_BLOCKS
    before = blocks(p)
    with pytest.raises(GGMLError, match="out of free blocks"):
        ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, addrs[2 * ggml.dyn_tallocr.MAX_FREE_BLOCKS - 2], 16)
    assert blocks(p) == before


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000), st.integers(0, 10**6)),
                min_size=1, max_size=120),
       st.sampled_from([16, 32, 256]), st.sampled_from([2**64 - 1, 8192, 1024]))
def test_planner_invariants(ops, alignment, max_size):
    """Random allocs and frees: live ranges never overlap, free blocks stay sorted, apart and
    aligned, and live + free bytes fill every chunk up to its tail."""
    p = ggml.dyn_tallocr.dyn_tallocr_new(alignment, max_size)
    live = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            addr = ggml.dyn_tallocr.dyn_tallocr_alloc(p, size)
            live.append((addr, -(-size // alignment) * alignment))
        else:
            addr, n = live.pop(pick % len(live))
            ggml.dyn_tallocr.dyn_tallocr_free_bytes(p, addr, n)
    for c, chunk in enumerate(p.chunks):
        mine = sorted((a.offset, n) for a, n in live if a.chunk == c)
        for (o1, n1), (o2, _) in zip(mine, mine[1:]):
            assert o1 + n1 <= o2
        fb = [(b.offset, b.size) for b in chunk.free_blocks]
        for (o1, n1), (o2, _) in zip(fb, fb[1:]):
            assert o1 + n1 < o2                                   # sorted and never touching
        assert all(o % alignment == 0 and n % alignment == 0 for o, n in fb[:-1] + mine)
        assert not fb or fb[-1][0] % alignment == 0
        for o, n in mine:
            assert all(o + n <= fo or fo + fn <= o for fo, fn in fb)
            assert o + n <= chunk.max_size
        end = max(fb[-1][0] + fb[-1][1], chunk.max_size) if fb else chunk.max_size
        assert sum(n for _, n in mine) + sum(n for _, n in fb) == end    # no byte lost


# --- random graphs beyond the fixtures -----------------------------------------------------------

@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1000, 10**6))
def test_random_graphs_never_overlap(seed):
    s = scenarios.random_graph(G, seed)
    gf = s["graphs"][0]
    align = 32
    naive = sum(-(-ggml.nbytes(t) // align) * align for t in set(gf.leafs) | set(gf.nodes)
                if t.view_src is None)
    galloc = ggml.gallocr_new(CPU)
    assert ggml.gallocr_reserve(galloc, gf) and ggml.gallocr_alloc_graph(galloc, gf)
    size = ggml.gallocr_get_buffer_size(galloc, 0)
    assert max(ggml.nbytes(t) for t in gf.nodes) <= size <= naive
    assert overlaps(gf, galloc, view_output_keeps_source=False) == []
    quirk = read_output_views(gf)
    assert all(a in quirk or b in quirk for a, b in overlaps(gf, galloc))


# --- computing in the planned buffer gives what one buffer per tensor gives ---------------------

def leaf_bytes(t, rng):
    """Deterministic contents for a leaf: floats in [-1, 1], small indices, quantized floats."""
    n = ggml.nelements(t)
    if t.type == Type.I32:
        return rng.integers(0, 5, n).astype(np.int32).tobytes()
    x = rng.uniform(-1, 1, n).astype(np.float32)
    if ggml.is_quantized(t.type):
        return ggml.quantize_chunk(t.type, x.reshape(-1, t.ne[0])).tobytes()
    return x.astype({Type.F32: np.float32, Type.F16: np.float16}[t.type]).tobytes()


def fill_leafs(gf, seed=0):
    """Write every leaf, and every node without an op (PARAM tensors), as a caller would."""
    rng = np.random.default_rng(seed)
    for t in list(gf.leafs) + [n for n in gf.nodes if n.op == Op.NONE]:
        raw = np.frombuffer(leaf_bytes(t, rng), np.uint8)
        if t.buffer is not None:
            ggml.backend_tensor_set(t, raw)
        else:                                          # data from a context's own pool
            t.numpy().reshape(-1).view(np.uint8)[:] = raw


def results(gf):
    """The bytes of every tensor a caller may read after the graph: the roots and the OUTPUT
    tensors (except an OUTPUT view that some node reads, which ggml does not keep)."""
    read = {id(s) for n in gf.nodes for s in n.src if s is not None}
    keep = [t for t in gf.nodes if id(t) not in read or (t.flags & TensorFlag.OUTPUT and t.view_src is None)]
    return {i: ggml.backend_tensor_get(t, size=ggml.nbytes(t)).tobytes() if t.buffer is not None
            else t.numpy().tobytes() for i, t in enumerate(gf.nodes) if t in keep}


# realloc: four graphs; zoo: get_rows of I32 rows has no ggml_lite kernel (ggml has one)
COMPUTED = [n for n in NAMES if n not in ("realloc", "zoo", "late_input_no_flag")]


@pytest.fixture(scope="module")
def cpu_backend():
    backend = ggml.backend_cpu_init()
    ggml.backend_cpu_set_n_threads(backend, 2)
    yield backend
    ggml.backend_free(backend)


@pytest.mark.parametrize("name", COMPUTED)
def test_compute_in_the_planned_buffer_equals_one_buffer_per_tensor(name, cpu_backend):
    _, _, galloc, planned = run(name)
    fill_leafs(planned)
    assert ggml.backend_graph_compute(cpu_backend, planned) == ggml.Status.SUCCESS
    got = results(planned)

    s = scenarios.SCENARIOS[name](G)                   # the same graph, every tensor its own bytes
    naive = s["graphs"][-1]
    assert ggml.backend_alloc_ctx_tensors_from_buft(s["ctx"], CPU) is not None
    fill_leafs(naive)
    assert ggml.backend_graph_compute(cpu_backend, naive) == ggml.Status.SUCCESS
    want = results(naive)
    assert got.keys() == want.keys() and got
    for i in want:
        assert got[i] == want[i], f"node {i} ({naive.nodes[i].name}) differs"


def test_without_input_a_late_input_is_clobbered(cpu_backend):
    """late_input without INPUT: x (a PARAM node read last) gets bytes that earlier nodes still
    use while the graph runs, so the value written before compute is gone when it is read."""
    def compute(name, naive):
        if naive:
            s = scenarios.SCENARIOS[name](G)
            gf = s["graphs"][-1]
            ggml.backend_alloc_ctx_tensors_from_buft(s["ctx"], CPU)
        else:
            gf = run(name)[3]
        fill_leafs(gf)
        assert ggml.backend_graph_compute(cpu_backend, gf) == ggml.Status.SUCCESS
        return results(gf)

    assert compute("late_input", False) == compute("late_input", True)
    assert compute("late_input_no_flag", False) != compute("late_input_no_flag", True)


def test_the_check_above_sees_a_bad_plan(cpu_backend):
    """Not vacuous: with the diamond's two branches forced onto the same bytes the results differ."""
    _, _, galloc, planned = run("diamond")
    a, b = planned.nodes[0], planned.nodes[1]
    for t in planned.nodes:                            # views of b would follow b; there are none
        assert t.view_src is not b
    b.data = a.data
    fill_leafs(planned)
    ggml.backend_graph_compute(cpu_backend, planned)
    s = scenarios.diamond(G)
    ggml.backend_alloc_ctx_tensors_from_buft(s["ctx"], CPU)
    fill_leafs(s["graphs"][0])
    ggml.backend_graph_compute(cpu_backend, s["graphs"][0])
    assert results(planned) != results(s["graphs"][0])


def test_a_plan_that_cannot_be_allocated_is_reported_not_thrown(caplog):
    """ggml 0.15.3: buft_alloc_buffer -> NULL, gallocr_reserve -> false (then alloc_graph crashes it)."""
    ctx = ggml.init(1 << 20, no_alloc=True)
    big = ggml.new_tensor_1d(ctx, ggml.Type.F32, 1 << 58)        # 1 EiB: beyond any x86-64 address space
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, ggml.scale(ctx, big, 2.0))
    buft = ggml.backend_cpu_buffer_type()
    with caplog.at_level("ERROR"):
        assert ggml.backend_buft_alloc_buffer(buft, 1 << 60) is None
        galloc = ggml.gallocr_new(buft)
        assert ggml.gallocr_reserve(galloc, gf) is False
        assert ggml.gallocr_alloc_graph(galloc, gf) is False       # reserves again, fails again
    assert "failed to allocate" in caplog.text
    small = ggml.init(1 << 20, no_alloc=True)                     # the allocator is still usable
    x = ggml.new_tensor_1d(small, ggml.Type.F32, 8)
    g2 = ggml.new_graph(small)
    ggml.build_forward_expand(g2, ggml.scale(small, x, 2.0))
    assert ggml.gallocr_alloc_graph(galloc, g2) is True and x.data != 0


def test_gallocr_refuses_a_graph_whose_memory_is_gone():
    ctx = ggml.init(1 << 20, no_alloc=True)
    x = ggml.new_tensor_1d(ctx, ggml.Type.F32, 8)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, ggml.scale(ctx, x, 2.0))
    galloc = ggml.gallocr_new(ggml.backend_cpu_buffer_type())
    ggml.free(ctx)
    for call in (ggml.gallocr_reserve, ggml.gallocr_alloc_graph):
        with pytest.raises(GGMLError, match="the graph is gone: its context was freed"):
            call(galloc, gf)
