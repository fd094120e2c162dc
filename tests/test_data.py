"""Real training data: JSONL and Megatron indexed corpora, background packing, resume.

A tiny corpus and a 300-id tokenizer are built once per module in a temp dir. The
resume tests rebuild each global batch from every pipeline's micro-batches, as the
runtime would, without launching distributed training.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from elastor_mcore.cli import main as cli_main
from elastor_mcore.data.samples import pipeline_micro_batches, pipeline_sample_indices
from elastor_mcore.data import doc_index
from elastor_mcore.config.data import (DataConfig, DataFlagError, add_data_args,
                                       data_config_from_args)
from elastor_mcore.data.config import validate_data_config
from elastor_mcore.data.corpus import iter_texts, read_text, resolve_corpus
from elastor_mcore.data.doc_index import JsonlDocuments, load_index
from elastor_mcore.data.errors import DataError
from elastor_mcore.data.packing import PackedSamples, PackingPlan
from elastor_mcore.data.prepare import fingerprint_change, prepare_data
from elastor_mcore.data.source import build_sample_source
from elastor_mcore.data.stdlib_corpus import prepare_demo_data
from elastor_mcore.data.tasks import JsonlSpec, SampleTask
from elastor_mcore.data.tokenizer import load_tokenizer, train_tokenizer
from elastor_mcore.data.workers import WorkerPool
from elastor_mcore.parallel.layout import layout_from_dict
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore import checkpoint
from tests.conftest import REPO, TINY, run_world

pytestmark = pytest.mark.timeout(120)

RECIPE = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "tiny-llama.yaml")
G = RECIPE.training.global_batch_size
MBS = RECIPE.training.micro_batch_size
WORDS = ("the model trains on tokens from many documents while pipelines differ in "
         "size and layout but every global batch stays the same after a restart").split()


def _layout(*micro_batches: int):
    return layout_from_dict({"pipelines": [
        {"micro_batches": mb, "stages": [{"tp": 1, "layers": RECIPE.model.num_layers}]}
        for mb in micro_batches]})


def _write_corpus(directory: Path, files: int = 3, documents: int = 60, seed: int = 0) -> None:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(directory / f"part-{f}.jsonl", "w") as handle:
            for d in range(documents):
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
                handle.write(json.dumps({"text": f"doc {f}/{d}: {text}.", "id": d}) + "\n")
                if d == 7:
                    handle.write("\n")   # blank lines are not documents, and not errors


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("data")
    _write_corpus(root / "corpus")
    train_tokenizer(iter_texts(resolve_corpus([root / "corpus"]), "fail"), 300, root / "tok")
    cfg = DataConfig(kind="jsonl", paths=(str(root / "corpus"),), tokenizer=str(root / "tok"),
                     prefetch_depth=64, index_workers=1)
    prepare_data(cfg, RECIPE)
    return cfg


@pytest.fixture(scope="module")
def indexed(corpus, tmp_path_factory) -> DataConfig:
    from elastor_mcore.data.indexed import build_indexed_dataset
    index = load_index(prepare_data(corpus, RECIPE).index_path)
    prefix = tmp_path_factory.mktemp("indexed") / "corpus"
    build_indexed_dataset(index, load_tokenizer(corpus.tokenizer), prefix, workers=1)
    return DataConfig(kind="indexed", paths=(str(prefix),), tokenizer=corpus.tokenizer)


def _global_batches(cfg: DataConfig, layout, start: int, stop: int,
                    wait_for_workers: bool = False) -> list[torch.Tensor]:
    """Steps [start, stop): each global batch rebuilt from every pipeline's micro-batches,
    each pipeline reading through its own source as its rank would. Without waiting,
    the first chunks are packed in this process while the workers start."""
    sources = [build_sample_source(cfg, RECIPE, pipeline_sample_indices(
        layout, p, G, MBS, start_step=start, stop_step=stop)) for p in range(len(layout.pipelines))]
    try:
        deadline = time.monotonic() + 60
        while wait_for_workers and not all(s.poll_workers() for s in sources):
            assert time.monotonic() < deadline, "data workers did not start"
            time.sleep(0.05)
        batches = [torch.cat([mb.tokens for p, source in enumerate(sources)
                              for mb in pipeline_micro_batches(source, layout, p, step, G, MBS)])
                   for step in range(start, stop)]
        if wait_for_workers and cfg.kind == "jsonl":
            assert all(s.stats.samples_packed_locally == 0 for s in sources)
        return batches
    finally:
        for source in sources:
            source.close()


def _expected_documents(cfg: DataConfig) -> list[list[int]]:
    """Each document's ids and its EOS, from the corpus files and ``tokenizer.json``."""
    tokenizer = Tokenizer.from_file(str(Path(cfg.tokenizer) / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    files = sorted(f.resolve() for p in map(Path, cfg.paths)
                   for f in (p.glob("*.jsonl") if p.is_dir() else [p]))
    texts = [json.loads(line)["text"] for f in files
             for line in f.read_text().split("\n") if line.strip()]
    return [tokenizer.encode(t, add_special_tokens=False).ids + [eos] for t in texts if t]


def _expected_epoch_length(cfg: DataConfig) -> int:
    return (sum(map(len, _expected_documents(cfg))) - 1) // RECIPE.model.seq_length


def _expected_samples(cfg: DataConfig, count: int) -> np.ndarray:
    """Samples ``0 .. count-1`` as docs/data.md defines them, built from the corpus files
    and ``tokenizer.json`` alone (the ``tokenizers`` library, nothing of elastor's): the
    non-blank lines' ``text`` of the files in sorted absolute-path order, each document's
    ids followed by EOS, laid end to end; sample ``j`` of an epoch is stream tokens
    ``[j*S, j*S + S + 1)``, an epoch holds ``(T - 1) // S`` of them, and with shuffle each
    epoch's document order is ``default_rng([seed, epoch]).permutation`` (packing.py)."""
    documents = _expected_documents(cfg)
    seq = RECIPE.model.seq_length
    per_epoch = _expected_epoch_length(cfg)
    streams: dict[int, list[int]] = {}
    out = []
    for i in range(count):
        epoch, j = divmod(i, per_epoch)
        if epoch not in streams:
            order = (np.random.default_rng([RECIPE.training.seed, epoch]).permutation(
                len(documents)) if cfg.shuffle else range(len(documents)))
            streams[epoch] = [token for d in order for token in documents[d]]
        out.append(streams[epoch][j * seq:j * seq + seq + 1])
    return np.array(out, dtype=np.int64)


def _expected_batches(cfg: DataConfig, steps: range) -> list[torch.Tensor]:
    """The inputs (first S tokens of each sample) of each step's global batch."""
    samples = _expected_samples(cfg, steps.stop * G)
    return [torch.from_numpy(samples[s * G:s * G + G, :-1]) for s in steps]


@pytest.mark.parametrize("shuffle", [False, True])
def test_jsonl_resume_under_another_layout_gives_the_same_batches(corpus, shuffle):
    cfg = DataConfig(**{**corpus.__dict__, "shuffle": shuffle})
    # With shuffle, resume just before the end of the epoch, so the batches compared
    # run into the next epoch and its new document order.
    k = prepare_data(cfg, RECIPE).samples_per_epoch // G - 3 if shuffle else 9
    uninterrupted = _global_batches(cfg, _layout(8, 8), 0, k + 6, wait_for_workers=True)
    resumed = _global_batches(cfg, _layout(4, 7, 5), k, k + 6)
    for step, batch in zip(range(k, k + 6), resumed):
        assert torch.equal(batch, uninterrupted[step]), f"step {step} differs after resume"
    expected = _expected_batches(cfg, range(k + 6))
    assert len(uninterrupted) == len(expected) == k + 6
    for step, (got, want) in enumerate(zip(uninterrupted, expected)):
        assert torch.equal(got, want), f"step {step} is not the documented sample"
    assert int(torch.cat(uninterrupted).max()) < RECIPE.model.vocab_size


def test_indexed_resume_under_another_layout_matches_jsonl(corpus, indexed):
    k = 7
    uninterrupted = _global_batches(indexed, _layout(16), 0, k + 6)
    resumed = _global_batches(indexed, _layout(2, 6, 8), k, k + 6)
    for step, batch in zip(range(k, k + 6), resumed):
        assert torch.equal(batch, uninterrupted[step]), f"step {step} differs after resume"
    for step, want in enumerate(_expected_batches(corpus, range(k + 6))):
        assert torch.equal(uninterrupted[step], want), f"step {step} is not the documented sample"
    summary, jsonl = prepare_data(indexed, RECIPE), prepare_data(corpus, RECIPE)
    assert summary.kind == "indexed"
    assert (summary.tokens, summary.fingerprint) == (jsonl.tokens, jsonl.fingerprint)
    with build_sample_source(indexed, RECIPE, range(1)) as source:
        source.vocab_size = 5   # as if the dataset came from a bigger tokenizer
        with pytest.raises(DataError, match="made with another tokenizer"):
            source.sample(0)


class CountingTokenizer:
    """Wraps a tokenizer and records every text it is asked to encode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.eos_id = inner.eos_id
        self.texts: list[str] = []

    def encode_batch(self, texts):
        self.texts += list(texts)
        return self.inner.encode_batch(texts)


def _documents_of(plan: PackingPlan, indices) -> set[int]:
    return {doc for i in indices for doc, _, _ in plan.pieces(i)}


def _text_of(index, doc: int) -> str:
    with open(index.files[index.file_ids[doc]], "rb") as handle:
        return read_text(handle, int(index.offsets[doc]))


def test_skipping_to_the_resume_position_tokenises_nothing_before_it(corpus):
    index = load_index(prepare_data(corpus, RECIPE).index_path)
    counting = CountingTokenizer(load_tokenizer(corpus.tokenizer))
    plan = PackingPlan(index.token_counts, RECIPE.model.seq_length, RECIPE.training.seed, False)
    packed = PackedSamples(JsonlDocuments(index, counting), plan, counting.eos_id)
    k = plan.samples_per_epoch // G - 6          # resume near the end of the corpus
    wanted = range(k * G, (k + 6) * G)
    packed.samples(list(wanted))
    needed = _documents_of(plan, wanted)
    assert len(counting.texts) == len(needed) < index.num_documents // 4
    assert min(needed) > index.num_documents // 2
    assert set(counting.texts) == {_text_of(index, d) for d in needed}

    # The background source does the same work (in the trainer while its workers start,
    # then in the workers); a document cut by a chunk boundary may be tokenised by both.
    indices = pipeline_sample_indices(_layout(16), 0, G, MBS, start_step=k, stop_step=k + 6)
    with build_sample_source(corpus, RECIPE, indices) as source:
        for i in wanted:
            source.sample(i)
        chunks = -(-len(wanted) // 16)    # prefetch_depth 64 -> chunks of 16 samples
        assert len(needed) <= source.stats.documents_tokenized < len(needed) + chunks
        assert source.stats.samples_served == len(wanted)


def test_sample_definition_joins_documents_with_eos_and_overlaps_one_token(corpus):
    index = load_index(prepare_data(corpus, RECIPE).index_path)
    tokenizer = load_tokenizer(corpus.tokenizer)
    seq = RECIPE.model.seq_length
    plan = PackingPlan(index.token_counts, seq, RECIPE.training.seed, False)
    packed = PackedSamples(JsonlDocuments(index, tokenizer), plan, tokenizer.eos_id)
    n = plan.samples_per_epoch + 3       # the whole epoch, into the next one
    expected = _expected_samples(corpus, n)
    assert expected.shape == (n, seq + 1)
    samples = packed.samples(range(n))
    for j in range(n):
        assert np.array_equal(samples[j], expected[j]), f"sample {j}"
    # The epoch's length is the documented one; past it the corpus starts again (same
    # order without shuffle).
    assert plan.samples_per_epoch == _expected_epoch_length(corpus)
    assert prepare_data(corpus, RECIPE).samples_per_epoch == plan.samples_per_epoch
    assert np.array_equal(samples[plan.samples_per_epoch], samples[0])


def test_shuffle_permutes_documents_per_epoch_deterministically(corpus):
    index = load_index(prepare_data(corpus, RECIPE).index_path)
    a = PackingPlan(index.token_counts, 32, 1234, True)
    b = PackingPlan(index.token_counts, 32, 1234, True)
    n = a.samples_per_epoch
    assert [a.pieces(i) for i in (0, 5, n, n + 5)] == [b.pieces(i) for i in (0, 5, n, n + 5)]
    assert a.pieces(0) != a.pieces(n)      # a new permutation each epoch
    assert _documents_of(a, range(n)) == set(range(index.num_documents))


def test_malformed_lines_are_reported_with_file_and_line(tmp_path, corpus, caplog, monkeypatch):
    directory = tmp_path / "bad"
    directory.mkdir()
    good = Path(corpus.paths[0]) / "part-0.jsonl"
    lines = good.read_text().splitlines(keepends=True)
    lines[2] = '{"text": "unterminated\n'
    lines[4] = '["not", "an", "object"]\n'
    (directory / "a.jsonl").write_text("".join(lines))
    (directory / "b.jsonl").write_text('{"title": "no text field"}\n')
    cfg = DataConfig(**{**corpus.__dict__, "paths": (str(directory),),
                        "cache_dir": str(tmp_path / "cache")})
    with pytest.raises(DataError) as err:
        prepare_data(cfg, RECIPE)
    message = str(err.value)
    a, b = str((directory / "a.jsonl").resolve()), str((directory / "b.jsonl").resolve())
    assert f"{a}:3: invalid JSON" in message and f"{a}:5: expected a JSON object" in message
    assert f'{b}:1: missing string field "text"' in message and "--skip-malformed" in message
    skip = DataConfig(**{**cfg.__dict__, "malformed": "skip"})
    with caplog.at_level(logging.WARNING):
        summary = prepare_data(skip, RECIPE)
    assert f"{a}:3:" in caplog.text and summary.documents == len(lines) - 1 - 2
    assert not summary.index_built   # the failed run already cached the index

    # Scanning in many small byte ranges (as in parallel) finds the same documents and
    # the same line numbers: a line belongs to the range its first byte is in.
    whole = load_index(summary.index_path)
    monkeypatch.setattr(doc_index, "SCAN_BYTES", 300)
    pieces = load_index(prepare_data(
        DataConfig(**{**skip.__dict__, "cache_dir": str(tmp_path / "cache2")}), RECIPE).index_path)
    assert pieces.malformed == whole.malformed
    for name in ("file_ids", "offsets", "token_counts"):
        assert np.array_equal(getattr(pieces, name), getattr(whole, name))


def test_bad_configurations_fail_before_any_worker_starts(tmp_path, corpus):
    def fails(match: str, **changes) -> None:
        with pytest.raises(DataError, match=match):
            validate_data_config(DataConfig(**{**corpus.__dict__, **changes}), RECIPE)

    fails("does not exist", paths=(str(tmp_path / "missing.jsonl"),))
    (tmp_path / "empty.jsonl").write_text("")
    fails("the corpus is empty", paths=(str(tmp_path / "empty.jsonl"),))
    (tmp_path / "nojsonl").mkdir()
    fails("contains no \\*.jsonl files", paths=(str(tmp_path / "nojsonl"),))
    fails("needs --tokenizer", tokenizer=None)
    fails("elastor tokenizer train", tokenizer=str(tmp_path / "no-tokenizer"))
    fails("--data-workers must be at least 1", workers=0)
    fails("missing .*corpus.bin", kind="indexed", paths=(str(tmp_path / "corpus"),))
    small = RECIPE.model.__class__(**{**RECIPE.model.__dict__, "vocab_size": 260})
    with pytest.raises(DataError, match="has 300 ids but the model's vocab_size is 260"):
        validate_data_config(corpus, RECIPE.__class__(**{**RECIPE.__dict__, "model": small}))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="has no documents"):
        prepare_data(DataConfig(**{**corpus.__dict__, "paths": (str(tmp_path / "blank.jsonl"),)}),
                     RECIPE)


def test_changed_corpus_or_tokenizer_rebuilds_the_index(tmp_path, corpus):
    directory = tmp_path / "c"
    _write_corpus(directory, files=1, documents=30, seed=1)
    path = directory / "part-0.jsonl"
    cfg = DataConfig(**{**corpus.__dict__, "paths": (str(directory),)})
    first = prepare_data(cfg, RECIPE)
    assert first.index_built and Path(first.index_path).parent == directory / ".elastor-index"
    assert not prepare_data(cfg, RECIPE).index_built

    # An edit that keeps size and mtime fools the cache key, but not the token counts.
    stat = path.stat()
    text = json.loads(path.read_text().splitlines()[0])["text"]
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(json.dumps({"text": "x" * len(text), "id": 0}) + "\n" + "".join(lines[1:]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    with build_sample_source(cfg, RECIPE, range(100)) as source:
        with pytest.raises(DataError, match="changed after its document index"):
            source.sample(0)
    spec = JsonlSpec(first.index_path, cfg.tokenizer, RECIPE.model.seq_length, 0, False)
    with WorkerPool(1) as pool:
        with pytest.raises(DataError, match="changed after its document index"):
            pool.result(pool.submit(SampleTask(spec, ((0, 4),))))   # raised in the worker

    with open(path, "a") as handle:
        handle.write(json.dumps({"text": "one more document"}) + "\n")
    second = prepare_data(cfg, RECIPE)
    assert second.index_built and second.documents == first.documents + 1
    assert second.fingerprint != first.fingerprint
    assert "the corpus changed" in fingerprint_change(first.fingerprint, second.fingerprint)
    retrained = tmp_path / "tok2"
    train_tokenizer(iter_texts(resolve_corpus([directory]), "fail"), 280, retrained)
    third = prepare_data(DataConfig(**{**cfg.__dict__, "tokenizer": str(retrained)}), RECIPE)
    assert third.index_built and third.index_path != second.index_path
    assert "the tokenizer changed" in fingerprint_change(second.fingerprint, third.fingerprint)
    assert "from synthetic tokens to a corpus" in fingerprint_change("synthetic", third.fingerprint)
    assert fingerprint_change(third.fingerprint, third.fingerprint) is None


def test_flags_build_the_config():
    parser = argparse.ArgumentParser()
    add_data_args(parser, "train")
    args = parser.parse_args(["--data", "a.jsonl", "dir", "--tokenizer", "tok",
                              "--skip-malformed", "--data-workers", "2", "--shuffle-data"])
    cfg = data_config_from_args(args, "train")
    assert cfg == DataConfig(kind="jsonl", paths=("a.jsonl", "dir"), tokenizer="tok",
                             malformed="skip", workers=2, shuffle=True)
    args = parser.parse_args(["--data-path", "pre", "--tokenizer", "tok"])
    assert data_config_from_args(args, "train") == DataConfig(kind="indexed", paths=("pre",),
                                                              tokenizer="tok")
    args = parser.parse_args(["--synthetic-data"])
    assert data_config_from_args(args, "train") == DataConfig(kind="synthetic")
    default = DataConfig(kind="jsonl", paths=("demo",), tokenizer="tok")
    assert data_config_from_args(parser.parse_args([]), "train", default) is default
    with pytest.raises(DataFlagError, match="--synthetic-data"):
        data_config_from_args(parser.parse_args([]), "train")
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", "a", "--data-path", "b"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--skip-malformed", "--fail-on-malformed"])


def test_the_flags_defaults_are_the_configs():
    """A flag left out gives the field's default: the default is written once."""
    parser = argparse.ArgumentParser()
    add_data_args(parser, "launch")
    args = parser.parse_args(["--data", "corpus", "--tokenizer", "tok"])
    assert data_config_from_args(args, "launch") == DataConfig(
        kind="jsonl", paths=("corpus",), tokenizer="tok")


def test_synthetic_source_is_the_runtime_default():
    source = build_sample_source(DataConfig(), RECIPE, range(4))
    assert source.sample(3).shape == (RECIPE.model.seq_length + 1,)


def test_tokenizer_cli_trains_offline(tmp_path, corpus, capsys):
    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--corpus", *corpus.paths, "--vocab-size", "270",
                     "--out", str(out), "--max-mb", "0.01"]) == 0
    tokenizer = load_tokenizer(out)
    assert tokenizer.vocab_size == 270 and tokenizer.eos_id == 0
    assert cli_main(["tokenizer", "train", "--corpus", *corpus.paths, "--vocab-size", "100",
                     "--out", str(out)]) == 2
    assert "at least 257" in capsys.readouterr().err


def test_demo_data_is_made_from_local_python_sources(tmp_path):
    cfg = prepare_demo_data(tmp_path, RECIPE, max_mb=0.3)
    assert validate_data_config(cfg, RECIPE).vocab_size == RECIPE.model.vocab_size
    texts = list(iter_texts(resolve_corpus(cfg.paths), "fail"))
    assert len(texts) > 10 and sum(map(len, texts)) > 0.2e6
    assert prepare_demo_data(tmp_path, RECIPE, max_mb=0.3) == cfg   # made once, then reused


def _tool(name: str):
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_and_indexed_dataset_tools(tmp_path, corpus, capsys):
    assert _tool("make_corpus").main(["--out", str(tmp_path / "c"), "--max-mb", "0.1"]) == 0
    assert len(list(iter_texts(resolve_corpus([tmp_path / "c"]), "fail"))) > 5
    build = _tool("build_indexed_dataset").main
    prefix = tmp_path / "idx" / "corpus"
    assert build(["--data", *corpus.paths, "--tokenizer", corpus.tokenizer, "--out", str(prefix),
                  "--workers", "1"]) == 0
    assert prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file()
    assert build(["--data", str(tmp_path / "nope"), "--tokenizer", corpus.tokenizer,
                  "--out", str(prefix)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_run_seed_orders_shuffled_epochs(corpus):
    """One seed story: --seed (RunSettings.seed_for) drives the shuffle, as it does the
    weights; without it the recipe's seed does."""
    def first_samples(cfg: DataConfig, seed: int | None) -> torch.Tensor:
        source = build_sample_source(cfg, RECIPE, range(4), seed)
        try:
            return torch.stack([source.sample(i) for i in range(4)])
        finally:
            source.close()

    shuffled, recipe_seed = replace(corpus, shuffle=True), RECIPE.training.seed
    assert torch.equal(first_samples(shuffled, None), first_samples(shuffled, recipe_seed))
    assert not torch.equal(first_samples(shuffled, 7), first_samples(shuffled, recipe_seed))
    assert torch.equal(first_samples(corpus, 7), first_samples(corpus, recipe_seed))
    synthetic = DataConfig()
    assert not torch.equal(first_samples(synthetic, 7), first_samples(synthetic, None))


@pytest.mark.timeout(300)
def test_a_tp_group_packs_its_samples_once(corpus, tmp_path):
    """TP2 first stage: rank 0 reads, rank 1 only receives, and both train on exactly the
    micro-batches one rank reading by itself gets, so the losses are those of before."""
    steps = 3
    run_world(2, "tests.workers.tp_shared_data",
              ["--recipe", str(TINY), "--data-config", corpus.to_json(), "--steps", str(steps),
               "--out", str(tmp_path)])
    layout = layout_from_dict({"pipelines": [{"micro_batches": G // MBS, "stages": [
        {"tp": 2, "layers": RECIPE.model.num_layers}]}]})
    with build_sample_source(corpus, RECIPE, pipeline_sample_indices(
            layout, 0, G, MBS, 0, steps)) as source:
        expected = [pipeline_micro_batches(source, layout, 0, step, G, MBS)
                    for step in range(steps)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(got) == steps
        for want, have in zip(expected, got):
            assert len(want) == len(have) == G // MBS
            assert all(torch.equal(w.tokens, t) and torch.equal(w.labels, l)
                       for w, (t, l) in zip(want, have))


def _elastor(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "elastor_mcore.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(900)
def test_resume_on_an_edited_corpus_is_refused_unless_allowed(corpus, tmp_path):
    """The manifest records the data source; an edited corpus is refused before any rank
    starts, naming the change, and --allow-data-change continues with a warning."""
    directory = tmp_path / "corpus"
    _write_corpus(directory, files=1, documents=60, seed=3)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    common = ("--recipe", str(TINY), "--layout", "dp1-tp1-pp1", "--data", str(directory),
              "--tokenizer", corpus.tokenizer, "--no-async-save", "--save", str(ckpt))
    result = _elastor("train", *common, "--steps", "2", "--metrics-out", str(metrics))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = checkpoint.open(ckpt).manifest.extra["data"]
    cfg = DataConfig(kind="jsonl", paths=(str(directory),), tokenizer=corpus.tokenizer)
    assert saved == {"kind": "jsonl", "paths": [str(directory.resolve())],
                     "tokenizer": str(Path(corpus.tokenizer).resolve()),
                     "fingerprint": prepare_data(cfg, RECIPE).fingerprint, "shuffle": False,
                     "seed": RECIPE.training.seed}

    with open(directory / "part-0.jsonl", "a") as handle:
        handle.write(json.dumps({"text": "a document added after the checkpoint"}) + "\n")
    result = _elastor("train", *common, "--steps", "3", "--load", str(ckpt))
    assert result.returncode == 2
    assert "checkpoint of step 2 was saved on other data: the corpus changed" in result.stderr
    assert "--allow-data-change" in result.stderr and "a rank failed" not in result.stderr

    result = _elastor("train", *common, "--steps", "3", "--load", str(ckpt),
                      "--metrics-out", str(metrics), "--allow-data-change")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming step 2 on other data (--allow-data-change): the corpus changed" \
        in result.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [3]
