"""graph_compute_with_ctx of an unchanged graph: microseconds per node of a chain of 1000 `add`
nodes on 64 floats (kernels with nothing to do), against graph_compute with a plan made once.

    PYTHONPATH=. python bench/with_ctx.py [--threads 1 2] [--out bench/results/with_ctx.json]

ggml plans in C on every ggml_graph_compute_with_ctx; ggml_lite takes the graph's last plan again
while the graph is unchanged (its nodes, their sources, their addresses). A measurement, not a
test: run it on a quiet machine and read it with the load average it prints.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import ggml_lite as ggml

sys.path.insert(0, str(Path(__file__).parent))
from common import measure  # noqa: E402


def chain(n_nodes=1000, ne0=64):
    ctx = ggml.init(mem_size=64 << 20)
    x, one = ggml.new_tensor_1d(ctx, ggml.Type.F32, ne0), ggml.new_tensor_1d(ctx, ggml.Type.F32, ne0)
    x.numpy()[...], one.numpy()[...] = 1.0, 1.0
    cur = x
    for _ in range(n_nodes):
        cur = ggml.add(ctx, cur, one)
    gf = ggml.new_graph_custom(ctx, n_nodes + 8)
    ggml.build_forward_expand(gf, cur)
    return ctx, gf, cur


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out")
    args = ap.parse_args()
    n = 1000
    runs = []
    load0 = os.getloadavg()
    for nt in args.threads:
        ctx, gf, cur = chain(n)
        plan = ggml.graph_plan(gf, nt)
        with_ctx = measure(lambda: ggml.graph_compute_with_ctx(ctx, gf, nt))
        planned = measure(lambda: ggml.graph_compute(gf, plan))
        ok = float(cur.numpy().reshape(-1)[0]) == 1.0 + n
        row = dict(threads=nt, n_nodes=n, with_ctx_us_per_node=with_ctx["best"] / n * 1e6,
                   graph_compute_us_per_node=planned["best"] / n * 1e6, check=ok)
        runs.append(row)
        print(f"threads {nt}: graph_compute_with_ctx {row['with_ctx_us_per_node']:.2f} µs/node, "
              f"graph_compute with its plan {row['graph_compute_us_per_node']:.2f} µs/node, result {'ok' if ok else 'WRONG'}")
        ggml.free(ctx)
    load = dict(loadavg_before=load0, loadavg_after=os.getloadavg())
    print(f"load average {load0[0]:.2f} before, {load['loadavg_after'][0]:.2f} after")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(runs=runs, machine=dict(n_cpus=os.cpu_count(), **load)), indent=1) + "\n")


if __name__ == "__main__":
    main()
