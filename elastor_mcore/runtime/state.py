"""The training state of one rank, as checkpoint shards, and its manifest fields.

A rank's state is its model shards (mcore ShardedTensors) and, for each of them, the
matching slices of AdamW's moments, stored under ``optimizer.exp_avg.<key>`` and
``optimizer.exp_avg_sq.<key>``. Each is a global tensor in the checkpoint, so any
layout can load them. The weights stored are the fp32 main parameters (the bf16
weights of a mixed-precision run are their rounding), so fp32 and bf16 runs read and
write the same checkpoint. The manifest records what a resume needs besides tensors: the
model config (checked on load), the layout at save time, the data source (checked on
load: another corpus or tokenizer is refused) and position, the optimizer's
hyper-parameters and step count, the lr schedule's position (mcore's
``OptimizerParamScheduler.state_dict``), and the RNG state.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from elastor_mcore import checkpoint
from elastor_mcore.checkpoint import ChunkPolicy, CheckpointError, LocalShard, Manifest
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.config.data import DataConfig
from elastor_mcore.data.prepare import fingerprint_change
from elastor_mcore.parallel.shards import (
    ADAM_STATE_PREFIXES, owning_parameter, replica_classes, sharded_tensors, view_like)
from elastor_mcore.runtime.distributed_optimizer import DistributedOptimizer
from elastor_mcore.runtime.optimizer import StageOptimizer

log = logging.getLogger(__name__)

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def ensure_optimizer_state(optimizer: StageOptimizer) -> None:
    """Create AdamW's per-parameter state (zeros) where it does not exist yet, so a
    load has tensors to fill and a save has moments to write before the first step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for name in ADAM_MOMENTS:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_shards(model: torch.nn.Module,
                 optimizer: StageOptimizer | DistributedOptimizer) -> list[LocalShard]:
    """Every tensor of this rank's training state, as views (no copies): the fp32
    main weights and their moments; under ZeRO-1 only the boxes this rank owns."""
    ensure_optimizer_state(optimizer)
    if isinstance(optimizer, DistributedOptimizer):
        return [shard for main in optimizer.main_shards() for shard in (main, *(
            LocalShard(f"optimizer.{name}.{main.key}", main.global_shape, main.global_offset,
                       optimizer.state[main.data][name]) for name in ADAM_MOMENTS))]
    shards = []
    for st in sharded_tensors(model):
        shape, offset = tuple(st.global_shape), tuple(st.global_offset)
        param = owning_parameter(model, st.data)
        main = optimizer.main_param(param)
        shards.append(LocalShard(st.key, shape, offset, view_like(st.data, param, main)))
        for name in ADAM_MOMENTS:
            moment = view_like(st.data, param, optimizer.state[main][name])
            shards.append(LocalShard(f"optimizer.{name}.{st.key}", shape, offset, moment))
    return shards


def state_replicas(layout: Layout,
                   optimizer: StageOptimizer | DistributedOptimizer) -> checkpoint.Replicas:
    """Which ranks hold the same training state (``state_shards``): each stage's
    data-parallel replicas, so a save plans from one of them and a load's members
    share their class's reads (``checkpoint.Replicas``); under ZeRO-1 none, each
    element's state on one rank (``disjoint``: a load's ranks read their own, with no
    owner planning their reads, and a save's write their own in the files of the
    layout's ``grid``, with no owner hearing from every holder)."""
    if isinstance(optimizer, DistributedOptimizer):
        grid = optimizer.file_grid()
        return checkpoint.Replicas(disjoint=True, grid={
            prefix + key: cuts for key, cuts in grid.items() for prefix in ADAM_STATE_PREFIXES})
    return checkpoint.Replicas(replica_classes(layout))


def optimizer_step_count(optimizer: StageOptimizer) -> int:
    steps = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
    return steps.pop() if len(steps) == 1 else 0


def _encode_rng() -> str:
    """The CPU generator's state (a uint8 tensor) as base64 of its raw bytes: the
    manifest stays plain JSON, never a pickle."""
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def data_fields(data: DataConfig, seed: int) -> dict:
    """The data source as a checkpoint records it (manifest key ``data``): what the
    samples came from and the fingerprint a resume compares (``check_resumable``)."""
    return {"kind": data.kind, "paths": [str(Path(p).resolve()) for p in data.paths],
            "tokenizer": str(Path(data.tokenizer).resolve()) if data.tokenizer else None,
            "fingerprint": data.fingerprint, "shuffle": data.shuffle, "seed": seed}


def manifest_fields(recipe: Recipe, layout: Layout, step: int, seed: int,
                    optimizer: StageOptimizer) -> dict:
    """The non-tensor state a resume needs (plain JSON); the run adds ``data_fields``."""
    return {
        "model": asdict(recipe.model),
        "layout": layout.to_dict(),
        "consumed_samples": step * recipe.training.global_batch_size,
        "rng": {"torch_cpu": _encode_rng()},
        "optimizer": {**asdict(recipe.training.optimizer), "type": "AdamW",
                      "step": optimizer_step_count(optimizer)},
        "lr_schedule": optimizer.scheduler.state_dict(),
        "training": {"global_batch_size": recipe.training.global_batch_size,
                     "micro_batch_size": recipe.training.micro_batch_size,
                     "seed": seed},
    }


def chunk_policy(recipe: Recipe) -> ChunkPolicy:
    """Chunks aligned to every TP degree the model allows, so any layout's shard is a
    union of chunks."""
    return ChunkPolicy(split_sizes=tuple(recipe.model.valid_tp_sizes))


def check_resumable(manifest: Manifest, recipe: Recipe, seed: int,
                    data: DataConfig | None = None, allow_data_change: bool = False) -> None:
    """Refuse a checkpoint from another model or another data order, naming the field;
    with ``data``, also one saved on another corpus or tokenizer, unless
    ``allow_data_change`` (then a warning says what changed)."""
    checkpoint.check_compatible(manifest, asdict(recipe.model))
    saved_data = manifest.extra.get("data", {})
    if data is not None and saved_data.get("fingerprint") and data.fingerprint:
        change = fingerprint_change(saved_data["fingerprint"], data.fingerprint)
        if change and allow_data_change:
            log.warning("resuming step %d on other data (--allow-data-change): %s; the sample "
                        "stream from here on is not the one the checkpoint trained on",
                        manifest.step, change)
        elif change:
            raise CheckpointError(
                f"checkpoint of step {manifest.step} was saved on other data: {change} (saved "
                f"with {saved_data['kind']} {' '.join(saved_data['paths'])}, tokenizer "
                f"{saved_data['tokenizer']}). Resume on the checkpoint's data, start from "
                f"scratch, or pass --allow-data-change to continue on the new data on purpose")
    saved = manifest.extra.get("training", {})
    run = {"global_batch_size": recipe.training.global_batch_size, "seed": seed}
    for field, value in run.items():
        if field in saved and saved[field] != value:
            raise CheckpointError(
                f"checkpoint of step {manifest.step} was saved with training.{field}="
                f"{saved[field]!r} but this run has {value!r}; the data order would differ. "
                f"Use the checkpoint's value or start from scratch")


def check_lr_schedule(manifest: Manifest, optimizer: StageOptimizer) -> None:
    """Refuse a checkpoint whose lr schedule differs from the run's (Megatron refuses
    too, unless told to override): the learning rate would jump at the resume."""
    saved = manifest.extra.get("lr_schedule")
    if saved is None:
        return
    for name, value in optimizer.scheduler.state_dict().items():
        if name != "num_steps" and saved.get(name, value) != value:
            raise CheckpointError(
                f"checkpoint of step {manifest.step} was saved with the lr schedule's "
                f"{name}={saved[name]!r} (mcore OptimizerParamScheduler, from "
                f"training.optimizer.lr and training.lr_schedule) but this run has "
                f"{value!r}. Use the checkpoint's schedule or start from scratch")


def restore_non_tensor_state(manifest: Manifest, optimizer: StageOptimizer) -> None:
    """Optimizer step counts, the lr schedule's position and the RNG state, after the
    tensors are loaded. A checkpoint from before schedules had a constant lr: its
    position is its step's samples."""
    step = (manifest.optimizer or {}).get("step", manifest.step)
    schedule = manifest.extra.get("lr_schedule") or {
        **optimizer.scheduler.state_dict(),
        "num_steps": manifest.step * optimizer.recipe.training.global_batch_size}
    set_position(optimizer, step, schedule)
    if manifest.rng and "torch_cpu" in manifest.rng:
        torch.set_rng_state(_decode_rng(manifest.rng["torch_cpu"]))


def set_position(optimizer: StageOptimizer, step: int, schedule: dict) -> None:
    """AdamW's step count and the lr schedule's state (``scheduler.state_dict()``) after
    the tensors of ``step`` are in place (a load, or a restore from memory)."""
    for state in optimizer.state.values():
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
    scheduler = optimizer.scheduler
    scheduler.num_steps = 0  # mcore's load_state_dict steps forward by the saved count
    scheduler.load_state_dict(schedule)


def describe_load(path: Path, manifest: Manifest, layout: Layout) -> str:
    saved = manifest.layout
    same = saved == layout.to_dict()
    return (f"resumed from {path} at step {manifest.step} (saved under "
            f"{'the same layout' if same else 'another layout'})")
