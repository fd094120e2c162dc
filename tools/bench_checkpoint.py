"""Benchmark checkpoint save and load: elastor vs Megatron-Core torch_dist, against
the physical limits of this machine.

    python tools/bench_checkpoint.py [--work DIR] [--out bench.json] [--scale medium]
                                     [--phase all|save|matrix] [--storage local|s3]

The state is one Llama-shaped model (12 heads, 12 query groups: TP 1, 2, 3 and 4 all
valid) with fp32 weights plus AdamW's two moments, filled with random values.

1. saves (a 4-rank gloo world, TP2 x PP2), each the median of ``REPEATS``: elastor
   synchronous (successive steps into one root with ``keep=1``, so each save after the
   first also prunes one); elastor asynchronous (the blocking part of the saves after
   the first: buffers allocated, plan cached) and its time to commit; torch_dist through
   ``dist_checkpointing.save`` with ``FullyParallelSaveStrategyWrapper`` of the same
   ``sharded_state_dict()``; a raw sequential write + fsync of the same bytes; a plain
   memcpy of each rank's state into a reused buffer (the floor of the blocking part);
   file count and bytes on disk;
2. the recovery matrix (an 8-rank gloo world, ``MATRIX``): per case, save under one
   layout (elastor and torch_dist), load under another, cold (the checkpoint's files
   evicted with ``posix_fadvise DONTNEED``; they are clean after fsync) and warm, and
   a raw sequential read of the elastor files split over the loading ranks, in
   ``REPEATS`` rounds of all six (the first load after the saves is slow for whichever
   method comes first; the medians drop it). Per load: wall (barrier to barrier), CPU seconds of every rank
   (``getrusage``, all threads), bytes read: ``/proc/self/io`` ``rchar`` (what the
   processes read from files, page cache or not) and ``read_bytes`` (what the device
   served) summed over ranks, and for elastor the bytes its readers took from the
   checkpoint files (``storage_bytes_read``; ``rchar`` would also count bytes received
   over gloo's sockets). Figures are medians.

``--storage s3`` measures object storage instead (``STORAGE_CASE``, a 4-rank world):
the same save (synchronous, TP2 x PP2) and a resharded load (to TP1 x PP2), once to
local disk and once to an ``s3://`` root, side by side, with the bytes each load took
from storage (TensorStore's counters, summed over ranks) against the bytes it needed.
The root is ``--s3-url`` with the endpoint and credentials of the AWS environment;
without ``AWS_ENDPOINT_URL`` the tool starts the tests' local moto server
(``tests/s3_server.py``; ``moto[server]`` must be installed) and uses a bucket there.

It prints a table and writes every figure and the ratios to ``--out`` (JSON), with the
1-minute load average at the end of the run. It is heavy (minutes, GBs of RAM and
disk): not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    # ~87 M parameters: 1.05 GB of fp32 weights + moments. 12 heads and 12 query groups
    # allow TP 1, 2, 3 and 4 (the matrix's layouts).
    "default": dict(num_layers=4, hidden_size=768, num_attention_heads=12,
                    num_query_groups=12, ffn_hidden_size=3072, vocab_size=32000),
    # ~16 M parameters, 0.19 GB: the matrix on a shared 2-core host.
    "medium": dict(num_layers=4, hidden_size=384, num_attention_heads=12,
                   num_query_groups=12, ffn_hidden_size=1536, vocab_size=8000),
    # A quick check of the tool itself.
    "small": dict(num_layers=4, hidden_size=192, num_attention_heads=12,
                  num_query_groups=12, ffn_hidden_size=768, vocab_size=2000),
}
MATRIX = {
    # case: (saved under, loaded under); every layout fits the matrix's 8-rank world.
    "R0_same": ("dp2-tp2-pp2", "dp2-tp2-pp2"),
    "R1_merge": ("dp1-tp2-pp2", "dp1-tp1-pp1"),
    "R2_hetero7": ("dp1-tp2-pp4", {"pipelines": [{"micro_batches": 8, "stages": [
        {"tp": 4, "layers": 2}, {"tp": 2, "layers": 1}, {"tp": 1, "layers": 1}]}]}),
    "R3_tp1pp4_tp4pp2": ("dp1-tp1-pp4", "dp1-tp4-pp2"),
    "R4_tp2_tp3": ("dp1-tp2-pp2", "dp1-tp3-pp2"),
}
MATRIX_RANKS = 8
STORAGE_CASE = ("dp1-tp2-pp2", "dp2-tp1-pp2")
"""``--storage s3``: saved under, loaded under (4 ranks)."""
REPEATS = 3
BLOCK = 16 << 20


# ---------------------------------------------------------------- measurement helpers


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def evict(directory: Path) -> None:
    """Drop ``directory``'s (clean) files from the page cache."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_usage(directory: Path) -> tuple[int, int]:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def state_bytes(shards) -> int:
    return sum(s.data.numel() * s.data.element_size() for s in shards)


class World:
    """Timing and reductions over the benchmark's world."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def max(self, value: float) -> float:
        import torch

        t = torch.tensor(float(value), dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t)

    def sum(self, value: float) -> float:
        import torch

        t = torch.tensor(float(value), dtype=torch.float64)
        self.dist.all_reduce(t)
        return float(t)

    def timed(self, fn, evict_dir: Path | None = None) -> tuple[float, dict[str, float]]:
        """World time of ``fn()`` and the read counters summed over ranks."""
        if evict_dir is not None and self.rank == 0:
            evict(evict_dir)
        self.dist.barrier()
        before = io_counters()
        start = time.perf_counter()
        fn()
        self.dist.barrier()
        elapsed = time.perf_counter() - start
        after = io_counters()
        io = {k: self.sum(after[k] - before[k]) for k in ("rchar", "read_bytes")}
        return elapsed, io


# ---------------------------------------------------------------- the state


def build(recipe, layout, cache):
    """This rank's model and optimizer under ``layout`` with random moments (None on
    idle ranks); random, so that no page is a shared zero page."""
    import torch

    from elastor_mcore.runtime.state import ensure_optimizer_state
    from elastor_mcore.runtime.train import setup_stage

    runner = setup_stage(recipe, layout, recipe.training.seed, cache)
    if runner is None:
        return None
    ensure_optimizer_state(runner.optimizer)
    g = torch.Generator().manual_seed(runner.groups.rank)
    for state in runner.optimizer.state.values():
        for name in ("exp_avg", "exp_avg_sq"):
            state[name].normal_(generator=g)
    return runner


def mcore_state_dict(runner) -> dict:
    """The same tensors as ``state_shards``, as mcore ShardedTensors (weights from the
    model's ``sharded_state_dict()``, moments as their views with the same geometry)."""
    from elastor_mcore.runtime.state import ADAM_MOMENTS
    from elastor_mcore.parallel.shards import owning_parameter, sharded_tensors, view_like

    out = {}
    for st in sharded_tensors(runner.model):
        out[st.key] = st
        param = owning_parameter(runner.model, st.data)
        for name in ADAM_MOMENTS:
            main = runner.optimizer.main_param(param)  # the fp32 weights AdamW holds
            moment = view_like(st.data, param, runner.optimizer.state[main][name])
            key = f"optimizer.{name}.{st.key}"
            out[key] = replace(st, key=key, data=moment)
    return out


# ---------------------------------------------------------------- the benchmark


def run_ranks(args: argparse.Namespace) -> None:
    """The saves, in one 4-rank world under TP2 x PP2."""
    import statistics

    import torch
    import torch.distributed as dist

    from elastor_mcore import checkpoint as ck
    from elastor_mcore.runtime.state import chunk_policy, state_shards
    from elastor_mcore.compat import cpu
    from elastor_mcore.parallel.groups import GroupCache
    from elastor_mcore.parallel.layout import uniform_layout

    cpu.apply_if_needed()
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    w = World()
    work = Path(args.work)
    recipe = bench_recipe(args.scale)
    chunking = chunk_policy(recipe)
    cache = GroupCache()
    w.say(f"building the {args.scale} model ({recipe.model.parameter_count() / 1e6:.0f} M "
          f"parameters) under TP2 x PP2 ...")
    runner = build(recipe, uniform_layout(1, 2, 2, recipe), cache)
    shards = state_shards(runner.model, runner.optimizer)
    mine = state_bytes(shards)
    total = w.sum(mine)
    figures: dict[str, float] = {"state_bytes_total": total, "state_bytes_max_rank": w.max(mine),
                                 "parameters": recipe.model.parameter_count()}
    dirs = {name: work / name for name in ("elastor_sync", "elastor_async", "torch_dist",
                                           "raw")}
    if w.rank == 0:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        dirs["torch_dist"].mkdir(parents=True)
        dirs["raw"].mkdir(parents=True)
    dist.barrier()
    w.say(f"state: {total / 1e9:.2f} GB in all, {mine / 1e6:.0f} MB on rank 0")

    # -- saves: REPEATS rounds of the three writes, each figure the median
    w.say(f"saves, {REPEATS} rounds of: elastor synchronous (successive steps into one "
          f"root, keep=1: from the second on, each also prunes the step before), torch_dist "
          f"(fully parallel), a raw sequential write + fsync of the same bytes ...")
    sd = mcore_state_dict(runner)
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1),
                                                dist.group.WORLD)
    payload = torch.randint(0, 255, (BLOCK,), dtype=torch.uint8).numpy().tobytes()
    share = int(total) // dist.get_world_size()

    def raw_write() -> None:
        path = dirs["raw"] / f"rank{dist.get_rank()}.bin"
        with open(path, "wb", buffering=0) as f:
            left = share
            while left > 0:
                left -= f.write(payload[:min(left, BLOCK)])
            os.fsync(f.fileno())
        os.unlink(path)

    saved: dict[str, ck.SaveResult] = {}
    rows: dict[str, list[float]] = {"elastor_sync_save_s": [], "torch_dist_save_s": [],
                                    "raw_write_s": []}
    for i in range(1, REPEATS + 1):
        rows["elastor_sync_save_s"].append(w.timed(lambda: saved.__setitem__("r", ck.save(
            dirs["elastor_sync"], i, shards, {"model": {}}, keep=1, chunking=chunking)))[0])
        ck.wait_for_pruning()  # in training it overlaps the next steps, not another save
        if w.rank == 0:
            (dirs["torch_dist"] / str(i)).mkdir()
        rows["torch_dist_save_s"].append(w.timed(lambda: dist_checkpointing.save(
            sd, str(dirs["torch_dist"] / str(i)), sharded_strategy=strategy))[0])
        if w.rank == 0 and i > 1:  # one checkpoint on disk, as elastor keeps
            shutil.rmtree(dirs["torch_dist"] / str(i - 1))
        rows["raw_write_s"].append(w.timed(raw_write)[0])
    for name, times in rows.items():
        figures.update({f"{name}_{i}": t for i, t in enumerate(times, 1)})
        figures[name] = statistics.median(times)
    written = saved["r"].plan.bytes_by_rank().get(dist.get_rank(), 0)

    w.say(f"elastor asynchronous save ({REPEATS + 1} steps; the first allocates the host "
          f"buffers and plans) ...")
    manager = ck.CheckpointManager(dirs["elastor_async"], chunking=chunking,
                                   policy=ck.SavePolicy(keep=1))
    for step in range(1, REPEATS + 2):
        dist.barrier()
        start = time.perf_counter()
        block = manager.save(step, shards, {"model": {}}).block_s
        manager.wait()
        dist.barrier()
        figures[f"elastor_async_block_s_save{step}"] = w.max(block)
        figures[f"elastor_async_commit_s_save{step}"] = time.perf_counter() - start
    manager.close()
    for name in ("block", "commit"):
        figures[f"elastor_async_{name}_s"] = statistics.median(
            figures[f"elastor_async_{name}_s_save{step}"] for step in range(2, REPEATS + 2))

    w.say("memcpy of each rank's state into a reused buffer ...")
    flat = torch.empty(mine, dtype=torch.uint8)
    flat.fill_(0)

    def memcpy() -> None:
        offset = 0
        for s in shards:
            n = s.data.numel() * s.data.element_size()
            flat[offset:offset + n].view(s.data.dtype).view(s.data.shape).copy_(s.data)
            offset += n

    memcpy()  # warm
    figures["memcpy_s"] = statistics.median(w.timed(memcpy)[0] for _ in range(REPEATS))
    figures["elastor_async_bytes_staged_max_rank"] = w.max(written)
    del flat

    if w.rank == 0:
        step_dir = saved["r"].path
        figures["elastor_files"], figures["elastor_bytes_on_disk"] = disk_usage(step_dir)
        figures["torch_dist_files"], figures["torch_dist_bytes_on_disk"] = \
            disk_usage(dirs["torch_dist"] / str(REPEATS))
        Path(args.out).write_text(json.dumps(figures, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


def bench_recipe(scale: str):
    from elastor_mcore.config.recipe import recipe_from_dict

    return recipe_from_dict({
        "name": f"bench-{scale}",
        "model": {**MODELS[scale], "seq_length": 128},
        "training": {"global_batch_size": 8, "micro_batch_size": 1, "seed": 7}})


def make_layout(spec, recipe):
    from elastor_mcore.parallel.layout import layout_from_dict, load_layout

    if isinstance(spec, dict):
        layout = layout_from_dict(spec)
        layout.validate(recipe)
        return layout
    return load_layout(spec, recipe)


def run_matrix(args: argparse.Namespace) -> None:
    """The reshard matrix: per case, save under one layout (elastor and torch_dist),
    load under another, cold and warm, in ``REPEATS`` rounds of every method; and a raw
    read of the elastor files split over the loading ranks."""
    import resource
    import statistics

    import torch.distributed as dist

    from elastor_mcore import checkpoint as ck
    from elastor_mcore.compat import cpu
    from elastor_mcore.parallel.groups import GroupCache
    from elastor_mcore.runtime.state import chunk_policy, state_shards

    cpu.apply_if_needed()
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy)

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    w = World()
    recipe = bench_recipe(args.scale)
    chunking = chunk_policy(recipe)
    cache = GroupCache()
    figures: dict[str, float] = {}
    for case in args.cases:
        save_spec, load_spec = MATRIX[case]
        w.say(f"{case}: save under {save_spec} ...")
        base = Path(args.work) / case
        dirs = {"elastor": base / "elastor", "torch_dist": base / "torch_dist"}
        if w.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
            dirs["torch_dist"].mkdir(parents=True)
        dist.barrier()
        runner = build(recipe, make_layout(save_spec, recipe), cache)
        shards = state_shards(runner.model, runner.optimizer) if runner else []
        group = runner.groups.active if runner else None
        if runner:
            ck.save(dirs["elastor"], 1, shards, {"model": {}}, group=group, keep=1,
                    chunking=chunking)
        dist.barrier()
        strategy = FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy("torch_dist", 1), dist.group.WORLD)
        dist_checkpointing.save(mcore_state_dict(runner) if runner else {},
                                str(dirs["torch_dist"]), sharded_strategy=strategy)
        del runner, shards
        w.say(f"{case}: load under {load_spec} ...")
        runner = build(recipe, make_layout(load_spec, recipe), cache)
        targets = state_shards(runner.model, runner.optimizer) if runner else []
        group = runner.groups.active if runner else None
        step_dir = dirs["elastor"] / "step_00000001"
        unique = sum(e.nbytes for e in ck.open(step_dir).manifest.tensors.values())
        figures[f"{case}_bytes_needed"] = w.sum(state_bytes(targets))
        figures[f"{case}_bytes_unique"] = unique
        files = sorted(p for p in step_dir.rglob("c/**/*") if p.is_file())
        loaders = dist.get_process_group_ranks(group) if runner else []
        buffer = bytearray(BLOCK)

        def elastor() -> None:
            if runner:
                ck.load(dirs["elastor"], targets, group=group)

        def torch_dist() -> None:
            dist_checkpointing.load(mcore_state_dict(runner) if runner else {},
                                    str(dirs["torch_dist"]), TorchDistLoadShardedStrategy())

        def raw() -> None:
            if runner:
                mine = loaders.index(dist.get_rank())
                for path in files[mine::len(loaders)]:
                    with open(path, "rb", buffering=0) as f:
                        while f.readinto(buffer):
                            pass

        methods = (("elastor", elastor, dirs["elastor"]),
                   ("torch_dist", torch_dist, dirs["torch_dist"]), ("raw", raw, dirs["elastor"]))
        rows: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(REPEATS):  # rounds of every method: the first load after the
            for mode in ("cold", "warm"):  # saves is slower for whichever comes first
                for name, fn, where in methods:
                    cpu0, stored0 = cpu_s(), ck.storage_bytes_read()
                    wall, io = w.timed(fn, where if mode == "cold" else None)
                    used = cpu_s() - cpu0
                    rows.setdefault((name, mode), []).append(dict(
                        wall_s=wall, cpu_s_max_rank=w.max(used), cpu_s_sum=w.sum(used),
                        rchar=io["rchar"], read_bytes=io["read_bytes"],
                        storage_bytes=w.sum(ck.storage_bytes_read() - stored0)))
        for (name, mode), measured in rows.items():
            for key in measured[0]:
                figures[f"{case}_{name}_{mode}_{key}"] = statistics.median(
                    r[key] for r in measured)
            figures.update({f"{case}_{name}_{mode}_wall_s_{i}": r["wall_s"]
                            for i, r in enumerate(measured, 1)})
            w.say(f"  {name:10s} {mode}: {figures[f'{case}_{name}_{mode}_wall_s']:.3f} s "
                  f"wall, {figures[f'{case}_{name}_{mode}_cpu_s_sum']:.2f} CPU-s")
        del runner, targets
        dist.barrier()
        if w.rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    if w.rank == 0:
        figures["matrix_ranks"] = dist.get_world_size()
        figures["repeats"] = REPEATS
        Path(args.out).write_text(json.dumps(figures, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


def run_storage(args: argparse.Namespace) -> None:
    """``--storage s3``: save and resharded load to local disk and to ``--s3-url``."""
    import torch.distributed as dist

    from elastor_mcore import checkpoint as ck
    from elastor_mcore.compat import cpu
    from elastor_mcore.parallel.groups import GroupCache
    from elastor_mcore.runtime.state import chunk_policy, state_shards

    cpu.apply_if_needed()
    dist.init_process_group("gloo")
    w = World()
    recipe = bench_recipe(args.scale)
    chunking = chunk_policy(recipe)
    cache = GroupCache()
    save_spec, load_spec = STORAGE_CASE
    figures: dict[str, float] = {}
    roots = {"local": str(Path(args.work) / "local"), "s3": args.s3_url.rstrip("/")}
    if w.rank == 0:
        shutil.rmtree(roots["local"], ignore_errors=True)
    for storage, root in roots.items():
        runner = build(recipe, make_layout(save_spec, recipe), cache)
        shards = state_shards(runner.model, runner.optimizer) if runner else []
        group = runner.groups.active if runner else None
        w.say(f"{storage}: save under {save_spec} to {root} ...")
        t, _ = w.timed(lambda: runner and ck.save(root, 1, shards, {"model": {}},
                                                   group=group, keep=1, chunking=chunking))
        figures[f"{storage}_save_s"] = t
        figures["state_bytes_total"] = w.sum(state_bytes(shards))
        del runner, shards
        runner = build(recipe, make_layout(load_spec, recipe), cache)
        targets = state_shards(runner.model, runner.optimizer) if runner else []
        group = runner.groups.active if runner else None
        w.say(f"{storage}: load under {load_spec} ...")
        before = ck.storage_bytes_read()
        t, _ = w.timed(lambda: runner and ck.load(root, targets, group=group))
        figures[f"{storage}_load_s"] = t
        figures[f"{storage}_load_bytes_read"] = w.sum(ck.storage_bytes_read() - before)
        figures["load_bytes_needed"] = w.sum(state_bytes(targets))
        del runner, targets
        dist.barrier()
    if w.rank == 0:
        shutil.rmtree(roots["local"], ignore_errors=True)
        Path(args.out).write_text(json.dumps(figures, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


def local_s3_server():
    """The tests' moto server with a bucket, its AWS environment set in this process
    (and so in the ranks it starts); None when ``AWS_ENDPOINT_URL`` names a server."""
    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
        return None
    from tests.s3_server import S3Server

    server = S3Server.start("bench", ROOT)
    os.environ.update(server.env)
    print(f"started a local S3 server (moto) at {server.endpoint}", flush=True)
    return server


def print_storage_table(f: dict[str, float], out: str) -> None:
    save, load = STORAGE_CASE
    print(f"\nstate: {f['state_bytes_total'] / 1e9:.3f} GB; save under {save}, load under "
          f"{load}; load needs {f['load_bytes_needed'] / 1e9:.3f} GB")
    print(f"  {'':8s} {'save s':>9s} {'load s':>9s} {'GB read':>9s} {'read/needed':>12s}")
    for storage in ("local", "s3"):
        read = f[f"{storage}_load_bytes_read"]
        print(f"  {storage:8s} {f[f'{storage}_save_s']:9.3f} {f[f'{storage}_load_s']:9.3f} "
              f"{read / 1e9:9.3f} {read / f['load_bytes_needed']:12.3f}")
    print(f"\nfigures written to {out}")


def ratios(f: dict[str, float]) -> dict[str, float]:
    """The headline ratios (see docs/benchmarks.md for what each one means)."""
    out = {}
    if "elastor_sync_save_s" in f:
        out.update(
            save_speedup_vs_torch_dist=f["torch_dist_save_s"] / f["elastor_sync_save_s"],
            save_speedup_vs_torch_dist_first=f["torch_dist_save_s_1"] / f["elastor_sync_save_s_1"],
            save_fraction_of_raw_write=f["raw_write_s"] / f["elastor_sync_save_s"],
            torch_dist_save_fraction_of_raw_write=f["raw_write_s"] / f["torch_dist_save_s"],
            async_block_over_memcpy=f["elastor_async_block_s"] / f["memcpy_s"])
    cases = [c for c in MATRIX if f"{c}_bytes_needed" in f]
    if not cases:
        return out

    def g(case: str, name: str, mode: str, key: str) -> float:
        return f[f"{case}_{name}_{mode}_{key}"]

    def speedup(case: str, mode: str) -> float:
        return g(case, "torch_dist", mode, "wall_s") / g(case, "elastor", mode, "wall_s")

    amplified = [c for c in cases
                 if g(c, "torch_dist", "cold", "rchar") >= 2 * f[f"{c}_bytes_needed"]]
    if amplified:  # ``--cases`` may leave none where torch_dist reads twice the bytes
        out["reshard_speedup_cold_amplified_min"] = min(speedup(c, "cold") for c in amplified)
    out.update(
        reshard_speedup_warm_min=min(speedup(c, "warm") for c in cases),
        load_cpu_s_per_gb=max(g(c, "elastor", "warm", "cpu_s_sum") / f[f"{c}_bytes_needed"]
                              for c in cases) * 1e9,
        torch_dist_load_cpu_s_per_gb=max(
            g(c, "torch_dist", "warm", "cpu_s_sum") / f[f"{c}_bytes_needed"]
            for c in cases) * 1e9,
        load_fraction_of_raw_read_cold_min=min(
            g(c, "raw", "cold", "wall_s") / g(c, "elastor", "cold", "wall_s") for c in cases),
        read_amplification_max=max(
            g(c, "elastor", "cold", "storage_bytes") / f[f"{c}_bytes_needed"] for c in cases),
        torch_dist_read_amplification_max=max(
            g(c, "torch_dist", "cold", "rchar") / f[f"{c}_bytes_needed"] for c in cases),
        job_read_amplification=max(
            g(c, "elastor", "cold", "read_bytes") / f[f"{c}_bytes_unique"] for c in cases),
        torch_dist_job_read_amplification=max(
            g(c, "torch_dist", "cold", "read_bytes") / f[f"{c}_bytes_unique"] for c in cases))
    return out


def print_table(f: dict[str, float], out: str) -> None:
    if "elastor_sync_save_s" in f:
        gb = f["state_bytes_total"] / 1e9

        def row(name: str, seconds: float, nbytes: float | None = None,
                note: str = "") -> None:
            rate = f"{(nbytes or f['state_bytes_total']) / seconds / 1e9:7.2f} GB/s"
            print(f"  {name:44s} {seconds:8.3f} s  {rate}  {note}")

        print(f"\nstate: {gb:.2f} GB on 4 ranks ({f['parameters'] / 1e6:.0f} M parameters, "
              f"fp32 weights + Adam moments), TP2 x PP2")
        print(f"save (median of {REPEATS})")
        row("elastor synchronous", f["elastor_sync_save_s"],
            note=f"first save {f['elastor_sync_save_s_1']:.3f} s")
        row("elastor async: blocking", f["elastor_async_block_s"],
            note=f"first save {f['elastor_async_block_s_save1']:.3f} s")
        row("elastor async: until committed", f["elastor_async_commit_s"])
        row("torch_dist (fully parallel)", f["torch_dist_save_s"])
        row("raw write + fsync (physical limit)", f["raw_write_s"])
        row("memcpy of one rank's state (each rank)", f["memcpy_s"], f["state_bytes_max_rank"])
        print(f"on disk: elastor {f['elastor_files']:.0f} files "
              f"{f['elastor_bytes_on_disk'] / 1e9:.3f} GB, torch_dist "
              f"{f['torch_dist_files']:.0f} files {f['torch_dist_bytes_on_disk'] / 1e9:.3f} GB")
    cases = [c for c in MATRIX if f"{c}_bytes_needed" in f]
    if cases:
        print(f"\nloads (median of {f['repeats']:.0f}; wall s | CPU-s summed over ranks, "
              f"max rank | GB read from storage)")
        for case in cases:
            save, load = MATRIX[case]
            print(f"{case}: {save} -> {load if isinstance(load, str) else 'hetero'}  "
                  f"needed {f[f'{case}_bytes_needed'] / 1e9:.3f} GB, unique "
                  f"{f[f'{case}_bytes_unique'] / 1e9:.3f} GB")
            for name in ("elastor", "torch_dist", "raw"):
                for mode in ("cold", "warm"):
                    k = f"{case}_{name}_{mode}"
                    read = f[f"{k}_storage_bytes"] if name == "elastor" else f[f"{k}_rchar"]
                    print(f"  {name:10s} {mode}  {f[f'{k}_wall_s']:7.3f} s | "
                          f"{f[f'{k}_cpu_s_sum']:6.2f} CPU-s, {f[f'{k}_cpu_s_max_rank']:6.2f} "
                          f"max | {read / 1e9:.3f} GB")
    print("ratios")
    for key, value in ratios(f).items():
        print(f"  {key:40s} {value:6.2f}")
    print(f"\nfigures written to {out}")


def _cases(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in cases if c not in MATRIX]
    if unknown or not cases:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {', '.join(unknown) or '(none given)'}; pick from "
            f"{', '.join(MATRIX)}")
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None,
                        help="scratch directory for the checkpoints (default: a temporary "
                             "one, removed afterwards)")
    parser.add_argument("--out", default="bench_checkpoint.json", help="JSON figures")
    parser.add_argument("--scale", choices=sorted(MODELS), default="default")
    parser.add_argument("--phase", choices=["all", "save", "matrix"], default="all",
                        help="saves (4 ranks), the load matrix (8 ranks), or both")
    parser.add_argument("--cases", type=_cases, default=list(MATRIX),
                        help="comma-separated cases of the load matrix to run (default: "
                             f"all of {','.join(MATRIX)})")
    parser.add_argument("--storage", choices=["local", "s3"], default="local",
                        help="local: the saves and the load matrix on --work; s3: save "
                             "and resharded load on local disk and on --s3-url, side by "
                             "side (--phase is ignored)")
    parser.add_argument("--s3-url", default="s3://bench/ckpt",
                        help="--storage s3: the checkpoint root (endpoint and credentials "
                             "from the AWS environment; default: a local moto server)")
    parser.add_argument("--ranks", choices=["save", "matrix", "storage"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks:
        {"save": run_ranks, "matrix": run_matrix, "storage": run_storage}[args.ranks](args)
        return 0
    from elastor_mcore.elastic.torchrun import run_torchrun

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    out = os.path.abspath(args.out)
    figures: dict[str, float] = {}
    phases = [("storage", 4)] if args.storage == "s3" else \
        [(p, n) for p, n in (("save", 4), ("matrix", MATRIX_RANKS)) if args.phase in ("all", p)]
    server = local_s3_server() if args.storage == "s3" else None
    try:
        for phase, nproc in phases:
            part = f"{out}.{phase}"
            result = run_torchrun(nproc, "tools.bench_checkpoint",
                                  ["--ranks", phase, "--work", str(work / phase),
                                   "--out", part, "--scale", args.scale,
                                   "--cases", ",".join(args.cases),
                                   "--s3-url", args.s3_url],
                                  env={"PYTHONPATH": str(ROOT)})
            if result.returncode:
                return result.returncode
            figures.update(json.loads(Path(part).read_text()))
            os.unlink(part)
    finally:
        if server is not None:
            server.stop()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    figures["load_average_1min"] = os.getloadavg()[0]
    if args.storage == "s3":
        Path(out).write_text(json.dumps(figures, indent=1, sort_keys=True))
        print_storage_table(figures, out)
        return 0
    figures.update(ratios(figures))
    Path(out).write_text(json.dumps(figures, indent=1, sort_keys=True))
    print_table(figures, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
