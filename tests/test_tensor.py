"""Tests of ggml_lite.tensor: the context pool, descriptors, views, predicates, names, flags, data access.

Every expected number marked "ggml:" was printed by real ggml for the same calls
(tests/ggml_ref/tensor_ref.py, run with ggml-python 0.0.45 = ggml 0.15.3; see that file to re-run it).
The tests themselves do not need ggml.
"""
import gc

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite import GGMLError, Type
from ggml_lite.context import new_object
from ggml_lite.tensor import ObjectType, TensorFlag

F32, F16, I32, Q4_0, Q4_K, BF16 = Type.F32, Type.F16, Type.I32, Type.Q4_0, Type.Q4_K, Type.BF16


# --- the pool ------------------------------------------------------------------------------------

def test_overheads():
    assert ggml.tensor_overhead() == 368          # ggml: ggml_tensor_overhead()
    assert ggml.context.OBJECT_SIZE + ggml.TENSOR_SIZE == 368


# ggml: (name, ne, nb, nbytes, data offset from mem_buffer, used_mem after the call)
POOL_STEPS = [
    ("f32_10", [10, 1, 1, 1], [4, 40, 40, 40], 40, 368, 416),
    ("f16_5x3", [5, 3, 1, 1], [2, 10, 30, 30], 30, 784, 816),
    ("q4_0_64x2x3", [64, 2, 3, 1], [18, 36, 72, 216], 216, 1184, 1408),
    ("q4_k_256x2", [256, 2, 1, 1], [144, 144, 288, 288], 288, 1776, 2064),
    ("i32_7x1x1x2", [7, 1, 1, 2], [4, 28, 28, 28], 56, 2432, 2496),
    ("f32_empty", [0, 3, 1, 1], [4, 0, 0, 0], 0, None, 2864),
    ("", [5, 3, 1, 1], [2, 10, 30, 30], 30, 3232, 3264),      # dup_tensor of f16_5x3
]


def test_pool_layout_matches_ggml():
    ctx = ggml.init(1 << 20)
    made = [
        ggml.new_tensor_1d(ctx, F32, 10),
        ggml.new_tensor_2d(ctx, F16, 5, 3),
        ggml.new_tensor_3d(ctx, Q4_0, 64, 2, 3),
        ggml.new_tensor_2d(ctx, Q4_K, 256, 2),
        ggml.new_tensor_4d(ctx, I32, 7, 1, 1, 2),
        ggml.new_tensor_2d(ctx, F32, 0, 3),
    ]
    used = []
    for (name, *_), t in zip(POOL_STEPS, made):
        ggml.set_name(t, name)
    # used_mem after each creation: rebuild in a fresh context to observe every step
    ctx2 = ggml.init(1 << 20)
    for make in (lambda: ggml.new_tensor_1d(ctx2, F32, 10), lambda: ggml.new_tensor_2d(ctx2, F16, 5, 3),
                 lambda: ggml.new_tensor_3d(ctx2, Q4_0, 64, 2, 3), lambda: ggml.new_tensor_2d(ctx2, Q4_K, 256, 2),
                 lambda: ggml.new_tensor_4d(ctx2, I32, 7, 1, 1, 2), lambda: ggml.new_tensor_2d(ctx2, F32, 0, 3)):
        make()
        used.append(ggml.used_mem(ctx2))
    made.append(ggml.dup_tensor(ctx, ggml.get_tensor(ctx, "f16_5x3")))
    used.append(ggml.used_mem(ctx))
    base = ctx.base
    for (name, ne, nb, nbytes, data_offs, used_after), t, u in zip(POOL_STEPS, made, used):
        assert (t.name, t.ne, t.nb, ggml.nbytes(t)) == (name, ne, nb, nbytes)
        assert (t.data - base if t.data else None) == data_offs
        assert u == used_after
    # ggml: get_first_tensor/get_next_tensor order
    assert [t.name for t in ctx] == [s[0] for s in POOL_STEPS]
    t, names = ggml.get_first_tensor(ctx), []
    while t is not None:
        names.append(t.name)
        t = ggml.get_next_tensor(ctx, t)
    assert names == [s[0] for s in POOL_STEPS]


def test_object_headers_are_written_into_the_pool():
    ctx = ggml.init(4096)
    ggml.new_tensor_1d(ctx, F32, 10)
    ggml.new_tensor_1d(ctx, F32, 3)
    pool = ggml.get_mem_buffer(ctx)
    offs, size, nxt, typ = np.frombuffer(pool[:32].tobytes(), dtype="<u8", count=3).tolist() + \
        [int(np.frombuffer(pool[24:28].tobytes(), dtype="<i4")[0])]
    assert (offs, size, typ) == (32, 384, int(ObjectType.TENSOR))
    assert nxt == ctx.base + 416                      # the second header, as an address
    assert np.frombuffer(pool[416:432].tobytes(), dtype="<u8").tolist() == [448, 352]
    assert np.frombuffer(pool[432:440].tobytes(), dtype="<u8")[0] == 0   # last: next = NULL


def test_no_alloc_costs_only_overheads():
    ctx = ggml.init(1 << 20, no_alloc=True)
    got = []
    for _ in range(3):
        t = ggml.new_tensor_2d(ctx, F32, 1000, 1000)
        got.append((ggml.used_mem(ctx), t.data))
    assert got == [(368, 0), (736, 0), (1104, 0)]     # ggml: used_mem and data (NULL)
    with pytest.raises(GGMLError, match="no data"):
        t.numpy()


@pytest.mark.parametrize("asked, got", [(0, 16), (1, 16), (100, 112), (1000, 1008), (1024, 1024)])
def test_mem_size_rounding(asked, got):
    assert ggml.get_mem_size(ggml.init(asked)) == got  # ggml: ggml_get_mem_size


def test_pool_exhausted_message_and_context_usable():
    ctx = ggml.init(1000)
    ggml.new_tensor_1d(ctx, F32, 100)
    assert ggml.used_mem(ctx) == 768                   # ggml: 768
    with pytest.raises(GGMLError) as e:
        ggml.new_tensor_1d(ctx, F32, 100)
    # ggml: "ggml_new_object: not enough space in the context's memory pool (needed 1536, available 1008)"
    # ggml_lite names the call that ran out instead of ggml_new_object
    assert str(e.value) == "new_tensor_1d: not enough space in the context's memory pool (needed 1536, available 1008)"
    assert ggml.used_mem(ctx) == 768 and len(list(ctx)) == 1      # nothing half-built
    ctx = ggml.init(1200)
    ggml.new_tensor_1d(ctx, F32, 100)
    with pytest.raises(GGMLError, match=r"needed 1536, available 1200"):
        ggml.new_tensor_1d(ctx, F32, 100)
    t = ggml.new_tensor_1d(ctx, F32, 10)                           # still usable: 768 + 416
    assert ggml.used_mem(ctx) == 1184 and t.data == ctx.base + 768 + 368


def test_exact_fit_formula():
    shapes = [(F32, (10,)), (F16, (5, 3)), (Q4_0, (64, 2))]
    need = sum(ggml.tensor_overhead() + (ggml.row_size(t, ne[0]) * (ne[1] if len(ne) > 1 else 1) + 15) // 16 * 16
               for t, ne in shapes)
    assert need == 1264                                # ggml: need 1264 used 1264 size 1264
    ctx = ggml.init(need)
    ggml.new_tensor_1d(ctx, F32, 10)
    ggml.new_tensor_2d(ctx, F16, 5, 3)
    ggml.new_tensor_2d(ctx, Q4_0, 64, 2)
    assert ggml.used_mem(ctx) == ggml.get_mem_size(ctx) == 1264
    with pytest.raises(GGMLError, match=r"\(needed 1648, available 1264\)"):   # ggml: the same numbers
        ggml.new_tensor_1d(ctx, I32, 1)
    small = ggml.init(need - 16)
    ggml.new_tensor_1d(small, F32, 10)
    ggml.new_tensor_2d(small, F16, 5, 3)
    with pytest.raises(GGMLError, match=r"needed 1264, available 1248"):
        ggml.new_tensor_2d(small, Q4_0, 64, 2)


def test_new_object_for_other_chapters():
    ctx = ggml.init(1024)
    ggml.new_tensor_1d(ctx, F32, 4)                       # 32 + PAD(336+16) = 384
    offs = new_object(ctx, ObjectType.GRAPH, 100, payload="graph")
    assert offs == 384 + 32 and ggml.used_mem(ctx) == 384 + 32 + 112
    assert len(list(ctx)) == 1                            # iteration yields tensors only
    with pytest.raises(GGMLError, match=r"needed 1072, available 1024"):
        new_object(ctx, ObjectType.WORK_BUFFER, 500)


def test_caller_buffer():
    buf = np.zeros(4096 // 8, dtype=np.float64)           # numpy's allocations are 16-aligned
    ctx = ggml.init(4096, mem_buffer=buf)
    t = ggml.new_tensor_1d(ctx, F32, 4)
    t.numpy()[...] = [1, 2, 3, 4]
    assert buf.view(np.float32)[92:96].tolist() == [1, 2, 3, 4]   # data at byte 368
    assert not ctx.mem_buffer_owned
    with pytest.raises(GGMLError, match="aligned"):
        ggml.init(64, mem_buffer=np.zeros(80, np.uint8)[1:])
    with pytest.raises(GGMLError, match="writable"):
        ggml.init(64, mem_buffer=bytes(64))
    with pytest.raises(GGMLError, match="less than mem_size"):
        ggml.init(128, mem_buffer=bytearray(64))


def test_free_and_reset_kill_descriptors_but_not_views_handed_out():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_1d(ctx, F32, 4)
    view = a.numpy()
    view[...] = 7
    ggml.free(ctx)
    gc.collect()
    assert view.tolist() == [[[[7, 7, 7, 7]]]]            # the numpy view kept its bytes alive
    with pytest.raises(GGMLError, match="freed"):
        a.numpy()
    with pytest.raises(GGMLError, match="freed"):
        ggml.new_tensor_1d(ctx, F32, 4)
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_1d(ctx, F32, 4)
    ggml.reset(ctx)
    assert ggml.used_mem(ctx) == 0 and ggml.get_first_tensor(ctx) is None
    with pytest.raises(GGMLError, match="reset"):
        a.numpy()
    with pytest.raises(GGMLError, match="reset"):
        ggml.view_1d(ctx, a, 2, 0)
    b = ggml.new_tensor_1d(ctx, F32, 4)
    assert b.data == ctx.base + 368                        # the pool is reused from its start


def test_context_manager_frees():
    with ggml.init(1024) as ctx:
        ggml.new_tensor_1d(ctx, F32, 4)
    assert ctx._freed


# --- descriptors -------------------------------------------------------------------------------

def test_fresh_descriptor_fields():
    ctx = ggml.init(1 << 16)
    t = ggml.new_tensor_2d(ctx, F32, 3, 2)
    assert t.type == F32 and t.buffer is None and t.op == 0 and t.flags == 0
    assert t.src == [None] * 10 and t.view_src is None and t.view_offs == 0 and t.extra is None
    assert t.op_params.dtype == np.int32 and t.op_params.shape == (16,) and not t.op_params.any()
    assert t.name == "" and t.data == ctx.base + 368


def test_bad_creations_raise():
    ctx = ggml.init(1 << 16)
    with pytest.raises(GGMLError, match="n_dims = 5"):
        ggml.new_tensor(ctx, F32, 5, [1, 1, 1, 1, 1])
    with pytest.raises(GGMLError, match="not a multiple of the block size 32"):
        ggml.new_tensor_1d(ctx, Q4_0, 33)
    with pytest.raises(GGMLError, match="negative"):
        ggml.new_tensor_2d(ctx, F32, 4, -1)
    with pytest.raises(GGMLError):
        ggml.new_tensor_1d(ctx, 99, 4)
    assert ggml.used_mem(ctx) == 0


# --- views -------------------------------------------------------------------------------------

# ggml: name, ne, nb, op, op_params[:4], view_src name, view_offs, data offset, nbytes, and the
# predicates is_contiguous, _1, _2, _rows, is_contiguously_allocated, is_transposed, is_permuted
VIEWS = {
    'a': ('a', [4, 3, 2, 1], [4, 16, 48, 96], 0, [0, 0, 0, 0], None, 0, 368, 96, "1111100"),
    'b': ('b', [8, 3, 1, 1], [4, 32, 96, 96], 0, [0, 0, 0, 0], None, 0, 832, 96, "1111100"),
    'q': ('q', [64, 3, 1, 1], [18, 36, 108, 108], 0, [0, 0, 0, 0], None, 0, 1296, 108, "1111100"),
    'view_tensor': ('a (view)', [4, 3, 2, 1], [4, 16, 48, 96], 0, [0, 0, 0, 0], 'a', 0, 368, 96, "1111100"),
    'view_1d': ('a (view)', [5, 1, 1, 1], [4, 20, 20, 20], 37, [8, 0, 0, 0], 'a', 8, 376, 20, "1111100"),
    'view_2d': ('a (view)', [2, 3, 1, 1], [4, 16, 48, 48], 37, [4, 0, 0, 0], 'a', 4, 372, 40, "0111000"),
    'view_3d': ('a (view)', [2, 3, 2, 1], [4, 16, 48, 96], 37, [8, 0, 0, 0], 'a', 8, 376, 88, "0111000"),
    'view_4d': ('a (view)', [4, 3, 1, 2], [4, 16, 48, 48], 37, [0, 0, 0, 0], 'a', 0, 368, 96, "1111100"),
    'view_of_view': ('a (view) (view)', [2, 1, 1, 1], [4, 8, 8, 8], 37, [16, 0, 0, 0], 'a', 20, 388, 8, "1111100"),
    'reshape': ('a (reshaped)', [8, 3, 1, 1], [4, 32, 96, 96], 36, [0, 0, 0, 0], 'a', 0, 368, 96, "1111100"),
    'reshape_1d': ('a (reshaped)', [24, 1, 1, 1], [4, 96, 96, 96], 36, [0, 0, 0, 0], 'a', 0, 368, 96, "1111100"),
    'reshape_2d': ('a (reshaped)', [6, 4, 1, 1], [4, 24, 96, 96], 36, [0, 0, 0, 0], 'a', 0, 368, 96, "1111100"),
    'reshape_3d': ('a (reshaped)', [2, 6, 2, 1], [4, 8, 48, 96], 36, [0, 0, 0, 0], 'a', 0, 368, 96, "1111100"),
    'reshape_4d': ('a (reshaped)', [2, 2, 3, 2], [4, 8, 16, 48], 36, [0, 0, 0, 0], 'a', 0, 368, 96, "1111100"),
    'permute_1203': ('a (permuted)', [2, 4, 3, 1], [48, 4, 16, 96], 38, [1, 2, 0, 3], 'a', 0, 368, 96, "0000111"),
    'permute_2013': ('a (permuted)', [3, 2, 4, 1], [16, 48, 4, 96], 38, [2, 0, 1, 3], 'a', 0, 368, 96, "0000101"),
    'permute_0213': ('a (permuted)', [4, 2, 3, 1], [4, 48, 16, 96], 38, [0, 2, 1, 3], 'a', 0, 368, 96, "0011101"),
    'transpose': ('b (transposed)', [3, 8, 1, 1], [32, 4, 96, 96], 39, [0, 0, 0, 0], 'b', 0, 832, 96, "0000111"),
    'transpose_of_permute': ('a (permuted) (transposed)', [2, 4, 3, 1], [48, 4, 16, 96], 39, [0, 0, 0, 0], 'a', 0, 368, 96, "0000111"),
    'view_tensor_of_view': ('a (view) (view)', [5, 1, 1, 1], [4, 20, 20, 20], 0, [0, 0, 0, 0], 'a', 8, 376, 20, "1111100"),
    'dup_of_permute': ('', [2, 4, 3, 1], [4, 8, 32, 96], 0, [0, 0, 0, 0], None, 0, 8032, 96, "1111100"),
    'q_view_2d': ('q (view)', [32, 2, 1, 1], [18, 36, 72, 72], 37, [36, 0, 0, 0], 'q', 36, 1332, 54, "0111000"),
    'q_transpose': ('q (transposed)', [3, 64, 1, 1], [36, 18, 108, 108], 39, [0, 0, 0, 0], 'q', 0, 1296, 1137, "0000011"),
    'q_reshape': ('q (reshaped)', [192, 1, 1, 1], [18, 108, 108, 108], 36, [0, 0, 0, 0], 'q', 0, 1296, 108, "1111100"),
    'rows_gap': ('b (view)', [4, 3, 1, 1], [4, 32, 96, 96], 37, [0, 0, 0, 0], 'b', 0, 832, 80, "0111000"),
    'one_row_gap': ('a (view)', [4, 1, 2, 1], [4, 100, 48, 96], 37, [0, 0, 0, 0], 'a', 0, 368, 64, "0011001"),
    'strided_cols': ('b (view)', [4, 3, 1, 1], [8, 32, 96, 96], 37, [0, 0, 0, 0], 'b', 0, 832, 92, "0000000"),
    'planes_gap': ('a (view)', [4, 2, 2, 1], [4, 16, 48, 96], 37, [0, 0, 0, 0], 'a', 0, 368, 80, "0011000"),
}

PREDICATES = [ggml.is_contiguous, ggml.is_contiguous_1, ggml.is_contiguous_2, ggml.is_contiguous_rows,
              ggml.is_contiguously_allocated, ggml.is_transposed, ggml.is_permuted]


def make_views(ctx):
    """The same calls, in the same order, as views() in tests/ggml_ref/tensor_ref.py."""
    a = ggml.set_name(ggml.new_tensor_3d(ctx, F32, 4, 3, 2), "a")
    b = ggml.set_name(ggml.new_tensor_2d(ctx, F32, 8, 3), "b")
    q = ggml.set_name(ggml.new_tensor_2d(ctx, Q4_0, 64, 3), "q")
    m = {"a": a, "b": b, "q": q}
    m["view_tensor"] = ggml.view_tensor(ctx, a)
    m["view_1d"] = ggml.view_1d(ctx, a, 5, 8)
    m["view_2d"] = ggml.view_2d(ctx, a, 2, 3, a.nb[1], 4)
    m["view_3d"] = ggml.view_3d(ctx, a, 2, 3, 2, a.nb[1], a.nb[2], 8)
    m["view_4d"] = ggml.view_4d(ctx, a, 4, 3, 1, 2, a.nb[1], a.nb[2], a.nb[2], 0)
    m["view_of_view"] = ggml.view_1d(ctx, m["view_2d"], 2, 16)
    m["reshape"] = ggml.reshape(ctx, a, b)
    m["reshape_1d"] = ggml.reshape_1d(ctx, a, 24)
    m["reshape_2d"] = ggml.reshape_2d(ctx, a, 6, 4)
    m["reshape_3d"] = ggml.reshape_3d(ctx, a, 2, 6, 2)
    m["reshape_4d"] = ggml.reshape_4d(ctx, a, 2, 2, 3, 2)
    m["permute_1203"] = ggml.permute(ctx, a, 1, 2, 0, 3)
    m["permute_2013"] = ggml.permute(ctx, a, 2, 0, 1, 3)
    m["permute_0213"] = ggml.permute(ctx, a, 0, 2, 1, 3)
    m["transpose"] = ggml.transpose(ctx, b)
    m["transpose_of_permute"] = ggml.transpose(ctx, m["permute_0213"])
    m["view_tensor_of_view"] = ggml.view_tensor(ctx, m["view_1d"])
    m["dup_of_permute"] = ggml.dup_tensor(ctx, m["permute_1203"])
    m["q_view_2d"] = ggml.view_2d(ctx, q, 32, 2, q.nb[1], q.nb[1])
    m["q_transpose"] = ggml.transpose(ctx, q)
    m["q_reshape"] = ggml.reshape_1d(ctx, q, 192)
    m["rows_gap"] = ggml.view_2d(ctx, b, 4, 3, b.nb[1], 0)
    m["one_row_gap"] = ggml.view_3d(ctx, a, 4, 1, 2, 100, a.nb[2], 0)
    m["strided_cols"] = ggml.view_2d(ctx, b, 4, 3, b.nb[1], 0)
    m["strided_cols"].nb[0] = 8
    m["planes_gap"] = ggml.view_3d(ctx, a, 4, 2, 2, a.nb[1], a.nb[2], 0)
    return m


@pytest.mark.parametrize("key", list(VIEWS))
def test_views_match_ggml(key):
    ctx = ggml.init(1 << 20)
    t = make_views(ctx)[key]
    name, ne, nb, op, params, src, offs, data_offs, nbytes, preds = VIEWS[key]
    assert (t.name, t.ne, t.nb, int(t.op), t.op_params[:4].tolist()) == (name, ne, nb, op, params)
    assert (t.view_src.name if t.view_src is not None else None, t.view_offs) == (src, offs)
    assert t.data - ctx.base == data_offs
    assert ggml.nbytes(t) == nbytes
    assert "".join(str(int(p(t))) for p in PREDICATES) == preds
    if op in (36, 37, 38, 39):
        assert t.src[0] is not None and t.src[1:] == [None] * 9
    assert t.view_src is None or t.view_src.view_src is None          # always the root


def test_views_pool_total_and_names():
    ctx = ggml.init(1 << 20)
    make_views(ctx)
    long = ggml.new_tensor_1d(ctx, F32, 4)
    long.name = "x" * 80            # ggml_set_name would cut; here only the attribute cuts
    assert long.name == "x" * 63                                       # ggml: 63 x's
    assert ggml.view_tensor(ctx, long).name == "x" * 63                # ggml: " (view)" cut off
    ggml.set_name(long, "y" * 60)
    assert ggml.permute(ctx, long, 0, 1, 2, 3).name == "y" * 60 + " (p"   # ggml
    ggml.format_name(long, "%s-%d", "blk", 12)
    assert long.name == "blk-12"
    assert ggml.used_mem(ctx) == 11824                                 # ggml: used_mem


def test_views_share_bytes():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_2d(ctx, F32, 4, 3)
    a.numpy()[...] = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    t = ggml.transpose(ctx, a)
    assert t.numpy()[0, 0].tolist() == np.arange(12).reshape(3, 4).T.tolist()
    t.numpy()[0, 0, 3, 1] = -1                                         # logical (i0=1, i1=3)
    assert a.numpy()[0, 0, 1, 3] == -1
    v = ggml.view_1d(ctx, a, 2, 5 * 4)
    v.numpy()[...] = 100
    assert a.numpy().reshape(-1)[4:8].tolist() == [4, 100, 100, -1]
    p = ggml.permute(ctx, ggml.reshape_3d(ctx, a, 2, 2, 3), 2, 0, 1, 3)
    assert np.shares_memory(p.numpy(), a.numpy())


def test_view_errors_and_context_usable():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_1d(ctx, F32, 10)
    ggml.view_1d(ctx, a, 4, 24)                                        # ggml: ok at 24
    used = ggml.used_mem(ctx)
    with pytest.raises(GGMLError, match=r"16 \+ 28 > 40"):             # ggml: aborts at 28
        ggml.view_1d(ctx, a, 4, 28)
    b = ggml.new_tensor_2d(ctx, F32, 4, 3)
    with pytest.raises(GGMLError, match="ggml_is_contiguous"):        # ggml: GGML_ASSERT(ggml_is_contiguous(a))
        ggml.reshape_1d(ctx, ggml.transpose(ctx, b), 12)
    with pytest.raises(GGMLError, match=r"ggml_nelements\(a\) == ne0\) failed: .* 12 elements, the shape \[13\]"):
        ggml.reshape_1d(ctx, b, 13)
    with pytest.raises(GGMLError, match=r"\[0, 0, 1, 2\]"):           # ggml: GGML_ASSERT(axis0 != axis1)
        ggml.permute(ctx, b, 0, 0, 1, 2)
    with pytest.raises(GGMLError, match=r"48 \+ 16 > 48"):             # ggml's dense-size check
        ggml.view_2d(ctx, b, 4, 3, 16, 16)
    with pytest.raises(GGMLError, match="spans 40 bytes from offset 16"):   # strided extent (ggml_lite)
        ggml.view_2d(ctx, b, 2, 3, 16, 16)
    assert ggml.used_mem(ctx) == used + 416 + 368       # b and its transpose; the failures added nothing
    n = len(list(ctx))
    ggml.view_1d(ctx, a, 2, 0)
    assert len(list(ctx)) == n + 1


def test_views_in_no_alloc_context_have_null_data():
    ctx = ggml.init(1 << 16, no_alloc=True)
    a = ggml.new_tensor_2d(ctx, F32, 4, 3)
    v = ggml.view_2d(ctx, a, 2, 3, a.nb[1], 8)
    assert a.data == 0 and v.data == 0 and v.view_offs == 8
    assert ggml.used_mem(ctx) == 2 * 368


# --- predicates ---------------------------------------------------------------------------------

def test_can_repeat_and_layout():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_2d(ctx, F32, 4, 3)
    row = ggml.new_tensor_1d(ctx, F32, 4)
    col = ggml.new_tensor_2d(ctx, F32, 1, 3)
    odd = ggml.new_tensor_1d(ctx, F32, 3)
    empty = ggml.new_tensor_1d(ctx, F32, 0)
    assert ggml.can_repeat(row, a) and ggml.can_repeat(col, a) and not ggml.can_repeat(odd, a)
    assert ggml.can_repeat(empty, ggml.new_tensor_2d(ctx, F32, 0, 5)) and not ggml.can_repeat(empty, a)
    assert ggml.layout.are_same_layout(a, ggml.dup_tensor(ctx, a))
    assert not ggml.layout.are_same_layout(a, ggml.transpose(ctx, ggml.new_tensor_2d(ctx, F32, 3, 4)))
    assert [ggml.n_dims(t) for t in (row, a, col)] == [1, 2, 2]


# --- names and flags ---------------------------------------------------------------------------

def test_names():
    ctx = ggml.init(1 << 16)
    t = ggml.new_tensor_1d(ctx, F32, 4)
    assert ggml.set_name(t, "blk.12.attn_k.weight") is t
    assert ggml.get_name(t) == "blk.12.attn_k.weight"
    assert ggml.get_tensor(ctx, "blk.12.attn_k.weight") is t
    assert ggml.get_tensor(ctx, "nope") is None
    t.name = "é" * 40                                  # 80 UTF-8 bytes: cut at 63, no half character
    assert t.name == "é" * 31 and len(t.name.encode()) == 62
    # set_name refuses what ggml would cut, and leaves the old name
    ggml.set_name(t, "w")
    with pytest.raises(ggml.GGMLError, match=r"is 64 bytes; a tensor name holds at most 63"):
        ggml.set_name(t, "n" * 64)
    assert t.name == "w"
    ggml.set_name(t, "n" * 63)
    assert t.name == "n" * 63
    t.name = "z" * 100
    assert t.name == "z" * 63


def test_flags():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_2d(ctx, F32, 4, 3)
    v = ggml.view_2d(ctx, a, 4, 2, a.nb[1], 0)
    vv = ggml.view_1d(ctx, v, 4, 0)
    ggml.set_output(vv)
    assert [int(a.flags), int(v.flags), int(vv.flags)] == [0, 0, 2]    # ggml: [0, 0, 2]
    ggml.set_input(a)
    ggml.set_param(a)
    assert a.flags == TensorFlag.INPUT | TensorFlag.PARAM == 5         # ggml: 5
    s = ggml.new_tensor_1d(ctx, F32, 1)
    ggml.set_loss(s)
    assert s.flags == 8                                                # ggml: 8
    with pytest.raises(GGMLError, match="GGML_OP_NONE"):
        ggml.set_param(v)
    with pytest.raises(GGMLError, match="scalar F32"):
        ggml.set_loss(a)


def test_op_params_helpers():
    ctx = ggml.init(1 << 16)
    t = ggml.new_tensor_1d(ctx, F32, 4)
    ggml.tensor.set_op_params_i32(t, 0, -7)
    ggml.tensor.set_op_params_f32(t, 5, 10000.0)
    assert ggml.tensor.get_op_params_i32(t, 0) == -7 and ggml.tensor.get_op_params_f32(t, 5) == 10000.0
    assert t.op_params[5] == 0x461C4000                                # the float's bits
    ggml.tensor.set_op_params(t, np.array([1, 2], dtype=np.int32))
    assert t.op_params[:3].tolist() == [1, 2, 0]
    with pytest.raises(GGMLError, match="65 bytes"):
        ggml.tensor.set_op_params(t, bytes(65))


# --- host data access ---------------------------------------------------------------------------

def test_get_set_match_ggml():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_2d(ctx, F32, 3, 2)
    for i in range(6):
        ggml.set_f32_1d(a, i, 10.0 * i + 0.75)
    t = ggml.transpose(ctx, a)
    assert [ggml.get_f32_1d(t, i) for i in range(6)] == [0.75, 30.75, 10.75, 40.75, 20.75, 50.75]  # ggml
    ggml.set_f32_1d(t, 1, -1.5)
    assert [ggml.get_f32_1d(a, i) for i in range(6)] == [0.75, 10.75, 20.75, -1.5, 40.75, 50.75]   # ggml
    assert [ggml.get_i32_1d(a, i) for i in range(6)] == [0, 10, 20, -1, 40, 50]                   # ggml
    h = ggml.new_tensor_1d(ctx, F16, 3)
    for i, v in enumerate((0.1, 65519.0, -2.5e-8)):
        ggml.set_f32_1d(h, i, v)
    got = [ggml.get_f32_1d(h, i) for i in range(3)]
    assert got == [0.0999755859375, 65504.0, -0.0] and np.signbit(got[2])                        # ggml
    n = ggml.new_tensor_1d(ctx, I32, 3)
    for i, v in enumerate((2.9, -2.9, 7.0)):
        ggml.set_f32_1d(n, i, v)
    assert [ggml.get_i32_1d(n, i) for i in range(3)] == [2, -2, 7]                                # ggml
    assert ggml.set_f32(a, 2.5) is a
    assert [ggml.get_f32_1d(a, i) for i in range(6)] == [2.5] * 6                                  # ggml


def test_bf16_and_int_access():
    ctx = ggml.init(1 << 16)
    b = ggml.new_tensor_1d(ctx, BF16, 2)
    ggml.set_f32_1d(b, 0, 1.00390625)       # halfway between two bf16 values: rounds to even (1.0)
    ggml.set_f32_1d(b, 1, -3.5)
    assert [ggml.get_f32_1d(b, 0), ggml.get_f32_1d(b, 1)] == [1.0, -3.5]
    assert b.numpy().dtype == np.uint16                          # raw bf16 bits
    i = ggml.new_tensor_1d(ctx, I32, 2)
    ggml.set_i32(i, 2**31 - 1)
    ggml.set_i32_1d(i, 1, -5)
    assert [ggml.get_i32_1d(i, 0), ggml.get_i32_1d(i, 1)] == [2**31 - 1, -5]
    assert ggml.get_f32_nd(i, 1, 0, 0, 0) == -5.0
    with pytest.raises(GGMLError, match="out of range"):
        ggml.get_f32_1d(i, 2)
    q = ggml.new_tensor_1d(ctx, Q4_0, 32)
    with pytest.raises(GGMLError, match="not supported"):
        ggml.get_f32_1d(q, 0)


def test_numpy_shapes_and_strides():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_3d(ctx, F32, 4, 3, 2)
    x = a.numpy()
    assert x.shape == (1, 2, 3, 4) and x.strides == (96, 48, 16, 4) and x.flags.writeable
    p = ggml.permute(ctx, a, 1, 2, 0, 3)
    assert p.numpy().shape == (1, 3, 4, 2) and p.numpy().strides == (96, 16, 4, 48)
    q = ggml.new_tensor_3d(ctx, Q4_0, 64, 2, 3)
    qb = q.numpy()
    assert qb.dtype == np.uint8 and qb.shape == (1, 3, 2, 36) and qb.strides == (216, 72, 36, 1)
    with pytest.raises(GGMLError, match="not dense"):
        ggml.transpose(ctx, q).numpy()
    assert ggml.new_tensor_2d(ctx, F32, 0, 3).numpy().shape == (1, 1, 3, 0)


# --- properties ----------------------------------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ne=st.lists(st.integers(1, 5), min_size=4, max_size=4), axes=st.permutations([0, 1, 2, 3]))
def test_permute_is_numpy_transpose_without_copy(ne, axes):
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_4d(ctx, F32, *ne)
    a.numpy()[...] = np.arange(ggml.nelements(a), dtype=np.float32).reshape(a.numpy().shape)
    p = ggml.permute(ctx, a, *axes)
    inv = [axes.index(k) for k in range(4)]               # p's dim k is a's dim inv[k]
    expected = np.transpose(a.numpy(), [3 - inv[3 - j] for j in range(4)])
    assert np.array_equal(p.numpy(), expected) and np.shares_memory(p.numpy(), a.numpy())
    assert ggml.nbytes(p) == ggml.nbytes(a) == 4 * ggml.nelements(a)
    dense = all(p.ne[i] == 1 or p.nb[i] == 4 * int(np.prod(p.ne[:i])) for i in range(4))
    assert ggml.is_contiguous(p) == dense == p.numpy().flags.c_contiguous
    r = ggml.reshape_1d(ctx, ggml.dup_tensor(ctx, p), ggml.nelements(p))
    assert r.ne == [ggml.nelements(a), 1, 1, 1] and ggml.is_contiguous(r)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), data=st.data())
def test_view_1d_inside_or_refused(n, data):
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_1d(ctx, I32, n)
    a.numpy()[...] = np.arange(n)
    k = data.draw(st.integers(0, n + 3))
    offs = 4 * data.draw(st.integers(0, n + 3))
    used = ggml.used_mem(ctx)
    if k == 0 or 4 * k + offs <= 4 * n:
        v = ggml.view_1d(ctx, a, k, offs)
        assert v.numpy().reshape(-1).tolist() == list(range(offs // 4, offs // 4 + k))
    else:
        with pytest.raises(GGMLError, match=rf"{4 * k} \+ {offs} > {4 * n}"):
            ggml.view_1d(ctx, a, k, offs)
        assert ggml.used_mem(ctx) == used


# --- lifetime: a tensor whose memory is gone ----------------------------------------------------------

def _callers_pool(nbytes):
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    return raw[(-raw.ctypes.data) % 64:][:nbytes]


def _every_use(t, other):
    """Each function of the tensor layer that takes t, made in the live context `other`."""
    b12 = ggml.new_tensor_1d(other, F32, 12)
    return {
        "numpy": lambda: t.numpy(), "get_f32_1d": lambda: ggml.get_f32_1d(t, 0),
        "set_f32": lambda: ggml.set_f32(t, 1.0), "get_data": lambda: ggml.get_data(t),
        "set_name": lambda: ggml.set_name(t, "z"), "set_input": lambda: ggml.set_input(t),
        "set_output": lambda: ggml.set_output(t), "set_param": lambda: ggml.set_param(t),
        "dup_tensor": lambda: ggml.dup_tensor(other, t), "view_tensor": lambda: ggml.view_tensor(other, t),
        "view_1d": lambda: ggml.view_1d(other, t, 2, 0), "view_2d": lambda: ggml.view_2d(other, t, 2, 2, 16, 0),
        "reshape_1d": lambda: ggml.reshape_1d(other, t, 12),
        "reshape": lambda: ggml.reshape(other, b12, t),
        "permute": lambda: ggml.permute(other, t, 1, 0, 2, 3), "transpose": lambda: ggml.transpose(other, t),
    }


def test_a_tensor_of_a_freed_owned_pool_is_refused_everywhere():
    ctx = ggml.init(1 << 16)
    a = ggml.set_name(ggml.new_tensor_2d(ctx, F32, 4, 3), "a")
    other = ggml.init(1 << 16)
    ggml.free(ctx)
    assert not ggml.context.tensor_is_alive(a)
    uses = _every_use(a, other)
    used = ggml.used_mem(other)
    for where, use in uses.items():
        with pytest.raises(GGMLError) as e:
            use()
        assert "tensor 'a' is gone: its context was freed (ggml_free) together with the memory pool " \
               "it owned" in str(e.value), where
        assert ggml.used_mem(other) == used, where                # nothing half-built
    with pytest.raises(GGMLError, match=r"^where: tensor 'a' is gone"):
        ggml.context.tensor_check_alive(a, "where")


def test_a_reset_pool_kills_its_tensors_and_names_unnamed_ones():
    ctx = ggml.init(1 << 16)
    t = ggml.new_tensor_2d(ctx, F16, 4, 3)
    ggml.reset(ctx)
    with pytest.raises(GGMLError, match=r"numpy: tensor \(unnamed, f16 ne=\[4, 3, 1, 1\]\) is gone: "
                                        r"its context was reset \(ggml_reset\)"):
        t.numpy()
    fresh = ggml.new_tensor_2d(ctx, F16, 4, 3)                   # the same bytes, a new descriptor
    assert fresh.data == t.data and ggml.context.tensor_is_alive(fresh) and not ggml.context.tensor_is_alive(t)


def test_tensors_in_callers_memory_outlive_free():
    """ggml_free frees mem_buffer only when the context allocated it (mem_buffer_owned)."""
    buf = _callers_pool(1 << 16)
    ctx = ggml.init(len(buf), mem_buffer=buf)
    a = ggml.set_name(ggml.new_tensor_2d(ctx, F32, 4, 3), "a")
    a.numpy()[...] = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    ggml.free(ctx)
    assert ggml.context.tensor_is_alive(a)
    other = ggml.init(1 << 16)
    at = ggml.transpose(other, a)
    assert ggml.get_f32_1d(at, 1) == 4.0                          # read through a view in another context
    for where, use in _every_use(a, other).items():              # every use works
        use()
    assert a.numpy().base is not None and ggml.get_data(a) == buf.ctypes.data + 32 + 336
    with pytest.raises(GGMLError, match="the context was freed"):
        ggml.new_tensor_1d(ctx, F32, 4)                           # but the context itself is gone


def test_a_view_of_a_tensor_whose_memory_is_gone_is_refused():
    src_ctx = ggml.init(1 << 16)
    a = ggml.set_name(ggml.new_tensor_1d(src_ctx, F32, 8), "a")
    views = ggml.init(1 << 16)
    v = ggml.set_name(ggml.view_1d(views, a, 4, 0), "v")
    ggml.free(src_ctx)
    with pytest.raises(GGMLError, match=r"get_f32_1d: tensor 'v' is gone: the tensor it views, 'a', is gone: "
                                        r"its context was freed"):
        ggml.get_f32_1d(v, 0)
    assert not ggml.context.tensor_is_alive(v)


# --- core's checks, which every layer (the pool first) uses ----------------------------------------

from ggml_lite.core import as_bytes, check_index, require  # noqa: E402
from ggml_lite.graph import GraphFullError  # noqa: E402


def test_require_says_where_what_and_the_numbers():
    require(True, "f", "never formatted")
    with pytest.raises(GGMLError, match=r"^mul_mat: GGML_ASSERT\(a\.ne\[0\] == b\.ne\[0\]\) failed: 3 != 4$"):
        require(3 == 4, "mul_mat", "3 != 4", assertion="a.ne[0] == b.ne[0]")
    with pytest.raises(GGMLError, match=r"^init: mem_size = -1 is negative$"):
        require(False, "init", "mem_size = -1 is negative")
    with pytest.raises(GraphFullError, match="full"):
        require(False, "graph_add_node", "full", error=GraphFullError)
    calls = []
    require(True, "f", lambda: calls.append(1) or "x")      # a lazy message is built only on failure
    assert calls == []
    with pytest.raises(GGMLError, match="^f: built$"):
        require(False, "f", lambda: "built")


def test_check_index():
    assert check_index(0, 1, "f", "x") == 0
    for i in (-1, 3):
        with pytest.raises(GGMLError, match=rf"^f: index {i} out of range \[0, 3\) for 'x'$"):
            check_index(i, 3, "f", "'x'")


def test_as_bytes_reads_any_bytes_and_writes_only_into_the_callers_memory():
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    assert as_bytes(a, "f").tobytes() == a.tobytes()
    assert as_bytes(a.T, "f").tobytes() == np.ascontiguousarray(a.T).tobytes()   # C order, a copy
    assert as_bytes(b"\x01\x02", "f").tolist() == [1, 2]
    buf = bytearray(4)
    as_bytes(buf, "f", writable=True)[1] = 7
    assert buf[1] == 7
    w = np.zeros(4, np.float32)
    as_bytes(w, "f", writable=True)[0:4] = np.frombuffer(np.float32(1.5).tobytes(), np.uint8)
    assert w[0] == 1.5
    with pytest.raises(GGMLError, match="^f: data must be writable"):
        as_bytes(b"ab", "f", writable=True)
    with pytest.raises(GGMLError, match="^f: mem_buffer must be a writable, C-contiguous array"):
        as_bytes(a.T, "f", writable=True, what="mem_buffer")
    with pytest.raises(GGMLError, match="^f: data must be a numpy array or a bytes-like object, not list"):
        as_bytes([1, 2], "f")


def test_init_refuses_a_pool_it_would_have_to_copy():
    with pytest.raises(GGMLError, match="init: mem_buffer must be writable"):
        ggml.init(16, mem_buffer=bytes(16))
    with pytest.raises(GGMLError, match="init: mem_buffer must be a writable, C-contiguous array"):
        ggml.init(16, mem_buffer=np.zeros((8, 8), np.uint8)[:, ::2])


def test_pool_exhausted_names_the_call_that_ran_out():
    ctx = ggml.init(1000)
    with pytest.raises(GGMLError, match=r"^new_tensor_2d: not enough space in the context's memory pool "
                                        r"\(needed 5168, available 1008\)$"):
        ggml.new_tensor_2d(ctx, F32, 40, 30)
    with pytest.raises(GGMLError, match=r"^new_graph_custom: not enough space in the context's memory pool"):
        ggml.new_graph(ctx)


def test_repr_names_the_op():
    ctx = ggml.init(1 << 16)
    a = ggml.new_tensor_2d(ctx, F32, 4, 3)
    assert repr(a) == "Tensor(name='', type=f32, ne=[4, 3, 1, 1], nb=[4, 16, 48, 48], op=NONE)"
    assert repr(ggml.view_1d(ctx, a, 4, 0)).endswith(", op=VIEW)")
    assert repr(ggml.reshape_2d(ctx, a, 6, 2)).endswith(", op=RESHAPE)")
    assert repr(ggml.permute(ctx, a, 1, 0, 2, 3)).endswith(", op=PERMUTE)")
    assert repr(ggml.transpose(ctx, a)).endswith(", op=TRANSPOSE)")
    assert repr(ggml.mul_mat(ctx, a, a)).endswith(", op=MUL_MAT)")
