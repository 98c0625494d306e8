"""Every notebook's code cells run, in order, as one script from notebooks/."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "get_ipython" not in code and "\n%" not in code, "keep notebooks plain Python"
    script = tmp_path / "notebook.py"
    script.write_text(code)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([sys.executable, str(script)], cwd=os.path.join(ROOT, "notebooks"),
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_there_are_notebooks():
    assert NOTEBOOKS
