"""Benchmark checkpoint save and load: elastor vs Megatron-Core torch_dist, against
the physical limits of this machine.

    python tools/bench_checkpoint.py [--work DIR] [--out bench.json] [--scale small]

One 4-rank gloo world holds the state of one Llama-shaped model (fp32 weights plus
AdamW's two moments; the default shape moves ~1.4 GB per save) under TP2 x PP2 and
measures, every figure barrier to barrier (the slowest rank):

1. saves: elastor synchronous; elastor asynchronous (the blocking part, second save:
   buffers allocated, plan cached) and its time to commit; torch_dist through
   ``dist_checkpointing.save`` with ``FullyParallelSaveStrategyWrapper`` over the world,
   of the same ``sharded_state_dict()``; a raw sequential write + fsync of the same
   bytes (each rank its share); a plain memcpy of each rank's state into a reused
   buffer (the floor of the blocking part);
2. loads into the same layout and into a heterogeneous 3-rank layout (stage 0 TP2 on
   ranks 0-1, stage 1 TP1 on rank 2; rank 3 idle), elastor vs torch_dist, and a raw
   sequential read of the elastor files (the unique bytes). Before every load the
   checkpoint's files are evicted from the page cache (``posix_fadvise DONTNEED``; the
   files are clean after fsync), so loads start cold for our files. Bytes read are
   ``/proc/self/io`` ``rchar`` (bytes returned by read syscalls: what each loader asks
   of storage) and ``read_bytes`` (what the block device delivered), summed over ranks;
3. file count and bytes on disk of both formats.

It prints a table and writes every figure and the ratios to ``--out`` (JSON). It is
heavy (minutes, a few GB of RAM and disk): not part of the test suite.
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
    # ~114 M parameters: 1.37 GB of fp32 weights + moments.
    "default": dict(num_layers=4, hidden_size=1024, num_attention_heads=16,
                    num_query_groups=8, ffn_hidden_size=2816, vocab_size=32000),
    # A quick check of the tool itself.
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=8,
                  num_query_groups=4, ffn_hidden_size=704, vocab_size=4000),
}
HETERO = {"pipelines": [{"micro_batches": 8, "stages": [{"tp": 2, "layers": 2},
                                                         {"tp": 1, "layers": 2}]}]}
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
            moment = view_like(st.data, param, runner.optimizer.state[param][name])
            key = f"optimizer.{name}.{st.key}"
            out[key] = replace(st, key=key, data=moment)
    return out


# ---------------------------------------------------------------- the benchmark


def run_ranks(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from elastor_mcore import checkpoint as ck
    from elastor_mcore.runtime.state import chunk_policy, state_shards
    from elastor_mcore.compat import cpu
    from elastor_mcore.parallel.groups import GroupCache
    from elastor_mcore.parallel.layout import layout_from_dict, uniform_layout
    from elastor_mcore.config.recipe import recipe_from_dict

    cpu.apply_if_needed()
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy)

    w = World()
    work = Path(args.work)
    recipe = recipe_from_dict({
        "name": f"bench-{args.scale}",
        "model": {**MODELS[args.scale], "seq_length": 128},
        "training": {"global_batch_size": 8, "micro_batch_size": 1, "seed": 7}})
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

    # -- saves
    w.say("elastor synchronous save ...")
    saved = {}
    t, _ = w.timed(lambda: saved.setdefault("r", ck.save(
        dirs["elastor_sync"], 1, shards, {"model": {}}, keep=1, chunking=chunking)))
    figures["elastor_sync_save_s"] = t
    written = saved["r"].plan.bytes_by_rank().get(dist.get_rank(), 0)

    w.say("elastor asynchronous save (twice; the second is the steady state) ...")
    manager = ck.CheckpointManager(dirs["elastor_async"], chunking=chunking,
                                   policy=ck.SavePolicy(keep=1))
    for step in (1, 2):
        dist.barrier()
        start = time.perf_counter()
        block = manager.save(step, shards, {"model": {}}).block_s
        manager.wait()
        dist.barrier()
        figures[f"elastor_async_block_s_save{step}"] = w.max(block)
        figures[f"elastor_async_commit_s_save{step}"] = time.perf_counter() - start
    figures["elastor_async_block_s"] = figures["elastor_async_block_s_save2"]

    w.say("torch_dist save (fully parallel) ...")
    sd = mcore_state_dict(runner)
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1),
                                                dist.group.WORLD)
    t, _ = w.timed(lambda: dist_checkpointing.save(sd, str(dirs["torch_dist"]),
                                                   sharded_strategy=strategy))
    figures["torch_dist_save_s"] = t

    w.say("raw sequential write + fsync of the same bytes ...")
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

    figures["raw_write_s"], _ = w.timed(raw_write)

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
    figures["memcpy_s"], _ = w.timed(memcpy)
    figures["elastor_async_bytes_staged_max_rank"] = w.max(written)
    del flat

    # -- loads, same layout
    targets = state_shards(runner.model, runner.optimizer)
    needed_same = w.sum(state_bytes(targets))
    w.say("loads into the same layout (cold for the checkpoint files) ...")
    t, io = w.timed(lambda: ck.load(dirs["elastor_sync"], targets), dirs["elastor_sync"])
    figures.update(elastor_load_s=t, elastor_load_rchar=io["rchar"],
                   elastor_load_read_bytes=io["read_bytes"], load_bytes_needed=needed_same)
    load_strategy = TorchDistLoadShardedStrategy()
    t, io = w.timed(lambda: dist_checkpointing.load(mcore_state_dict(runner),
                                                    str(dirs["torch_dist"]), load_strategy),
                    dirs["torch_dist"])
    figures.update(torch_dist_load_s=t, torch_dist_load_rchar=io["rchar"],
                   torch_dist_load_read_bytes=io["read_bytes"])

    # -- loads, resharded into the heterogeneous 3-rank layout
    w.say("building the heterogeneous 3-rank layout (TP2 stage, TP1 stage; rank 3 idle) ...")
    del runner, targets, sd, shards
    hetero = build(recipe, layout_from_dict(HETERO), cache)
    active = cache.get([0, 1, 2])
    targets = state_shards(hetero.model, hetero.optimizer) if hetero else []
    needed_hetero = w.sum(state_bytes(targets))
    w.say("resharded loads ...")

    def elastor_reshard() -> None:
        if hetero is not None:
            ck.load(dirs["elastor_sync"], targets, group=active)

    t, io = w.timed(elastor_reshard, dirs["elastor_sync"])
    figures.update(elastor_reshard_load_s=t, elastor_reshard_load_rchar=io["rchar"],
                   elastor_reshard_load_read_bytes=io["read_bytes"],
                   reshard_bytes_needed=needed_hetero)
    hetero_sd = mcore_state_dict(hetero) if hetero else {}
    t, io = w.timed(lambda: dist_checkpointing.load(hetero_sd, str(dirs["torch_dist"]),
                                                    load_strategy), dirs["torch_dist"])
    figures.update(torch_dist_reshard_load_s=t, torch_dist_reshard_load_rchar=io["rchar"],
                   torch_dist_reshard_load_read_bytes=io["read_bytes"])

    w.say("raw sequential read of the elastor files (the unique bytes) ...")
    step_dir = dirs["elastor_sync"] / "step_00000001"
    files = sorted(p for p in step_dir.rglob("*") if p.is_file())
    buffer = bytearray(BLOCK)

    def raw_read() -> None:
        for path in files[dist.get_rank()::dist.get_world_size()]:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass

    t, io = w.timed(raw_read, step_dir)
    figures.update(raw_read_s=t, raw_read_bytes=io["rchar"])

    if w.rank == 0:
        figures["elastor_files"], figures["elastor_bytes_on_disk"] = disk_usage(step_dir)
        figures["torch_dist_files"], figures["torch_dist_bytes_on_disk"] = \
            disk_usage(dirs["torch_dist"])
        figures.update(ratios(figures))
        Path(args.out).write_text(json.dumps(figures, indent=1, sort_keys=True))
        print_table(figures, args.out)
    dist.barrier()
    dist.destroy_process_group()


def ratios(f: dict[str, float]) -> dict[str, float]:
    return {
        "save_speedup_vs_torch_dist": f["torch_dist_save_s"] / f["elastor_sync_save_s"],
        "save_fraction_of_raw_write": f["raw_write_s"] / f["elastor_sync_save_s"],
        "async_block_over_memcpy": f["elastor_async_block_s"] / f["memcpy_s"],
        "load_speedup_vs_torch_dist": f["torch_dist_load_s"] / f["elastor_load_s"],
        "reshard_load_speedup_vs_torch_dist":
            f["torch_dist_reshard_load_s"] / f["elastor_reshard_load_s"],
        "read_amplification": f["elastor_reshard_load_rchar"] / f["reshard_bytes_needed"],
        "torch_dist_read_amplification":
            f["torch_dist_reshard_load_rchar"] / f["reshard_bytes_needed"],
    }


def print_table(f: dict[str, float], out: str) -> None:
    gb = f["state_bytes_total"] / 1e9

    def row(name: str, seconds: float, nbytes: float | None = None, note: str = "") -> None:
        rate = f"{(nbytes or f['state_bytes_total']) / seconds / 1e9:7.2f} GB/s"
        print(f"  {name:44s} {seconds:8.3f} s  {rate}  {note}")

    print(f"\nstate: {gb:.2f} GB on 4 ranks ({f['parameters'] / 1e6:.0f} M parameters, fp32 "
          f"weights + Adam moments), TP2 x PP2")
    print("save")
    row("elastor synchronous", f["elastor_sync_save_s"])
    row("elastor async: blocking (2nd save)", f["elastor_async_block_s"],
        note=f"first save {f['elastor_async_block_s_save1']:.3f} s")
    row("elastor async: until committed", f["elastor_async_commit_s_save2"])
    row("torch_dist (fully parallel)", f["torch_dist_save_s"])
    row("raw write + fsync (physical limit)", f["raw_write_s"])
    row("memcpy of one rank's state (each rank)", f["memcpy_s"], f["state_bytes_max_rank"])
    print("load (cold page cache for the checkpoint)       time      rate      read (rchar / device)")
    for name, key, needed in (("elastor, same layout", "elastor_load", "load_bytes_needed"),
                              ("torch_dist, same layout", "torch_dist_load", "load_bytes_needed"),
                              ("elastor, TP2xPP2 -> hetero 3 ranks", "elastor_reshard_load",
                               "reshard_bytes_needed"),
                              ("torch_dist, TP2xPP2 -> hetero 3 ranks",
                               "torch_dist_reshard_load", "reshard_bytes_needed")):
        row(name, f[f"{key}_s"], f[needed],
            f"{f[f'{key}_rchar'] / 1e9:.2f} / {f[f'{key}_read_bytes'] / 1e9:.2f} GB")
    row("raw read of the unique bytes", f["raw_read_s"], f["raw_read_bytes"])
    print("on disk")
    print(f"  elastor     {f['elastor_files']:6.0f} files  {f['elastor_bytes_on_disk'] / 1e9:.3f} GB")
    print(f"  torch_dist  {f['torch_dist_files']:6.0f} files  "
          f"{f['torch_dist_bytes_on_disk'] / 1e9:.3f} GB")
    print("ratios")
    for key, value in ratios(f).items():
        print(f"  {key:40s} {value:6.2f}")
    print(f"\nfigures written to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=None,
                        help="scratch directory for the checkpoints (default: a temporary "
                             "one, removed afterwards)")
    parser.add_argument("--out", default="bench_checkpoint.json", help="JSON figures")
    parser.add_argument("--scale", choices=sorted(MODELS), default="default")
    parser.add_argument("--ranks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks:
        run_ranks(args)
        return 0
    from elastor_mcore.elastic.torchrun import run_torchrun

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    out = os.path.abspath(args.out)
    try:
        result = run_torchrun(4, "tools.bench_checkpoint",
                              ["--ranks", "--work", str(work), "--out", out,
                               "--scale", args.scale],
                              env={"PYTHONPATH": str(ROOT)})
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
