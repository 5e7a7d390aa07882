"""`make lab`: JupyterLab refuses to start as root without --allow-root; LAB_ARGS adds flags."""
import os
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
