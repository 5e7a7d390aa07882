"""ggml_lite seen the way graph_ref.py sees real ggml, so that the two descriptions compare field by field."""
import io
import re

import ggml_lite


class Lite:
    """ggml_lite itself, plus the one helper the scenarios need that is a struct write in C."""

    def __getattr__(self, name):
        return getattr(ggml_lite, name)

    @staticmethod
    def set_eval_order(gf, order):
        gf.order = ggml_lite.graph.EvalOrder(order)


def describe(ctx, graphs):
    """The same record as graph_ref.describe, from ggml_lite objects."""
    base = ctx.base
    tensors = list(ctx)
    index = {id(t): i for i, t in enumerate(tensors)}
    offs = {id(obj.payload): obj.offs for obj in ctx.objects if obj.type == ggml_lite.context.ObjectType.TENSOR}
    address = {f"{base + offs[id(t)]:#x}": i for i, t in enumerate(tensors)}

    def idx(t):
        return index[id(t)] if t is not None else None

    out_tensors = []
    for t in tensors:
        src = [idx(s) for s in t.src]
        while src and src[-1] is None:
            src.pop()
        out_tensors.append({
            "name": t.name, "type": int(t.type), "op": int(t.op),
            "ne": [int(n) for n in t.ne], "nb": [int(n) for n in t.nb],
            "op_params": [int(w) for w in t.op_params], "flags": int(t.flags), "src": src,
            "view_src": idx(t.view_src), "view_offs": int(t.view_offs),
            "offs": offs[id(t)], "data_offs": (t.data - base) if t.data else None,
        })
    out_graphs = {}
    for name, gf in graphs.items():
        printed = io.StringIO()
        ggml_lite.graph_print(gf, file=printed)
        dot = ggml_lite.graph_dump_dot(gf, None, None)
        dot = re.sub(r'"(0x[0-9a-f]+)"', lambda m: f'"t{address[m.group(1)]}"', dot)
        out_graphs[name] = {
            "size": gf.size, "n_nodes": gf.n_nodes, "n_leafs": gf.n_leafs,
            "nodes": [index[id(n)] for n in gf.nodes],
            "leafs": [index[id(n)] for n in gf.leafs],
            "use_counts": [gf.use_counts[id(n)] for n in gf.nodes],
            "offs": gf.offs,
            "print": printed.getvalue(), "dot": dot,
        }
    return {"mem_size": ctx.mem_size, "used_mem": ggml_lite.used_mem(ctx),
            "tensors": out_tensors, "graphs": out_graphs}
