"""The README's library example, copied into a file, runs under horovodrun -np 2."""

import re

import pytest
from launch import ROOT, horovodrun


def library_example() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- example:library -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README lost its marked library example"
    return m.group(1)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_readme_library_example_runs_on_two_ranks(controller, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(library_example())
    out = horovodrun(["python", str(script)], controller=controller, cwd=tmp_path).stdout
    m = re.search(r"held-out accuracy ([\d.]+) after (\d+) steps", out)
    assert m, out[-2000:]
    assert float(m.group(1)) > 0.9 and int(m.group(2)) == 3 * (3584 // 64)
    assert out.count("held-out accuracy") == 1  # printed by rank 0 only
    assert (tmp_path / "runs" / "example" / "metrics.jsonl").is_file()
