"""A live check, not a fixture: every case of the oracle harness (tests/backend_ops_cases.py) with
ggml_lite's RPC client computing on a real ggml 0.15.3 rpc-server (its CPU backend), judged by the
harness against its numpy references, as the local CPU backend is. Run from the project root with
the project's venv python:

    GGML_PY=/tmp/ggmlpy/bin/python PYTHONPATH=. .venv/bin/python tests/ggml_ref/rpc_live_check.py

Prints the number of cases, how many pass, and the failures (real ggml's kernels may fail a case
the harness judges by ggml_lite's references; each is listed with its verdict).
"""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import backend_ops_cases as B  # noqa: E402
import ggml_lite as ggml  # noqa: E402


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    real = subprocess.Popen([os.environ["GGML_PY"], str(HERE / "rpc_ref.py"), "--serve", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        backend = ggml.backend_rpc_init(f"127.0.0.1:{port}", 0)
        cases = B.make_test_cases()
        failed = []
        t0 = time.time()
        for case in cases:
            try:
                v = B.eval_case(case, compute=lambda gf, ctx: ggml.backend_graph_compute(backend, gf), no_alloc=True,
                                alloc=lambda ctx: ggml.backend_alloc_ctx_tensors(ctx, backend))
                if not v.ok:
                    failed.append((case.name(), str(v)))
            except ggml.GGMLError as e:
                failed.append((case.name(), f"GGMLError: {e}"))
        print(f"{len(cases)} harness cases on a real ggml rpc-server in {time.time() - t0:.0f} s: "
              f"{len(cases) - len(failed)} pass, {len(failed)} fail")
        for name, why in failed:
            print(f"  {name}: {why[:300]}")
    finally:
        real.kill()


if __name__ == "__main__":
    main()
