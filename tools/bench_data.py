"""Benchmark the JSONL data pipeline: index build, background throughput, waits, resume.

    python tools/bench_data.py [--work DIR] [--corpus-mb 64] [--step-time 0.5]

Makes (once) a corpus of at least --corpus-mb MB from the Python sources on this
machine and a BPE tokenizer, then reports:

1. the document index build (one tokenisation pass over the corpus, all CPUs);
2. the background pipeline feeding a simulated training loop (one rank taking every
   sample of each global batch, sleeping --step-time per step): tokens/s of the
   workers and the steps that waited on data after the first one (goal: 0);
3. resuming at 90% of the corpus: time from nothing to the first global batch
   (worker start-up included) against the time re-tokenising everything before that
   position would take at the index build's measured rate (goal: under 1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastor_mcore.data.config import DataConfig  # noqa: E402
from elastor_mcore.data.corpus import iter_texts, resolve_corpus  # noqa: E402
from elastor_mcore.data.doc_index import CACHE_DIR_NAME, load_index  # noqa: E402
from elastor_mcore.data.packing import PackingPlan  # noqa: E402
from elastor_mcore.data.samples import pipeline_sample_indices  # noqa: E402
from elastor_mcore.data.source import build_sample_source, prepare_data  # noqa: E402
from elastor_mcore.data.stdlib_corpus import write_stdlib_corpus  # noqa: E402
from elastor_mcore.data.tasks import JsonlSpec, open_jsonl_samples  # noqa: E402
from elastor_mcore.data.tokenizer import TOKENIZER_FILE, train_tokenizer  # noqa: E402
from elastor_mcore.parallel.layout import layout_from_dict  # noqa: E402
from elastor_mcore.config.recipe import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _ensure_corpus(work: Path, corpus_mb: float, vocab: int, tokenizer_mb: float) -> DataConfig:
    corpus, tokenizer = work / "corpus", work / "tokenizer"
    size = sum(f.stat().st_size for f in corpus.glob("*.jsonl")) if corpus.is_dir() else 0
    if size < corpus_mb * 1e6:
        shutil.rmtree(corpus, ignore_errors=True)
        print(f"writing a {corpus_mb:g} MB corpus from Python sources into {corpus} ...",
              flush=True)
        began = time.monotonic()
        stats = write_stdlib_corpus(corpus, corpus_mb)
        print(f"  {stats.documents} documents, {stats.bytes / 1e6:.1f} MB from {stats.files} "
              f"files in {time.monotonic() - began:.1f} s")
        shutil.rmtree(tokenizer, ignore_errors=True)
    if not (tokenizer / TOKENIZER_FILE).is_file():
        print(f"training a {vocab}-id tokenizer on the first {tokenizer_mb:g} MB ...", flush=True)
        began = time.monotonic()
        texts, budget = [], tokenizer_mb * 1e6
        for text in iter_texts(resolve_corpus([corpus]), "fail"):
            texts.append(text)
            budget -= len(text)
            if budget <= 0:
                break
        train_tokenizer(texts, vocab, tokenizer)
        print(f"  done in {time.monotonic() - began:.1f} s")
    return DataConfig(kind="jsonl", paths=(str(corpus),), tokenizer=str(tokenizer))


def _cpu_share(seconds: float = 1.0) -> float:
    """Fraction of a core this process gets now (1.0 on an idle machine)."""
    began, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - began < seconds:
        pass
    return (time.process_time() - cpu) / (time.monotonic() - began)


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the index workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/elastor-bench-data",
                        help="where the corpus and tokenizer are made and kept")
    parser.add_argument("--corpus-mb", type=float, default=64.0)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer-mb", type=float, default=8.0,
                        help="MB of text the tokenizer learns from")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--step-time", type=float, default=0.5,
                        help="simulated seconds of compute per training step")
    parser.add_argument("--steps", type=int, default=60, help="simulated training steps")
    parser.add_argument("--data-workers", type=int, default=1)
    parser.add_argument("--prefetch-depth", type=int, default=256)
    parser.add_argument("--index-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json-out", help="also write the figures here as JSON")
    args = parser.parse_args(argv)

    work = Path(args.work)
    cfg = replace(_ensure_corpus(work, args.corpus_mb, args.vocab_size, args.tokenizer_mb),
                  workers=args.data_workers, prefetch_depth=args.prefetch_depth,
                  index_workers=args.index_workers)
    tiny = load_recipe(ROOT / "recipes" / "tiny-llama.yaml")
    recipe = replace(tiny, model=replace(tiny.model, vocab_size=args.vocab_size,
                                         seq_length=args.seq_length),
                     training=replace(tiny.training, global_batch_size=args.global_batch))
    layout = layout_from_dict({"pipelines": [{"micro_batches": args.global_batch,
                                              "stages": [{"tp": 1, "layers": 8}]}]})
    G = args.global_batch
    corpus_mb = sum(f.size for f in resolve_corpus(cfg.paths)) / 1e6
    share = _cpu_share()
    print(f"corpus {corpus_mb:.1f} MB, seq_length {args.seq_length}, global batch {G}; "
          f"{os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f}, this process gets "
          f"{share:.0%} of a core (wall-clock figures below are that much slower than on an "
          f"idle machine; CPU-second figures are not)")

    # 1. Index build (forced).
    shutil.rmtree(Path(cfg.paths[0]) / CACHE_DIR_NAME, ignore_errors=True)
    print(f"building the document index with {args.index_workers} worker(s) ...", flush=True)
    cpu = _cpu_seconds()
    summary = prepare_data(cfg, recipe)
    index_cpu = _cpu_seconds() - cpu
    index_rate, index_cpu_rate = summary.tokens / summary.seconds, summary.tokens / index_cpu
    print(f"  {summary.documents} documents, {summary.tokens:,} tokens in {summary.seconds:.1f} s "
          f"({index_rate:,.0f} tokens/s, {corpus_mb / summary.seconds:.2f} MB/s); "
          f"{index_cpu:.1f} CPU s ({index_cpu_rate:,.0f} tokens per CPU second)")
    cached = prepare_data(cfg, recipe)
    print(f"  reloading the cached index: {cached.seconds * 1e3:.0f} ms")

    # 2. Background pipeline under a simulated training loop.
    print(f"simulated training: {args.steps} steps of {args.step_time:g} s, "
          f"{args.data_workers} data worker(s), prefetch depth {args.prefetch_depth} ...",
          flush=True)
    indices = pipeline_sample_indices(layout, 0, G, 1, 0, args.steps)
    waited_steps, worst = 0, 0.0
    began = time.monotonic()
    with build_sample_source(cfg, recipe, indices) as source:
        for step in range(args.steps):
            before = source.stats.waits_after_warmup
            t0 = time.monotonic()
            for i in range(step * G, step * G + G):
                source.sample(i)
            fetch = time.monotonic() - t0
            if source.stats.chunks_from_workers > 1:   # warm-up is over
                worst = max(worst, fetch)
                waited_steps += source.stats.waits_after_warmup > before
            time.sleep(args.step_time)
        stats = source.stats
    elapsed = time.monotonic() - began
    consumed_rate = args.steps * G * args.seq_length / elapsed
    print(f"  warm-up {stats.warmup_seconds:.2f} s ({stats.samples_packed_locally} samples packed "
          f"in the trainer meanwhile); steps that waited on data after warm-up: {waited_steps} "
          f"of {args.steps} (slowest fetch {worst * 1e3:.1f} ms)")
    print(f"  workers tokenised {stats.worker_tokens:,} tokens at "
          f"{stats.tokens_per_worker_second:,.0f} tokens/s per busy worker "
          f"({stats.tokens_per_worker_cpu_second:,.0f} per CPU second); training consumed "
          f"{consumed_rate:,.0f} tokens/s")

    # 3. Resume at 90 % of the corpus.
    step = int(0.9 * summary.samples_per_epoch) // G
    tokens_before = step * G * args.seq_length
    began = time.monotonic()
    plan = PackingPlan(load_index(prepare_data(cfg, recipe).index_path).token_counts,
                       args.seq_length, recipe.training.seed, False)
    needed = {doc for i in range(step * G, step * G + G) for doc, _, _ in plan.pieces(i)}
    locate_seconds = time.monotonic() - began
    began, cpu = time.monotonic(), time.process_time()
    indices = pipeline_sample_indices(layout, 0, G, 1, step, step + 1)
    with build_sample_source(cfg, recipe, indices) as source:
        batch = [source.sample(i) for i in range(step * G, step * G + G)]
        resume_seconds, resume_cpu = time.monotonic() - began, time.process_time() - cpu
        documents = source.stats.documents_tokenized
    direct = open_jsonl_samples(JsonlSpec(summary.index_path, str(Path(cfg.tokenizer).resolve()),
                                          args.seq_length, recipe.training.seed, False))
    same = all((b.numpy() == row).all() for b, row in
               zip(batch, direct.samples(range(step * G, step * G + G))))
    retokenize, retokenize_cpu = tokens_before / index_rate, tokens_before / index_cpu_rate
    print(f"resume at step {step} (sample {step * G}, stream token {tokens_before:,} of "
          f"{summary.tokens:,}):")
    print(f"  locating the position from the cached index: {locate_seconds * 1e3:.0f} ms")
    print(f"  first global batch after {resume_seconds:.2f} s ({resume_cpu:.2f} CPU s in the "
          f"trainer); {documents} documents tokenised, {len(needed)} of them needed")
    print(f"  re-tokenising up to there instead: ~{retokenize:.0f} s at the index build's rate "
          f"(~{retokenize_cpu:.0f} CPU s)")
    print(f"  the resumed batch matches direct packing: {same}")

    figures = {"corpus_mb": corpus_mb, "cpu_share": share, "documents": summary.documents,
               "tokens": summary.tokens, "index_build_s": summary.seconds,
               "index_build_cpu_s": index_cpu, "index_tokens_per_s": index_rate,
               "index_tokens_per_cpu_s": index_cpu_rate, "index_reload_s": cached.seconds,
               "warmup_s": stats.warmup_seconds, "steps": args.steps,
               "step_time_s": args.step_time, "steps_waited_after_warmup": waited_steps,
               "slowest_fetch_after_warmup_s": worst,
               "worker_tokens_per_s": stats.tokens_per_worker_second,
               "worker_tokens_per_cpu_s": stats.tokens_per_worker_cpu_second,
               "consumed_tokens_per_s": consumed_rate, "resume_step": step,
               "resume_locate_s": locate_seconds, "resume_first_batch_s": resume_seconds,
               "resume_first_batch_cpu_s": resume_cpu, "resume_documents_tokenised": documents,
               "resume_documents_needed": len(needed), "retokenise_estimate_s": retokenize,
               "retokenise_estimate_cpu_s": retokenize_cpu, "resume_batch_matches": bool(same),
               "load_average_end": os.getloadavg()[0]}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
