"""The package face is ggml's public headers.

`import ggml_lite as ggml` offers what ggml.h, ggml-backend.h, ggml-alloc.h, ggml-cpu.h and the
backends' headers (ggml-blas.h, ggml-rpc.h, ggml-cuda.h) declare, with the `ggml_` prefix dropped:
their functions, the records that stand for their structs and enums (CamelCase, as the code map
appendix names them), and their constants (`GGML_MAX_DIMS` -> `MAX_DIMS`). Everything else a
module defines stays in that module (`#| module_only`), importable from there. The headers' symbols
come from tests/data/ggml_symbols.json (tests/ggml_ref/symbols_ref.py, read off ggml 0.15.3's text).
"""
import importlib
import json
import pkgutil
import re
from pathlib import Path

import ggml_lite

SYMBOLS = json.loads((Path(__file__).parent / "data" / "ggml_symbols.json").read_text())
PUBLIC_HEADERS = ["ggml.h", "ggml-backend.h", "ggml-alloc.h", "ggml-cpu.h", "ggml-blas.h", "ggml-rpc.h",
                  "ggml-cuda.h"]
STRUCT_CLASSES = {"ggml_cgraph": "CGraph", "ggml_cplan": "CPlan", "ggml_type_traits_cpu": "TypeTraitsCPU"}
# Python's side of ggml's abort-or-return-NULL: the errors that ggml_lite raises instead
PYTHON_ONLY = {"__version__", "GGMLError", "GraphFullError", "GallocrNeedsReserveError"}


def camel(symbol):
    if symbol in STRUCT_CLASSES:
        return STRUCT_CLASSES[symbol]
    base = symbol.removeprefix("ggml_")
    return "".join(w.capitalize() for w in base.split("_"))


def header_names():
    """{face name: the header symbol it stands for} over the public headers."""
    out = {}
    for h in PUBLIC_HEADERS:
        e = SYMBOLS["headers"][h]
        out.update({f.removeprefix("ggml_"): f for f in e["functions"]})
        out.update({camel(s): s for s in e["structs"] + e["enums"]})
        out.update({m.removeprefix("GGML_") if m.startswith("GGML_") and not m.startswith("GGML_RPC_") else m: m
                    for m in e["macros"]})
    return out


HEADER = header_names()


def test_every_name_of_the_face_is_in_a_public_header():
    strays = [n for n in ggml_lite.__all__ if n not in HEADER and n not in PYTHON_ONLY]
    assert not strays, f"{len(strays)} names of the face are in no public header of ggml: {strays}"


def test_every_header_symbol_the_package_defines_is_in_the_face():
    """The converse: a module may not keep ggml's public API to itself."""
    hidden = []
    for info in pkgutil.walk_packages(ggml_lite.__path__, "ggml_lite."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            if name in HEADER and name not in ggml_lite.__all__:
                hidden.append(f"{info.name}.{name} ({HEADER[name]})")
    assert not hidden, f"ggml's public API marked module_only: {hidden}"


def test_the_face_and_the_modules_agree():
    """The face's __all__ lists each name once, and each is there to import."""
    assert len(set(ggml_lite.__all__)) == len(ggml_lite.__all__)
    for name in ggml_lite.__all__:
        assert hasattr(ggml_lite, name), name


def test_the_pictures_are_not_in_the_face():
    assert not [n for n in ggml_lite.__all__ if re.match(r"draw_|plot_", n)]
    import ggml_lite.viz as viz
    assert {"draw_graph", "draw_alloc_timeline", "draw_sched_splits"} <= set(viz.__all__)
