"""The project's own files: `make lab` (JupyterLab refuses to start as root without --allow-root;
LAB_ARGS adds flags), the README's command line for a model, .gitignore."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lab_command(*make_args):
    """The jupyter lab line `make lab` would run (make -n: printed, nothing executed)."""
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "lab", *make_args], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, MAKEFLAGS=""))
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "jupyter lab" in ln]
    return line.split()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_lab_allows_root_only_as_root_and_takes_lab_args():
    words = lab_command()
    assert ("--allow-root" in words) == (os.geteuid() == 0)
    words = lab_command("LAB_ARGS=--no-browser --port=8899")
    assert words[-2:] == ["--no-browser", "--port=8899"]


def cli_flags():
    """The option strings of `python -m ggml_lite.llama`'s parser."""
    import argparse
    from unittest import mock

    from ggml_lite.llama import __main__ as cli
    seen, real = set(), argparse.ArgumentParser.parse_args

    def spy(self, *a, **kw):
        seen.update(s for act in self._actions for s in act.option_strings)
        return real(self, *a, **kw)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", spy):
        cli._parse_args(["m.gguf"])
    return seen


def test_the_readmes_model_flags_are_the_command_lines():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Running a model", 1)[1].split("\n## ", 1)[0]
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", section)) - {"-e", "-m"}   # pip's and python's
    assert len(flags) > 10 and flags <= cli_flags(), flags - cli_flags()
    assert "pip install -e '.[llama]'" in section
    assert "\nllama = [" in (ROOT / "pyproject.toml").read_text()      # the extra it names exists


def test_gitignore_covers_build():
    out = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "build/lib/x.py"], timeout=60)
    assert out.returncode == 0


def test_the_rendered_book_drops_directive_lines():
    """_ext/directive_lines.py: the tangler's `#| ...` lines and nbval's markers are not shown; the code is."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("directive_lines", ROOT / "_ext" / "directive_lines.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.strip_directives("#| exporti\n#| module_only\n\nimport numpy as np\n") == "import numpy as np\n"
    assert mod.strip_directives("#| default_exp tensor") == ""
    assert mod.strip_directives("x = 1  #| not a directive\n") == "x = 1  #| not a directive\n"
    # nbval's marker is the test runner's: hidden too, wherever it stands among the leading lines
    assert mod.strip_directives("# NBVAL_IGNORE_OUTPUT\n#| export\nx = 1") == "x = 1"
    assert mod.strip_directives("# NBVAL_IGNORE_OUTPUT\n# timings vary\nx = 1") == "# timings vary\nx = 1"


def test_every_picture_has_an_alt_text():
    """A figure stored in a chapter says in words what it shows (mystnb.image.alt), not its file name."""
    import json
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if any("image/png" in o.get("data", {}) for o in cell.get("outputs", [])):
                alt = cell["metadata"].get("mystnb", {}).get("image", {}).get("alt", "")
                assert len(alt) >= 60, f"{path.name} cell {cell.get('id')}: alt text {alt!r}"
