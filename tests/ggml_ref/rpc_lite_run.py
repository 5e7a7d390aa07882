"""ggml_lite's side of the RPC scenarios (rpc_scenarios.py): build, place in a backend's buffer,
set the inputs, compute, read the output's bytes. Imported by tests/test_rpc.py; run as a script
by rpc_ref.py (with the project's venv python) to compute on a real ggml rpc-server:

    python tests/ggml_ref/rpc_lite_run.py HOST:PORT      prints {scenario: output bytes (hex)} as JSON
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np                      # noqa: E402

import ggml_lite as ggml                # noqa: E402
import rpc_scenarios as S               # noqa: E402


def run_scenario(backend, name):
    """The output's raw bytes of scenario name computed on backend."""
    ctx = ggml.init(mem_size=64 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    inputs, out = S.build(ggml, ctx, name)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, out)
    buf = ggml.backend_alloc_ctx_tensors(ctx, backend)
    try:
        for tname, t in inputs.items():
            ggml.backend_tensor_set(t, S.input_bytes(name, tname, ggml.nbytes(t), ggml.type_name(t.type)))
        status = ggml.backend_graph_compute(backend, gf)
        assert status == ggml.Status.SUCCESS, status
        return ggml.backend_tensor_get(out, offset=0, size=ggml.nbytes(out)).tobytes()
    finally:
        ggml.backend_buffer_free(buf)
        ggml.free(ctx)


def output_values(name, raw):
    """The output of scenario name as float32 (its type is F32 or F16)."""
    ctx = ggml.init(mem_size=64 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    _, out = S.build(ggml, ctx, name)
    dtype = np.float16 if out.type == ggml.Type.F16 else np.float32
    return np.frombuffer(raw, dtype).astype(np.float32)


if __name__ == "__main__":
    backend = ggml.backend_rpc_init(sys.argv[1], 0)
    print(json.dumps({name: run_scenario(backend, name).hex() for name in S.SCENARIOS}))
