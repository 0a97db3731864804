"""`pip install .` into a fresh venv that already has torch, the way most people try a package
first: the CLI then says, in one line, the command that builds Horovod; `hvdtrain build-horovod`
builds it (or takes the wheel cached by scripts/install.sh); training works from any folder, with
the example configs shipped in the package."""

import sys

import pytest
from launch import ROOT, env, run


@pytest.mark.slow
def test_pip_install_then_build_horovod_then_train_from_any_folder(tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "elsewhere"
    work.mkdir()
    run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    run([*pip, "torch==2.13.0"], timeout=600)  # the user's own torch, first
    run([*pip, str(ROOT)], timeout=600)
    e = env(PATH=f"{venv / 'bin'}:/usr/bin:/bin")
    cli = str(venv / "bin" / "hvdtrain")
    before = run([cli, "train", "--config", "digits.yaml"], env=e, cwd=work, check=False, timeout=120)
    assert before.returncode == 2, before.stdout
    assert before.stdout.strip() == (
        "hvdtrain: error: Horovod is not installed in this environment; run `hvdtrain build-horovod` (builds "
        "Horovod 0.28.1 for this torch and installs it, 2-4 minutes the first time; needs cmake, g++ and Open MPI "
        "headers) or ./scripts/install.sh in a checkout"), before.stdout
    built = run([cli, "build-horovod"], env=e, cwd=work, timeout=900)
    assert "[install] ready: Horovod 0.28.1 in " in built.stdout, built.stdout
    trained = run([cli, "launch", "-np", "2", "--", cli, "train", "--config", "digits.yaml", "--out", "run",
                   "--set", "train.epochs=1", "--set", "log.progress=false"], env=e, cwd=work, timeout=300)
    assert "done: step 25, eval loss" in trained.stdout, trained.stdout
    assert (work / "run" / "checkpoints" / "step_00000025" / "state.pt").is_file()
    assert not list(venv.rglob(".install-logs"))  # the build's log went to the cache, not into the venv
