"""``elastor train`` end to end: bad input fails before any process starts, a real
corpus trains, idle ranks exit cleanly, a rank's failure ends the command non-zero
with the rank's error."""

import json
import os
import subprocess
import sys

import pytest

from elastor_mcore.data.corpus import iter_texts, resolve_corpus
from elastor_mcore.data.tokenizer import train_tokenizer
from tests.conftest import REPO, TINY


def elastor(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "elastor_mcore.cli", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("layout, message", [
    ("dp3-tp1-pp1", "dp=3 does not divide the 16 micro-batches"),
    ("dp1-tp3-pp1", "tp=3 does not divide num_attention_heads=8"),
    ("missing.yaml", "neither a shorthand"),
])
def test_invalid_layout_fails_before_any_process_starts(layout, message):
    result = elastor("train", "--recipe", str(TINY), "--layout", layout, "--steps", "1",
                     timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "step" not in result.stdout


def test_load_from_an_empty_directory_is_a_clear_error(tmp_path):
    result = elastor("train", "--recipe", str(TINY), "--layout", "dp1-tp1-pp1", "--steps", "1",
                     "--load", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert f"no committed checkpoint in {tmp_path}" in result.stderr


@pytest.mark.timeout(600)
def test_corpus_training_idle_rank_and_rank_failure(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [json.dumps({"text": f"document {i}: " + "the quick brown fox " * (i % 7 + 3)})
             for i in range(200)]
    (corpus / "part.jsonl").write_text("\n".join(lines) + "\n")
    train_tokenizer(iter_texts(resolve_corpus([corpus]), "fail"), 300, tmp_path / "tok")
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"

    # One active rank and one idle rank, on the real corpus, saving at the end.
    result = elastor("train", "--recipe", str(TINY), "--layout", "dp1-tp1-pp1",
                     "--world-size", "2", "--steps", "2", "--save", str(ckpt),
                     "--no-async-save", "--metrics-out", str(metrics),
                     "--data", str(corpus), "--tokenizer", str(tmp_path / "tok"))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)
    assert "on 1 of 2 ranks" in result.stdout

    # Corrupt one chunk file: resuming must fail in the rank, naming the tensor.
    step_dir = next(ckpt.glob("step_*"))
    chunk = next(p for p in sorted((step_dir / "output_layer.weight").rglob("*"))
                 if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    result = elastor("train", "--recipe", str(TINY), "--layout", "dp1-tp1-pp1", "--steps", "3",
                     "--load", str(ckpt), "--data", str(corpus), "--tokenizer",
                     str(tmp_path / "tok"))
    assert result.returncode != 0
    assert "output_layer.weight" in result.stderr and "a rank failed" in result.stderr
