"""Every shell block the README marks runnable (`<!-- runnable -->` on the line before its
fence; `<!-- runnable slow -->`: on the real model, marked slow) runs in a copy of the tracked files with nothing beside it: no ../shared, no data the
clone lacks. `.venv/bin/tandem` there is this interpreter's tandem on that copy."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = [pytest.param(block, marks=[pytest.mark.slow] if slow else [], id=block.split("\n")[0][:60])
          for slow, block in re.findall(r"<!-- runnable( slow)? -->\n```bash\n(.*?)```", README, flags=re.S)]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files alone, in a folder of their own (what `git clone` gives)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    dest = tmp_path_factory.mktemp("clone") / "tandem"
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    tandem = dest / ".venv" / "bin" / "tandem"
    tandem.parent.mkdir(parents=True)
    tandem.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tandem.cli "$@"\n')
    tandem.chmod(0o755)
    return dest


def test_the_readme_marks_runnable_blocks_and_names_no_outside_path():
    assert len(BLOCKS) >= 3
    assert "../shared" not in README and "~/.cache/peers" not in README


@pytest.mark.parametrize("block", BLOCKS)
def test_runnable_block(block, clone):
    assert not (clone.parent / "shared").exists() and not (clone / "shared").exists()
    env = {**os.environ, "PYTHONPATH": str(clone)}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=clone, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}"
