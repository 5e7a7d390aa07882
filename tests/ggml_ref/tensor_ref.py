"""Ask real ggml (through ggml-python) for the numbers that tests/test_tensor.py states.

Not part of the test run: the tests hard-code what this script printed, so they need no ggml.
Re-run it (ggml-python builds real ggml from source; see shared/reference/book-tooling.md):

    python3 -m venv /tmp/ggmlpy && /tmp/ggmlpy/bin/pip install ggml-python
    /tmp/ggmlpy/bin/python tests/ggml_ref/tensor_ref.py > /tmp/tensor_ref.json

It prints one JSON object. Cases that make ggml abort (pool exhausted, view out of bounds,
reshape of a non-contiguous tensor) run in a child process; their stderr is reported.
"""
import ctypes
import json
import subprocess
import sys

import ggml

F32, F16, I32, Q4_0, Q4_K = (ggml.GGML_TYPE_F32, ggml.GGML_TYPE_F16, ggml.GGML_TYPE_I32,
                             ggml.GGML_TYPE_Q4_0, ggml.GGML_TYPE_Q4_K)


def init(mem_size, no_alloc=False):
    return ggml.ggml_init(ggml.ggml_init_params(mem_size=mem_size, mem_buffer=None, no_alloc=no_alloc))


def desc(ctx, t):
    """Everything a test compares, for one tensor."""
    c = t.contents
    base = ggml.ggml_get_mem_buffer(ctx)
    vs = c.view_src
    return {
        "name": ggml.ggml_get_name(t).decode(),
        "type": c.type,
        "ne": list(c.ne),
        "nb": list(c.nb),
        "op": c.op,
        "op_params": list(c.op_params),
        "flags": c.flags,
        "view_src": ggml.ggml_get_name(vs).decode() if vs else None,
        "view_offs": c.view_offs,
        "data_offs": (c.data - base) if c.data else None,
        "nbytes": ggml.ggml_nbytes(t),
        "nelements": ggml.ggml_nelements(t),
        "nrows": ggml.ggml_nrows(t),
        "is_contiguous": bool(ggml.ggml_is_contiguous(t)),
        "is_contiguous_1": bool(ggml.ggml_is_contiguous_1(t)),
        "is_contiguous_2": bool(ggml.ggml_is_contiguous_2(t)),
        "is_contiguous_rows": bool(ggml.ggml_is_contiguous_rows(t)),
        "is_contiguously_allocated": bool(ggml.ggml_is_contiguously_allocated(t)),
        "is_transposed": bool(ggml.ggml_is_transposed(t)),
        "is_permuted": bool(ggml.ggml_is_permuted(t)),
    }


def pool():
    """Used bytes after each creation, and where each tensor's data lands."""
    out = {"tensor_overhead": ggml.ggml_tensor_overhead(), "graph_overhead": ggml.ggml_graph_overhead()}
    ctx = init(1 << 20)
    steps = []
    for name, make in [
        ("f32_10", lambda: ggml.ggml_new_tensor_1d(ctx, F32, 10)),
        ("f16_5x3", lambda: ggml.ggml_new_tensor_2d(ctx, F16, 5, 3)),
        ("q4_0_64x2x3", lambda: ggml.ggml_new_tensor_3d(ctx, Q4_0, 64, 2, 3)),
        ("q4_k_256x2", lambda: ggml.ggml_new_tensor_2d(ctx, Q4_K, 256, 2)),
        ("i32_7x1x1x2", lambda: ggml.ggml_new_tensor_4d(ctx, I32, 7, 1, 1, 2)),
        ("f32_empty", lambda: ggml.ggml_new_tensor_2d(ctx, F32, 0, 3)),
    ]:
        t = make()
        ggml.ggml_set_name(t, name.encode())
        d = desc(ctx, t)
        d["used_mem"] = ggml.ggml_used_mem(ctx)
        steps.append(d)
    dup = ggml.ggml_dup_tensor(ctx, ggml.ggml_get_tensor(ctx, b"f16_5x3"))
    d = desc(ctx, dup)
    d["used_mem"] = ggml.ggml_used_mem(ctx)
    steps.append(d)
    out["alloc"] = steps
    out["iteration"] = []
    t = ggml.ggml_get_first_tensor(ctx)
    while t:
        out["iteration"].append(ggml.ggml_get_name(t).decode())
        t = ggml.ggml_get_next_tensor(ctx, t)
    ggml.ggml_free(ctx)

    ctx = init(1 << 20, no_alloc=True)
    used = []
    for _ in range(3):
        t = ggml.ggml_new_tensor_2d(ctx, F32, 1000, 1000)
        used.append((ggml.ggml_used_mem(ctx), t.contents.data or 0))
    out["no_alloc_used"] = used
    ggml.ggml_free(ctx)

    sizes = {}
    for m in (0, 1, 100, 1000, 1024):
        ctx = init(m)
        sizes[m] = ggml.ggml_get_mem_size(ctx)
        ggml.ggml_free(ctx)
    out["mem_size_rounding"] = sizes
    return out


def views():
    ctx = init(1 << 20)
    a = ggml.ggml_new_tensor_3d(ctx, F32, 4, 3, 2)
    ggml.ggml_set_name(a, b"a")
    b = ggml.ggml_new_tensor_2d(ctx, F32, 8, 3)
    ggml.ggml_set_name(b, b"b")
    q = ggml.ggml_new_tensor_2d(ctx, Q4_0, 64, 3)
    ggml.ggml_set_name(q, b"q")
    made = {}
    made["view_tensor"] = ggml.ggml_view_tensor(ctx, a)
    made["view_1d"] = ggml.ggml_view_1d(ctx, a, 5, 8)
    made["view_2d"] = ggml.ggml_view_2d(ctx, a, 2, 3, a.contents.nb[1], 4)
    made["view_3d"] = ggml.ggml_view_3d(ctx, a, 2, 3, 2, a.contents.nb[1], a.contents.nb[2], 8)
    made["view_4d"] = ggml.ggml_view_4d(ctx, a, 4, 3, 1, 2, a.contents.nb[1], a.contents.nb[2], a.contents.nb[2], 0)
    made["view_of_view"] = ggml.ggml_view_1d(ctx, made["view_2d"], 2, 16)
    made["reshape"] = ggml.ggml_reshape(ctx, a, b)
    made["reshape_1d"] = ggml.ggml_reshape_1d(ctx, a, 24)
    made["reshape_2d"] = ggml.ggml_reshape_2d(ctx, a, 6, 4)
    made["reshape_3d"] = ggml.ggml_reshape_3d(ctx, a, 2, 6, 2)
    made["reshape_4d"] = ggml.ggml_reshape_4d(ctx, a, 2, 2, 3, 2)
    made["permute_1203"] = ggml.ggml_permute(ctx, a, 1, 2, 0, 3)
    made["permute_2013"] = ggml.ggml_permute(ctx, a, 2, 0, 1, 3)
    made["permute_0213"] = ggml.ggml_permute(ctx, a, 0, 2, 1, 3)
    made["transpose"] = ggml.ggml_transpose(ctx, b)
    made["transpose_of_permute"] = ggml.ggml_transpose(ctx, made["permute_0213"])
    made["view_tensor_of_view"] = ggml.ggml_view_tensor(ctx, made["view_1d"])
    made["dup_of_permute"] = ggml.ggml_dup_tensor(ctx, made["permute_1203"])
    made["q_view_2d"] = ggml.ggml_view_2d(ctx, q, 32, 2, q.contents.nb[1], q.contents.nb[1])
    made["q_transpose"] = ggml.ggml_transpose(ctx, q)
    made["q_reshape"] = ggml.ggml_reshape_1d(ctx, q, 192)
    # unusual strides for the contiguity predicates
    made["rows_gap"] = ggml.ggml_view_2d(ctx, b, 4, 3, b.contents.nb[1], 0)
    made["one_row_gap"] = ggml.ggml_view_3d(ctx, a, 4, 1, 2, 100, a.contents.nb[2], 0)
    made["strided_cols"] = ggml.ggml_view_2d(ctx, b, 4, 3, b.contents.nb[1], 0)
    made["strided_cols"].contents.nb[0] = 8
    made["planes_gap"] = ggml.ggml_view_3d(ctx, a, 4, 2, 2, a.contents.nb[1], a.contents.nb[2], 0)
    out = {"a": desc(ctx, a), "b": desc(ctx, b), "q": desc(ctx, q)}
    for k, t in made.items():
        out[k] = desc(ctx, t)
    long = ggml.ggml_new_tensor_1d(ctx, F32, 4)
    ggml.ggml_set_name(long, b"x" * 80)
    out["long_name"] = ggml.ggml_get_name(long).decode()
    out["long_name_view"] = ggml.ggml_get_name(ggml.ggml_view_tensor(ctx, long)).decode()
    ggml.ggml_set_name(long, b"y" * 60)
    out["name60_permuted"] = ggml.ggml_get_name(ggml.ggml_permute(ctx, long, 0, 1, 2, 3)).decode()
    ggml.ggml_format_name(long, b"%s-%d", b"blk", ctypes.c_int(12))
    out["format_name"] = ggml.ggml_get_name(long).decode()
    out["used_mem"] = ggml.ggml_used_mem(ctx)
    ggml.ggml_free(ctx)
    return out


def flags():
    ctx = init(1 << 20)
    a = ggml.ggml_new_tensor_2d(ctx, F32, 4, 3)
    v = ggml.ggml_view_2d(ctx, a, 4, 2, a.contents.nb[1], 0)
    vv = ggml.ggml_view_1d(ctx, v, 4, 0)
    ggml.ggml_set_output(vv)
    out = {"set_output_view": [a.contents.flags, v.contents.flags, vv.contents.flags]}
    ggml.ggml_set_input(a)
    ggml.ggml_set_param(a)
    out["input_param"] = a.contents.flags
    s = ggml.ggml_new_tensor_1d(ctx, F32, 1)
    ggml.ggml_set_loss(s)
    out["loss"] = s.contents.flags
    ggml.ggml_free(ctx)
    return out


def access():
    """get/set through ggml's CPU helpers on contiguous and transposed tensors."""
    ggml.ggml_cpu_init()  # fills the fp16 tables that the CPU get/set helpers use
    ctx = init(1 << 20)
    a = ggml.ggml_new_tensor_2d(ctx, F32, 3, 2)
    for i in range(6):
        ggml.ggml_set_f32_1d(a, i, 10.0 * i + 0.75)
    t = ggml.ggml_transpose(ctx, a)
    out = {"transposed_get": [ggml.ggml_get_f32_1d(t, i) for i in range(6)]}
    ggml.ggml_set_f32_1d(t, 1, -1.5)  # logical element 1 of the transposed view
    out["after_set_through_transpose"] = [ggml.ggml_get_f32_1d(a, i) for i in range(6)]
    out["get_i32_of_f32"] = [ggml.ggml_get_i32_1d(a, i) for i in range(6)]
    h = ggml.ggml_new_tensor_1d(ctx, F16, 3)
    for i, v in enumerate((0.1, 65519.0, -2.5e-8)):
        ggml.ggml_set_f32_1d(h, i, v)
    out["f16_roundtrip"] = [ggml.ggml_get_f32_1d(h, i) for i in range(3)]
    n = ggml.ggml_new_tensor_1d(ctx, I32, 3)
    for i, v in enumerate((2.9, -2.9, 7.0)):
        ggml.ggml_set_f32_1d(n, i, v)
    out["i32_from_f32"] = [ggml.ggml_get_i32_1d(n, i) for i in range(3)]
    ggml.ggml_set_f32(a, 2.5)
    out["set_f32"] = [ggml.ggml_get_f32_1d(a, i) for i in range(6)]
    ggml.ggml_free(ctx)
    return out


CHILD = {
    "pool_exhausted": """
ctx = init(1000)
ggml.ggml_new_tensor_1d(ctx, F32, 100)
print("used", ggml.ggml_used_mem(ctx), flush=True)
ggml.ggml_new_tensor_1d(ctx, F32, 100)
""",
    "exact_fit": """
sizes = [(F32, (10,)), (F16, (5, 3)), (Q4_0, (64, 2))]
need = 0
for typ, ne in sizes:
    nb = ggml.ggml_row_size(typ, ne[0]) * (ne[1] if len(ne) > 1 else 1)
    need += ggml.ggml_tensor_overhead() + (nb + 15) // 16 * 16
ctx = init(need)
ggml.ggml_new_tensor_1d(ctx, F32, 10); ggml.ggml_new_tensor_2d(ctx, F16, 5, 3); ggml.ggml_new_tensor_2d(ctx, Q4_0, 64, 2)
print("need", need, "used", ggml.ggml_used_mem(ctx), "size", ggml.ggml_get_mem_size(ctx), flush=True)
ggml.ggml_new_tensor_1d(ctx, I32, 1)
""",
    "view_out_of_bounds": """
ctx = init(1 << 16)
a = ggml.ggml_new_tensor_1d(ctx, F32, 10)
ggml.ggml_view_1d(ctx, a, 4, 24)
print("ok at 24", flush=True)
ggml.ggml_view_1d(ctx, a, 4, 28)
""",
    "reshape_non_contiguous": """
ctx = init(1 << 16)
a = ggml.ggml_new_tensor_2d(ctx, F32, 4, 3)
ggml.ggml_reshape_1d(ctx, ggml.ggml_transpose(ctx, a), 12)
""",
    "permute_bad_axes": """
ctx = init(1 << 16)
a = ggml.ggml_new_tensor_2d(ctx, F32, 4, 3)
ggml.ggml_permute(ctx, a, 0, 0, 1, 2)
""",
}


def child(name):
    r = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                       env={"GGML_NO_BACKTRACE": "1", "PATH": "/usr/bin:/bin"})
    return {"rc": r.returncode, "stdout": r.stdout.strip().splitlines(),
            "stderr": [l for l in r.stderr.strip().splitlines() if l][:3]}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        exec(CHILD[sys.argv[2]])
        sys.exit(0)
    out = {"pool": pool(), "views": views(), "flags": flags(), "access": access(),
           "aborts": {k: child(k) for k in CHILD}}
    print(json.dumps(out, indent=1))
