#!/bin/sh
# The current ggml as a peer for bench/run.py: the ggml that llama-cpp-python 0.3.36 vendors
# (ggml 0.25.3, the one `pip install llama-cpp-python` builds), compiled for this CPU
# (GGML_NATIVE) with llamafile off, as bench/run.py's single kernels compare them, and put under
# a copy of ggml-python 0.0.45, whose own bundled ggml is 0.15.3. The C API bench/peer_ggml.py
# calls (ggml_init, ggml_mul_mat, ggml_graph_plan, ggml_graph_compute; struct ggml_cplan) is the
# same in both.
#
#     sh bench/ggml_current.sh [VENV]          # default /tmp/ggmlpy-current
#     .venv/bin/python bench/run.py --ggml-python VENV/bin/python --out FILE
#
# Needs cmake, ninja and a C++ compiler; reaches PyPI (pip).
set -eu
OUT=${1:-/tmp/ggmlpy-current}
WORK=$(mktemp -d)
python3 -m venv "$OUT"
"$OUT/bin/pip" install -q "ggml-python==0.0.45" numpy
"$OUT/bin/pip" download -q --no-binary :all: --no-deps "llama-cpp-python==0.3.36" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-0.3.36.tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml"
# the sdist leaves out the pkg-config template that ggml's CMakeLists.txt configures
[ -f "$SRC/ggml.pc.in" ] || printf 'prefix=@CMAKE_INSTALL_PREFIX@\nName: ggml\nDescription: ggml\nVersion: @GGML_VERSION@\n' > "$SRC/ggml.pc.in"
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_LLAMAFILE=OFF -DBUILD_SHARED_LIBS=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
cmake --build "$WORK/build"
LIB=$("$OUT/bin/python" -c "import ggml, os; print(os.path.join(os.path.dirname(ggml.__file__), 'lib'))")
cp -L "$WORK/build/src/libggml.so" "$WORK/build/src/libggml-base.so" "$WORK/build/src/libggml-cpu.so" "$LIB/"
"$OUT/bin/python" -c "import ggml; print('ggml', ggml.ggml_version().decode(), 'in', '$OUT')"
rm -rf "$WORK"
