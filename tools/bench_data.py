"""Benchmark the JSONL data pipeline: index build, waits under real training, resume.

    python tools/bench_data.py [--work DIR] [--corpus-mb 64] [--steps 15] [--repeats 3]

Makes (once) a corpus of at least --corpus-mb MB from the Python sources on this
machine and a BPE tokenizer, then reports:

1. the document index build (one tokenisation pass over the corpus, all CPUs);
2. the background worker under a real training step: ``elastor train`` on the tiny
   recipe (with --seq-length, --global-batch and the tokenizer's vocabulary), one
   rank taking every sample, --repeats times. From each run's ``data_wait_s`` (the
   time the training loop spent getting a step's micro-batches) come the steps after
   the first that waited longer than --wait-threshold and the time waited; from the
   process tree, sampled while it runs, the CPU seconds of the packing worker and of
   the rank (they compete for the same cores). Goal: 0 steps wait after the first.
   Figures are the median over the runs;
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
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastor_mcore.config.data import DataConfig  # noqa: E402
from elastor_mcore.data.corpus import iter_texts, resolve_corpus  # noqa: E402
from elastor_mcore.data.doc_index import CACHE_DIR_NAME, load_index  # noqa: E402
from elastor_mcore.data.packing import PackingPlan  # noqa: E402
from elastor_mcore.data.samples import pipeline_sample_indices  # noqa: E402
from elastor_mcore.data.prepare import prepare_data  # noqa: E402
from elastor_mcore.data.source import build_sample_source  # noqa: E402
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


def _process_kind(process: psutil.Process) -> str:
    cmdline = " ".join(process.cmdline())
    if "elastor_mcore.data.workers" in cmdline:
        return "worker"
    return "rank" if "elastor_mcore.elastic.rank.worker" in cmdline else "launcher"


def _train_once(recipe_path: Path, cfg: DataConfig, steps: int, out: Path) -> dict:
    """One ``elastor train`` run; its per-step metrics and the CPU seconds of each kind
    of process in its tree (sampled every 0.2 s: a process that exits loses at most
    that much)."""
    metrics = out / "metrics.jsonl"
    argv = [sys.executable, "-m", "elastor_mcore.cli", "train", "--recipe", str(recipe_path),
            "--layout", "dp1-tp1-pp1", "--steps", str(steps), "--metrics-out", str(metrics),
            "--data", *cfg.paths, "--tokenizer", cfg.tokenizer,
            "--data-workers", str(cfg.workers), "--prefetch-depth", str(cfg.prefetch_depth)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cpu: dict[int, tuple[str, float]] = {}
    began = time.monotonic()
    with open(out / "train.log", "w") as log, subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) as proc:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in tree:
                try:
                    times = p.cpu_times()
                    cpu[p.pid] = (cpu[p.pid][0] if p.pid in cpu else _process_kind(p),
                                  times.user + times.system)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(f"elastor train failed (exit {proc.returncode}); see {out / 'train.log'}")
    by_kind = {k: sum(c for kind, c in cpu.values() if kind == k)
               for k in ("worker", "rank", "launcher")}
    return {"steps": [json.loads(line) for line in metrics.read_text().splitlines()],
            "wall_s": time.monotonic() - began, "cpu_s": by_kind}


def _waits(run: dict, threshold: float) -> dict:
    """Data-wait figures of one run, the first step (start-up) left out."""
    later = run["steps"][1:]
    waits = [s["data_wait_s"] for s in later]
    train_s = sum(s["time_s"] for s in later)
    return {"step_s": statistics.median(s["time_s"] for s in later),
            "first_step_data_wait_s": run["steps"][0]["data_wait_s"],
            "steps_waited": sum(w > threshold for w in waits),
            "time_waited_s": sum(w for w in waits if w > threshold),
            "max_data_wait_s": max(waits), "median_data_wait_s": statistics.median(waits),
            "worker_cpu_s": run["cpu_s"]["worker"], "rank_cpu_s": run["cpu_s"]["rank"],
            "worker_cores": run["cpu_s"]["worker"] / run["wall_s"],
            "worker_cpu_share": run["cpu_s"]["worker"] / (run["cpu_s"]["worker"]
                                                          + run["cpu_s"]["rank"]),
            "train_s": train_s}


def _recipe_yaml(args: argparse.Namespace, path: Path) -> Path:
    """tiny-llama.yaml with this benchmark's vocabulary, sequence length and batch."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-llama.yaml").read_text())
    data["model"].update(vocab_size=args.vocab_size, seq_length=args.seq_length)
    data["training"]["global_batch_size"] = args.global_batch
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/elastor-bench-data",
                        help="where the corpus and tokenizer are made and kept")
    parser.add_argument("--corpus-mb", type=float, default=64.0)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer-mb", type=float, default=8.0,
                        help="MB of text the tokenizer learns from")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=15, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="training runs; figures are their median")
    parser.add_argument("--wait-threshold", type=float, default=0.01, metavar="S",
                        help="a step whose micro-batches took longer than S seconds waited "
                             "on data (default 0.01: packed samples take about a ms)")
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

    # 2. The background worker under real training steps.
    recipe_path = _recipe_yaml(args, work / "bench-recipe.yaml")
    print(f"training: {args.repeats} x elastor train, {args.steps} steps of global batch {G} x "
          f"seq_length {args.seq_length} (tiny-llama, vocab {args.vocab_size}), "
          f"{args.data_workers} data worker(s), prefetch depth {args.prefetch_depth} ...",
          flush=True)
    runs = []
    for r in range(args.repeats):
        out = work / f"train-{r}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        runs.append(_waits(_train_once(recipe_path, cfg, args.steps, out), args.wait_threshold))
        print(f"  run {r + 1}: {runs[-1]['steps_waited']} of {args.steps - 1} steps waited, "
              f"{runs[-1]['time_waited_s']:.3f} s; step {runs[-1]['step_s']:.2f} s; worker "
              f"{runs[-1]['worker_cpu_s']:.1f} CPU s, rank {runs[-1]['rank_cpu_s']:.1f} CPU s; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    train = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    consumed_rate = G * args.seq_length / train["step_s"]
    print(f"  median: steps that waited on data after the first (> {args.wait_threshold * 1e3:g} "
          f"ms): {train['steps_waited']:g} of {args.steps - 1}, {train['time_waited_s']:.3f} s "
          f"waited; data time per step median {train['median_data_wait_s'] * 1e3:.1f} ms, max "
          f"{train['max_data_wait_s'] * 1e3:.1f} ms (first step "
          f"{train['first_step_data_wait_s']:.2f} s, start-up)")
    print(f"  step {train['step_s']:.2f} s ({consumed_rate:,.0f} tokens/s consumed); packing "
          f"worker {train['worker_cpu_s']:.1f} CPU s = {train['worker_cores']:.2f} of a core "
          f"over the run, {train['worker_cpu_share']:.1%} of the CPU the rank and its worker "
          f"used (rank {train['rank_cpu_s']:.1f} CPU s); at the index build's "
          f"{index_cpu_rate:,.0f} tokens per CPU second, keeping up takes "
          f"{consumed_rate / index_cpu_rate:.1%} of a core")

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
               "steps": args.steps, "repeats": args.repeats,
               "wait_threshold_s": args.wait_threshold, "train_median": train,
               "train_runs": runs, "consumed_tokens_per_s": consumed_rate, "resume_step": step,
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
