#!/usr/bin/env python3
"""Run tests/ggml_ref/graph_scenarios.py against real ggml; write what ggml computed to tests/data/graph_ref.json.

The tests (tests/test_graph.py, tests/test_ops.py) read graph_ref.json and never need ggml-python.
To re-run (about 1 minute to build ggml the first time):

    python3 -m venv /tmp/ggmlpy && /tmp/ggmlpy/bin/pip install ggml-python==0.0.45 numpy
    GGML_NO_BACKTRACE=1 /tmp/ggmlpy/bin/python tests/ggml_ref/graph_ref.py

ggml-python 0.0.45 bundles ggml 0.15.3. For every scenario this records, per tensor in creation
order: name, type, op, ne, nb, the 16 op_params words, flags, src (as creation indices), view_src,
view_offs, the byte offset of the tensor object and of its data in the context's pool; per graph:
size, nodes and leafs (creation indices), each node's use count, the pool offset of the graph
object, ggml_graph_print's text and ggml_graph_dump_dot's text (pointers replaced by "t<index>").
It also runs each bad call of the tests in a child process and records the assertion ggml aborts with.
"""
import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import ggml.ggml as g

sys.path.insert(0, str(Path(__file__).parent))
import graph_scenarios as scenarios  # noqa: E402

OUT = Path(__file__).parent.parent / "data" / "graph_ref.json"


class _Types:
    def __getattr__(self, name):
        return getattr(g, f"GGML_TYPE_{name}")


class GgmlPy:
    """ggml-python with ggml_lite's calling convention (no prefix, Python strings, init(mem, buf, no_alloc))."""
    Type = _Types()

    def __getattr__(self, name):
        return getattr(g, f"ggml_{name}")

    @staticmethod
    def init(mem_size, mem_buffer=None, no_alloc=False):
        return g.ggml_init(g.ggml_init_params(mem_size=mem_size, mem_buffer=mem_buffer, no_alloc=no_alloc))

    @staticmethod
    def set_name(t, name):
        return g.ggml_set_name(t, name.encode())

    @staticmethod
    def set_param(t):
        return g.ggml_set_param(t)

    @staticmethod
    def build_forward_select(gf, tensors, n, idx):
        arr = (ctypes.POINTER(g.ggml_tensor) * n)(*tensors[:n])
        return g.ggml_build_forward_select(gf, arr, n, idx)

    @staticmethod
    def set_eval_order(gf, order):
        """Not an API call in ggml: the field cgraph->order, written through the struct."""
        gf.contents.order = order


def addr(p):
    return ctypes.cast(p, ctypes.c_void_p).value


@contextlib.contextmanager
def captured_stderr():
    """ggml logs to file descriptor 2; catch it in a file."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        box = {}
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            box["text"] = f.read().decode()


def hash_find(cg, ptr):
    """ggml_hash_find: slot (ptr >> 4) % size, linear probing over used slots."""
    hs = cg.visited_hash_set
    size = hs.size
    h = (ptr >> 4) % size
    i = h
    while (hs.used[i // 32] >> (i % 32)) & 1:
        if addr(hs.keys[i]) == ptr:
            return i
        i = (i + 1) % size
        assert i != h
    return i


def describe(ctx, graphs):
    base = g.ggml_get_mem_buffer(ctx)
    tensors = []
    t = g.ggml_get_first_tensor(ctx)
    while t:
        tensors.append(t)
        t = g.ggml_get_next_tensor(ctx, t)
    index = {addr(t): i for i, t in enumerate(tensors)}

    def idx(p):
        return index[addr(p)] if p else None

    out_tensors = []
    for t in tensors:
        c = t.contents
        src = [idx(c.src[j]) for j in range(10)]
        while src and src[-1] is None:
            src.pop()
        out_tensors.append({
            "name": c.name.decode(), "type": c.type, "op": c.op,
            "ne": list(c.ne), "nb": list(c.nb),
            "op_params": list(c.op_params), "flags": c.flags, "src": src,
            "view_src": idx(c.view_src), "view_offs": c.view_offs,
            "offs": addr(t) - base,
            "data_offs": (c.data - base) if c.data else None,
        })
    out_graphs = {}
    for name, gp in graphs.items():
        cg = gp.contents
        with captured_stderr() as printed:
            g.ggml_graph_print(gp)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "g.dot")
            with captured_stderr():
                g.ggml_graph_dump_dot(gp, None, path.encode())
            dot = Path(path).read_text()
        dot = re.sub(r'"(0x[0-9a-f]+)"', lambda m: f'"t{index[int(m.group(1), 16)]}"', dot)
        nodes = [index[addr(cg.nodes[i])] for i in range(cg.n_nodes)]
        out_graphs[name] = {
            "size": cg.size, "n_nodes": cg.n_nodes, "n_leafs": cg.n_leafs,
            "nodes": nodes,
            "leafs": [index[addr(cg.leafs[i])] for i in range(cg.n_leafs)],
            "use_counts": [cg.use_counts[hash_find(cg, addr(cg.nodes[i]))] for i in range(cg.n_nodes)],
            "offs": addr(gp) - base,
            "print": printed["text"], "dot": dot,
        }
    return {"mem_size": g.ggml_get_mem_size(ctx), "used_mem": g.ggml_used_mem(ctx),
            "tensors": out_tensors, "graphs": out_graphs}


# each bad call of graph_scenarios.BAD_CALLS in a child process: ggml aborts, we keep the lines that say why
def bad_call_messages():
    out = {}
    for name, code in scenarios.BAD_CALLS.items():
        prog = ("import sys; sys.path.insert(0, %r)\nfrom graph_ref import GgmlPy\nG=GgmlPy(); T=G.Type\n"
                "ctx=G.init(1<<20,None,False)\n%s\n") % (str(Path(__file__).parent), code)
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, env=env)
        lines = [ln.split(": ", 1)[-1] if "ggml" in ln and ".c:" in ln else ln
                 for ln in r.stderr.strip().splitlines()]
        out[name] = {"returncode": r.returncode, "stderr": lines}
    return out


def main():
    G = GgmlPy()
    g.lib.ggml_hash_size.argtypes, g.lib.ggml_hash_size.restype = [ctypes.c_size_t], ctypes.c_size_t
    result = {
        "ggml_version": g.ggml_version().decode(),
        "tensor_overhead": g.ggml_tensor_overhead(),
        "graph_overhead": g.ggml_graph_overhead(),
        "graph_overhead_custom": [[s, gr, g.ggml_graph_overhead_custom(s, gr)] for s, gr in scenarios.OVERHEADS],
        "hash_size": [[n, g.lib.ggml_hash_size(n)] for n in scenarios.HASH_SIZES],
        "op_names": [g.ggml_op_name(i).decode() for i in range(g.GGML_OP_COUNT)],
        "op_symbols": [g.ggml_op_symbol(i).decode() for i in range(g.GGML_OP_COUNT)],
        "unary_op_names": [g.ggml_unary_op_name(i).decode() for i in range(g.GGML_UNARY_OP_COUNT)],
        "glu_op_names": [g.ggml_glu_op_name(i).decode() for i in range(g.GGML_GLU_OP_COUNT)],
        "scenarios": {},
    }
    for name, build in scenarios.SCENARIOS.items():
        ctx, graphs = build(G)
        result["scenarios"][name] = describe(ctx, graphs)
        g.ggml_free(ctx)
    result["bad_calls"] = bad_call_messages()
    OUT.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    s = result["scenarios"]
    print(f"ggml {result['ggml_version']}: wrote {OUT}")
    for name, d in s.items():
        print(f"  {name:22s} used_mem={d['used_mem']:8d} tensors={len(d['tensors']):3d} " +
              " ".join(f"{k}:{v['n_nodes']}n/{v['n_leafs']}l" for k, v in d["graphs"].items()))


if __name__ == "__main__":
    main()
