"""Fixtures for tests/test_rpc.py from real ggml 0.15.3's ggml-rpc: the RPC scenarios of
rpc_scenarios.py run through real ggml's client and server, and across: real client -> ggml_lite
server, ggml_lite client -> real server. A recording proxy sits in front of the real server and
keeps the bytes of each connection, both ways.

    GGML_LITE_PYTHON=<project venv python> /tmp/ggmlpy/bin/python tests/ggml_ref/rpc_ref.py

(run from the project root; ggml-python built with -DGGML_RPC=ON, see README.md). Writes
tests/data/rpc_ref.json: per scenario the output bytes of real ggml's CPU backend computed
locally and of each client/server pair, and the two recorded sessions with the real server.
"""
import base64
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import rpc_scenarios as S  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_real(port):
    """This process becomes real ggml's rpc-server on the CPU device."""
    import ggml as g
    dev = g.ggml_backend_dev_by_type(g.GGML_BACKEND_DEVICE_TYPE_CPU)
    devs = (ctypes.c_void_p * 1)(dev)
    g.ggml_backend_rpc_start_server(f"127.0.0.1:{port}".encode(), None, 1, 1, devs)


class Proxy:
    """Accepts on a free port, forwards to target, records each connection's bytes both ways."""

    def __init__(self, target_port):
        self.target = target_port
        self.sessions = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            c, _ = self.sock.accept()
            s = socket.create_connection(("127.0.0.1", self.target))
            rec = {"c2s": bytearray(), "s2c": bytearray()}
            self.sessions.append(rec)
            threading.Thread(target=self._pump, args=(c, s, rec["c2s"]), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, rec["s2c"]), daemon=True).start()

    @staticmethod
    def _pump(a, b, log):
        while True:
            try:
                d = a.recv(1 << 16)
            except OSError:
                d = b""
            if not d:
                try:
                    b.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            log += d
            b.sendall(d)


class G:
    """ggml-python with ggml_lite's calling convention, for rpc_scenarios.build."""

    def __init__(self, g):
        self.g = g
        self.Type = type("T", (), {n: getattr(g, f"GGML_TYPE_{n}") for n in ("F32", "F16", "Q8_0", "I32")})

    def __getattr__(self, name):
        return getattr(self.g, f"ggml_{name}")

    def set_name(self, t, name):
        return self.g.ggml_set_name(t, name.encode())


def run_real(g, backend, name):
    api = G(g)
    ctx = g.ggml_init(g.ggml_init_params(mem_size=64 * g.ggml_tensor_overhead() + g.ggml_graph_overhead(),
                                         mem_buffer=None, no_alloc=True))
    inputs, out = S.build(api, ctx, name)
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, out)
    buf = g.ggml_backend_alloc_ctx_tensors(ctx, backend)
    for tname, t in inputs.items():
        n = g.ggml_nbytes(t)
        tn = g.ggml_type_name(t.contents.type).decode()
        raw = np.ascontiguousarray(S.input_bytes(name, tname, n, tn))
        g.ggml_backend_tensor_set(t, raw.ctypes.data, 0, n)
    assert g.ggml_backend_graph_compute(backend, gf) == 0
    n = g.ggml_nbytes(out)
    res = np.zeros(n, np.uint8)
    g.ggml_backend_tensor_get(out, res.ctypes.data, 0, n)
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx)
    return res.tobytes().hex()


def start_lite_server(lite_python):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
    p = subprocess.Popen([lite_python, "-m", "ggml_lite.backends.rpc", "--port", "0", "--threads", "1",
                          "--lifetime", "600"], stdout=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:
        m = re.search(r"endpoint\s*: (\S+)", line)
        if m:
            endpoint = m.group(1)
        if "transport" in line:         # from here on it prints a line per connection: keep reading
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, endpoint
    raise RuntimeError("the ggml_lite server did not start")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        return serve_real(int(sys.argv[2]))
    lite_python = os.environ.get("GGML_LITE_PYTHON")
    if not lite_python:
        sys.exit("set GGML_LITE_PYTHON to the project's venv python")
    import ggml as g
    port = free_port()
    real = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.DEVNULL)
    lite, lite_ep = start_lite_server(lite_python)
    try:
        time.sleep(1.0)
        proxy = Proxy(port)
        cpu = g.ggml_backend_cpu_init()
        rpc_real = g.ggml_backend_rpc_init(f"127.0.0.1:{proxy.port}".encode(), 0)
        rpc_lite = g.ggml_backend_rpc_init(lite_ep.encode(), 0)
        out = {"version": "4.0.1", "scenarios": {}, "sessions": []}
        for name in S.SCENARIOS:
            out["scenarios"][name] = {"local": run_real(g, cpu, name),
                                      "real_client_real_server": run_real(g, rpc_real, name),
                                      "real_client_lite_server": run_real(g, rpc_lite, name)}
        time.sleep(0.5)
        n_real = len(proxy.sessions)
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
        res = subprocess.run([lite_python, str(HERE / "rpc_lite_run.py"), f"127.0.0.1:{proxy.port}"],
                             capture_output=True, text=True, env=env, check=True)
        for name, hexes in json.loads(res.stdout).items():
            out["scenarios"][name]["lite_client_real_server"] = hexes
        time.sleep(0.5)
        # ggml's client opens a connection whenever none is alive (the buffers hold it): the first
        # n_real connections are real ggml's client's, the others ggml_lite's client's
        out["n_real_sessions"] = n_real
        out["sessions"] = [{k: base64.b64encode(bytes(v)).decode() for k, v in rec.items()}
                           for rec in proxy.sessions]
    finally:
        real.kill()
        lite.kill()
    path = ROOT / "tests" / "data" / "rpc_ref.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for name, r in out["scenarios"].items():
        same = {k: v == r["local"] for k, v in r.items()}
        print(name, same)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
