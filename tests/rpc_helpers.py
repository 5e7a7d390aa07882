"""Helpers of tests/test_rpc.py and tests/test_rpc_fuzz.py: ggml_lite rpc servers as child processes
on loopback with a bounded lifetime (ended by their process id), and ggml-rpc frames by hand."""
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class LiteServer:
    """`python -m ggml_lite.backends.rpc --port 0` in a child process; .endpoint, .port, .log()."""

    def __init__(self, lifetime=300, cache=None, threads=1):
        self.errfile = tempfile.TemporaryFile(mode="w+")
        args = [sys.executable, "-m", "ggml_lite.backends.rpc", "--port", "0", "--threads", str(threads),
                "--lifetime", str(lifetime)]
        if cache is not None:
            args += ["--cache", str(cache)]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.errfile, text=True, env=env)
        self.banner = []
        for line in self.proc.stdout:
            self.banner.append(line.rstrip("\n"))
            m = re.search(r"endpoint\s*: (\S+)", line)
            if m:
                self.endpoint = m.group(1)
            if "transport" in line:
                break
        else:
            raise RuntimeError(f"the rpc server did not start: {self.log()}")
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        # the server prints a line per connection: read them, or a full pipe stops the server
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def alive(self):
        return self.proc.poll() is None

    def log(self):
        self.errfile.seek(0)
        return self.errfile.read()

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def connect(port, timeout=30):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def request(cmd, payload=b""):
    return bytes([cmd]) + struct.pack("<Q", len(payload)) + payload


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        d = s.recv(n - len(buf))
        if not d:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += d
    return bytes(buf)


def response(s):
    n = struct.unpack("<Q", recv_exact(s, 8))[0]
    return recv_exact(s, n)


def hello(s):
    s.sendall(request(14, bytes(24)))
    return response(s)


def closed_by_peer(s):
    """True if the server closed this connection (EOF or reset) rather than waiting for more."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
