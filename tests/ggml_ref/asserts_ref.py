#!/usr/bin/env python3
"""Run the calls of tests/ggml_ref/asserts_scenarios.py against real ggml; write tests/data/asserts_ref.json.

Each case runs in its own child process, since a bad call makes ggml abort. For a call ggml
refuses, the file keeps the child's return code and the last line of its stderr (the
GGML_ASSERT that failed); for a call ggml accepts, the descriptor of the tensor R it made
(type, op, ne, nb, op_params, src and view_src as creation indices, view_offs) and used_mem.
Each case also keeps its code, so the record reads on its own (the ops chapter replays it).
tests/test_ops.py reads the file and never needs ggml-python. Regenerate (ggml-python 0.0.45
bundles ggml 0.15.3):

    GGML_PY=/path/to/venv-with-ggml-python/bin/python
    GGML_NO_BACKTRACE=1 $GGML_PY tests/ggml_ref/asserts_ref.py
"""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE.parent / "data" / "asserts_ref.json"

CHILD = r"""
import ctypes, json, sys
sys.path.insert(0, {here!r})
import ggml.ggml as g
from graph_ref import GgmlPy, addr
from asserts_scenarios import CASES, PRELUDE

class G2(GgmlPy):
    @staticmethod
    def rope_multi(ctx, a, b, c, n_dims, sections, *rest):
        return g.ggml_rope_multi(ctx, a, b, c, n_dims, (ctypes.c_int * 4)(*sections), *rest)

G = G2(); T = G.Type
ctx = G.init(1 << 20, None, False)
scope = {{"G": G, "T": T, "ctx": ctx}}
exec(PRELUDE, scope)
exec(CASES[{name!r}], scope)
R = scope.get("R")
tensors = []
t = g.ggml_get_first_tensor(ctx)
while t:
    tensors.append(t)
    t = g.ggml_get_next_tensor(ctx, t)
index = {{addr(t): i for i, t in enumerate(tensors)}}
c = R.contents
src = [index[addr(c.src[j])] if c.src[j] else None for j in range(10)]
while src and src[-1] is None:
    src.pop()
print(json.dumps({{"type": c.type, "op": c.op, "ne": list(c.ne), "nb": list(c.nb),
                  "op_params": list(c.op_params), "src": src,
                  "view_src": index[addr(c.view_src)] if c.view_src else None,
                  "view_offs": c.view_offs, "index": index[addr(R)],
                  "used_mem": g.ggml_used_mem(ctx)}}))
"""


def run_case(name):
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    r = subprocess.run([sys.executable, "-c", CHILD.format(here=str(HERE), name=name)],
                       capture_output=True, text=True, env=env)
    if r.returncode == 0:
        return {"ok": True, "result": json.loads(r.stdout.strip().splitlines()[-1])}
    lines = r.stderr.strip().splitlines()
    last = lines[-1].split(": ", 1)[-1] if lines and ".c:" in lines[-1] else (lines[-1] if lines else "")
    return {"ok": False, "returncode": r.returncode, "assert": last}


def main():
    sys.path.insert(0, str(HERE))
    import ggml.ggml as g
    from asserts_scenarios import CASES
    out = {"ggml_version": g.ggml_version().decode(), "cases": {}}
    for name in CASES:
        out["cases"][name] = {"code": CASES[name], **run_case(name)}
        res = out["cases"][name]
        print(f"{name:32s} " + ("ok" if res["ok"] else f"rc={res['returncode']} {res['assert']}"))
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    n_bad = sum(not c["ok"] for c in out["cases"].values())
    print(f"ggml {out['ggml_version']}: {len(CASES)} calls, {n_bad} refused; wrote {OUT}")


if __name__ == "__main__":
    main()
