"""Extract ggml's public symbols from its headers into tests/data/ggml_symbols.json.

Usage: python tests/ggml_ref/symbols_ref.py GGML_SOURCE_DIR [OUT_JSON]

GGML_SOURCE_DIR is ggml's source tree (the directory holding include/ and src/). Any python 3.8+
runs it: it reads text, it needs neither ggml built nor ggml_lite. Per header it lists
- functions: every name declared with GGML_API or GGML_BACKEND_API (deprecated ones included);
- structs: every `struct ggml_x { ... }` defined there and every opaque `struct ggml_x;` or
  `typedef struct ggml_x * ggml_x_t;` declared there (a struct declared in several headers is
  listed once, under the header that defines it, else under the first header of HEADERS).
- enums: every `enum ggml_x {` defined there;
- macros: every object-like `#define NAME value` and every `static const T GGML_X = ...` there (not the function-like ones, nor the
  export/attribute macros GGML_API, GGML_BACKEND_API, GGML_DEPRECATED and the like).
Plus the backend interface structs of src/ggml-backend-impl.h (`struct ggml_backend_*_i`) and the
scheduler's structs defined in src/ggml-backend.cpp (`struct ggml_backend_sched*`).
"""
import json
import re
import sys
from pathlib import Path

HEADERS = ["ggml.h", "ggml-backend.h", "ggml-alloc.h", "ggml-cpu.h", "ggml-blas.h", "ggml-rpc.h", "ggml-cuda.h"]

API_FN = re.compile(r"\b(?:GGML_API|GGML_BACKEND_API)\b[^;(]*?\b(\w+)\s*\(")
STRUCT_DEF = re.compile(r"\bstruct\s+(ggml_\w+)\s*\{")
# an opaque declaration is a statement of its own: `struct ggml_x;` or `typedef struct ggml_x * ggml_x_t;`
STRUCT_DECL = re.compile(r"(?:^|(?<=[;{}]))\s*(?:struct\s+(ggml_\w+)\s*;|typedef\s+struct\s+(ggml_\w+)\s*\*\s*\w+\s*;)")


def strip_comments(text):
    """The C text without comments and preprocessor lines (the GGML_API macros' own definitions)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)


ENUM_DEF = re.compile(r"\benum\s+(ggml_\w+)\s*\{")
MACRO_DEF = re.compile(r"^\s*#\s*define\s+(\w+)[ \t]+\S", re.M)      # object-like, with a value
CONST_DEF = re.compile(r"\bstatic\s+const\s+\w+\s+(GGML_\w+)\s*=")       # static const size_t GGML_X = ...
NOT_VALUES = {"GGML_API", "GGML_BACKEND_API", "GGML_CALL", "GGML_DEPRECATED", "GGML_ATTRIBUTE_FORMAT",
              "GGML_RESTRICT", "GGML_NORETURN", "GGML_UNUSED", "GGML_PAD"}


def macros(raw):
    """Object-like macros with a value, in order, without the export and attribute ones."""
    found = MACRO_DEF.findall(raw) + CONST_DEF.findall(raw)
    return unique(m for m in found if m not in NOT_VALUES and not m.startswith("_") and not m.endswith("_H"))


def unique(names):
    return list(dict.fromkeys(names))


def version(root):
    cmake = (root / "CMakeLists.txt").read_text()
    parts = [re.search(rf"set\(GGML_VERSION_{p}\s+(\d+)\)", cmake).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit(__doc__)
    root = Path(argv[1])
    out = Path(argv[2]) if len(argv) == 3 else Path(__file__).resolve().parents[1] / "data" / "ggml_symbols.json"
    raw = {h: (root / "include" / h).read_text() for h in HEADERS}
    texts = {h: strip_comments(raw[h]) for h in HEADERS}
    defined = {h: unique(STRUCT_DEF.findall(t)) for h, t in texts.items()}
    owner = {}
    for h in HEADERS:                      # a definition wins over a declaration
        for s in defined[h]:
            owner.setdefault(s, h)
    for h in HEADERS:
        for plain, typedef in STRUCT_DECL.findall(texts[h]):
            owner.setdefault(plain or typedef, h)
    headers = {}
    for h in HEADERS:
        headers[h] = {
            "functions": unique(API_FN.findall(texts[h])),
            "structs": [s for s in owner if owner[s] == h],
            "enums": unique(ENUM_DEF.findall(texts[h])),
            "macros": macros(re.sub(r"/\*.*?\*/", " ", raw[h], flags=re.S)),
        }
    impl = strip_comments((root / "src" / "ggml-backend-impl.h").read_text())
    sched = strip_comments((root / "src" / "ggml-backend.cpp").read_text())
    headers["src/ggml-backend-impl.h"] = {
        "functions": [], "enums": [], "macros": [],
        "structs": [s for s in unique(STRUCT_DEF.findall(impl)) if s.endswith("_i")],
    }
    headers["src/ggml-backend.cpp"] = {
        "functions": [], "enums": [], "macros": [],
        "structs": [s for s in unique(STRUCT_DEF.findall(sched)) if s.startswith("ggml_backend_sched")],
    }
    data = {"ggml_version": version(root), "headers": headers}
    out.write_text(json.dumps(data, indent=1) + "\n")
    for h, d in headers.items():
        print(f"{h:26} {len(d['functions']):4} functions {len(d['structs']):3} structs "
              f"{len(d['enums']):3} enums {len(d['macros']):3} macros")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv)
