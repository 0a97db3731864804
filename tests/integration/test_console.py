"""What a user sees on the console: the demo, and `hvdtrain launch` under both controllers, print
whole lines; rank 0's carry no tag, other ranks' keep horovodrun's."""

import re

import pytest
from launch import BIN, ROOT, env, run

TAG = re.compile(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:")
SPEAK = """import sys
from hvdtrain.world import World
w = World.init()
for i in range(40):
    print(f"rank {w.rank} line {i}")
    print(f"rank {w.rank} err {i}", file=sys.stderr)
"""


def test_the_demo_prints_clean_lines(tmp_path):
    res = run([str(ROOT / "scripts" / "demo.sh"), "--set", "train.epochs=2"], timeout=300,
              env=env(HVDTRAIN_DEMO_OUT=str(tmp_path / "demo")))
    lines = res.stdout.splitlines()
    assert not [line for line in lines if TAG.search(line)], res.stdout
    assert any(line.startswith("epoch 2/2 step 50: train loss") for line in lines), res.stdout
    assert any(re.fullmatch(r"done: step 50, eval loss [\d.]+ accuracy [\d.]+", line) for line in lines), res.stdout


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_launch_prints_whole_lines_rank_0_untagged(controller, tmp_path):
    script = tmp_path / "speak.py"
    script.write_text(SPEAK)
    res = run([str(BIN / "hvdtrain"), "launch", "-np", "2", "--controller", controller, "--no-preflight", "--",
               str(BIN / "python"), str(script)], timeout=120)
    lines = res.stdout.splitlines()
    one = "[1,1]" if controller == "mpi" else "[1]"
    for i in range(40):  # each line whole, once, in one piece
        assert lines.count(f"rank 0 line {i}") == lines.count(f"rank 0 err {i}") == 1, res.stdout
        assert lines.count(f"{one}<stdout>:rank 1 line {i}") == lines.count(f"{one}<stderr>:rank 1 err {i}") == 1
    # No tag inside a line (Open MPI glues one there when a line's newline comes in a second write).
    assert not [line for line in lines if any(m.start() > 0 for m in TAG.finditer(line))], res.stdout


def test_under_a_bare_horovodrun_each_line_is_one_write(tmp_path):
    # horovodrun sets PYTHONUNBUFFERED=1; without World.init's line buffering, print's text and
    # newline are two writes and Open MPI tags the newline's write at the end of the line.
    script = tmp_path / "speak.py"
    script.write_text(SPEAK)
    res = run([str(BIN / "horovodrun"), "-np", "2", "--mpi", str(BIN / "python"), str(script)], timeout=120)
    lines = res.stdout.splitlines()
    assert not [line for line in lines if any(m.start() > 0 for m in TAG.finditer(line))], res.stdout
    for i in range(40):
        assert lines.count(f"[1,0]<stdout>:rank 0 line {i}") == lines.count(f"[1,1]<stderr>:rank 1 err {i}") == 1
