"""The ``elastor`` command line as users see it: every sub-command's ``--help`` against a
checked-in snapshot, and the commands that need no training answer without torch.

A deliberate change to the flags updates the snapshots with::

    ELASTOR_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/test_cli_snapshot.py

then review ``git diff tests/cli_snapshots/`` and commit it with the change.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY

SNAPSHOTS = Path(__file__).parent / "cli_snapshots"
COMMANDS = [(), ("train",), ("launch",), ("demo",), ("plan",), ("profile",), ("inspect",),
            ("convert",), ("tokenizer",), ("tokenizer", "train")]
HEAVY = ("torch", "megatron", "tensorstore", "numpy", "tokenizers")
"""Modules whose import costs the CLI seconds (or a large part of one)."""


def run_python(*args: str) -> subprocess.CompletedProcess:
    """``python *args`` in the repository, with a fixed terminal width (argparse wraps
    help to ``COLUMNS``), so the output does not depend on who runs the test."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "elastor")
def test_help_matches_snapshot(command):
    result = run_python("-m", "elastor_mcore.cli", *command, "--help")
    assert result.returncode == 0, result.stderr
    snapshot = SNAPSHOTS / f"{'-'.join(('elastor', *command))}.txt"
    if os.environ.get("ELASTOR_UPDATE_SNAPSHOTS") == "1":
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text(result.stdout)
    assert snapshot.is_file(), f"no snapshot {snapshot}: run with ELASTOR_UPDATE_SNAPSHOTS=1"
    assert result.stdout == snapshot.read_text(), (
        f"`elastor {' '.join(command)} --help` changed; if that is intended, regenerate "
        f"with ELASTOR_UPDATE_SNAPSHOTS=1 (see this module's docstring)")


def heavy_modules_after(code: str) -> tuple[str, list[str]]:
    """Run ``code`` in a fresh interpreter; what it printed, and which ``HEAVY`` modules
    it imported."""
    result = run_python("-c", f"{code}\nimport sys\n"
                              f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert result.returncode == 0, result.stderr
    *out, heavy = result.stdout.splitlines()
    return "\n".join(out) + result.stderr, json.loads(heavy.replace("'", '"'))


def test_building_the_parser_imports_nothing_heavy():
    _, heavy = heavy_modules_after("import elastor_mcore.cli\nelastor_mcore.cli.build_parser()")
    assert heavy == []


def test_a_bad_layout_is_reported_without_importing_torch():
    out, heavy = heavy_modules_after(
        "import elastor_mcore.cli\n"
        f"print('exit', elastor_mcore.cli.main(['train', '--recipe', {str(TINY)!r}, "
        "'--layout', 'bogus', '--steps', '1']))")
    assert "exit 2" in out and "layout bogus is neither a shorthand" in out
    assert heavy == []


def test_inspect_reads_only_the_manifest(tmp_path):
    from elastor_mcore.checkpoint.format import Manifest, TensorEntry

    step = tmp_path / "step_3"
    step.mkdir()
    entry = TensorEntry(shape=(4, 8), dtype="float32", chunks=(2, 8), shard=(4, 8))
    (step / "manifest.json").write_text(Manifest(step=3, tensors={"w": entry}).to_json())
    out, heavy = heavy_modules_after(
        f"import elastor_mcore.cli\nelastor_mcore.cli.main(['inspect', {str(step)!r}])")
    assert "step: 3" in out and "4x8" in out and "float32" in out, out
    assert heavy == []


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``elastor plan ... | head -1``: the pipe closes before the table is written."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastor_mcore.cli", "plan", "--recipe", "llama3-8b",
         "--hardware", "h100-80gb", "--nodes", "2", "--gpus-per-node", "8"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
