"""Every Megatron-LM and Megatron-Core function Elastor replaces, in the order a
``pretrain_gpt.py`` run first calls them (``PATCHES``), and ``install``, which
replaces them.

Functions are replaced as module attributes because Megatron looks them up at call
time (``mpu.initialize_model_parallel(...)``, ``dist_checkpointing.save(...)``); a
name another module imported by value is replaced in that module too. A name the
installed release does not have is skipped (``PATCHES`` names which release has it).
Each replacement calls the original unless Elastor's options say otherwise, so
without ``--elastor-*`` flags Megatron runs as it would without Elastor.

A run, in order (``docs/megatron-lm.md`` has the same list as a table):

0. Parsing (``args.py``, not a patch): Megatron-LM's parser gets Elastor's flags
   and, right after it parses, sets TP, PP and the global batch from
   ``--elastor-layout`` and refuses what cannot run (``translate.py``, and
   ``training.unsupported_reason`` on a heterogeneous layout).
1. Validation: ``validate_args`` checks a heterogeneous layout's placeholders as one
   rank.
2. Parallel state: ``initialize_model_parallel`` installs the layout's groups, then
   rewrites each rank's arguments to its stage.
3. Model and optimizer: the model config is rebuilt from the adapted arguments,
   replicas are made equal and ZeRO-1 spans pipelines (its all-gather driven through
   the model chunk under ``--overlap-param-gather``).
4. Loading (``--load``): the load timed, a failed one reported (``loop.py``), the
   tracker and checkpoint on object storage, zarr checkpoints read, per-layer keys.
5. Training: data per pipeline, Elastor's schedule (sequence parallelism, the
   reduction overlapping the backward), every iteration reported to a launcher
   watching the job (``loop.py``), the global gradient norm, evaluations, the memory
   report.
6. Saving (``--save``): zarr, foreground or async, to a directory or ``s3://``; the
   launcher hears each save begin and end.

The state every replacement shares is one ``installation.Installation``; its options
are read on first use (Megatron-LM parses its arguments after ``install``).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from elastor_mcore.integrations.megatron_lm import loop, object_storage, training, zarr_format
from elastor_mcore.integrations.megatron_lm.installation import (
    ElastorOptions, Installation, OnParallelState)
from elastor_mcore.parallel.groups import GroupCache, build_groups, install as install_groups

log = logging.getLogger(__name__)

Make = Callable[[Any, Installation], Any]
"""``make(original, installation)``: the replacement of one function."""


@dataclass(frozen=True)
class Patch:
    """``module.name`` is replaced by ``make(original, installation)``."""

    module: str
    name: str
    make: Make
    when: str
    """When Megatron calls it (first), and which release has it if not both."""
    why: str
    megatron_lm: bool = True
    """Part of Megatron-LM's training (skipped where ``megatron.training`` is not
    importable, e.g. a script on Megatron-Core alone)."""

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"


def stateless(make: Callable[[Any], Any]) -> Make:
    """A replacement that needs only the original."""
    return lambda original, installation: make(original)


def wrap_initialize(original: Callable, installation: Installation) -> Callable:
    """Under a layout: build its groups (collective over the world), install this
    rank's into ``parallel_state`` (``parallel.groups.install``, the one writer of its
    globals), then hand them to ``on_parallel_state``."""
    def initialize_model_parallel(*args, **kwargs):
        layout = installation.layout
        if layout is None:
            return original(*args, **kwargs)
        groups = build_groups(layout, GroupCache())
        installation.groups = groups
        installation.pg_collection = install_groups(groups) if groups is not None else None
        log.info("rank installed for layout %s", layout.describe())
        if installation.on_parallel_state is not None:
            installation.on_parallel_state(groups, layout)
        return None
    return initialize_model_parallel


_CKPT = "megatron.training.checkpointing"
_DIST = "megatron.core.dist_checkpointing"
_SERIALIZATION = "megatron.core.dist_checkpointing.serialization"
_TRAINING = "megatron.training.training"
_TRACKER = "the tracker latest_checkpointed_iteration.txt may be an s3:// object"

PATCHES: tuple[Patch, ...] = (
    # 1. validation
    Patch("megatron.training.arguments", "validate_args", stateless(training.wrap_validate),
          "parse_and_validate_args, before pretrain (core_v0.19.0)",
          "a heterogeneous layout's placeholder TP 1 x PP 1 is validated as one rank, so "
          "its data-parallel size (1) divides any global batch (--sequence-parallel, which "
          "it turns off at TP 1, comes back on the stages of TP > 1 in adapt_args)"),
    Patch("megatron.training.initialize", "validate_args", stateless(training.wrap_validate),
          "initialize_megatron, inside pretrain (core_v0.16.1)", "the same"),
    # 2. parallel state
    Patch("megatron.core.parallel_state", "initialize_model_parallel", wrap_initialize,
          "initialize_megatron, once torch.distributed is up",
          "the layout's groups instead of Megatron's uniform grid; then this rank's "
          "arguments become its stage's (TP, PP, sequence parallelism, layers per stage, "
          "data-parallel size, micro-batch count, layout-independent vocabulary padding; "
          "args.adapt_args)",
          megatron_lm=False),
    # 3. model and optimizer
    Patch(_TRAINING, "setup_model_and_optimizer", training.wrap_setup_model,
          "pretrain, before the model is built",
          "core_v0.19.0's pretrain_gpt.py built the model config before the parallel state "
          "existed; under a layout it is rebuilt from this rank's adapted arguments"),
    Patch(_TRAINING, "get_megatron_optimizer", training.wrap_get_optimizer,
          "setup_model_and_optimizer, once the model exists",
          "heterogeneous: every weight held in several pipelines takes its lowest-ranked "
          "holder's initial values (a tied embedding's last-stage copy a first stage's); "
          "--use-distributed-optimizer becomes ZeRO-1 across pipelines (zero_optimizer.py), "
          "Megatron's optimizer built without fp32 copies of the weights; "
          "under --overlap-param-gather the model chunk's start_param_sync and forward "
          "pre-hook switches become ZeRO-1's all-gather (overlap.py); "
          "--elastor-report-memory measures the tensors the build allocates"),
    # 4. loading
    Patch(_TRAINING, "load_checkpoint", loop.wrap_load,
          "setup_model_and_optimizer, with --load",
          "the load timed for a launcher watching the job, a failed load reported to it "
          "(which then resumes from the iteration before)"),
    Patch(_CKPT, "isfile", stateless(object_storage.wrap_isfile),
          "load_checkpoint: does the tracker exist (core_v0.16.1)", _TRACKER),
    Patch(_CKPT, "open_file", stateless(object_storage.wrap_open),
          "load_checkpoint reads the tracker, save_checkpoint writes it (core_v0.16.1)",
          _TRACKER),
    Patch(_CKPT, "maybe_msc", stateless(object_storage.ObjectStoreAwareClient),
          "the tracker's existence, read and write (core_v0.19.0)", _TRACKER),
    Patch(_CKPT, "_get_checkpoint_format", stateless(object_storage.wrap_checkpoint_format),
          "load_checkpoint, for the checkpoint's format",
          "a checkpoint on object storage must be an elastor zarr one"),
    Patch(_DIST, "check_is_distributed_checkpoint",
          stateless(object_storage.wrap_is_distributed),
          "the same, and finding rank 0's checkpoint", "it may be an s3:// URL"),
    Patch(_DIST, "load_common_state_dict", stateless(zarr_format.wrap_load_common),
          "load_checkpoint: rank 0 reads the saved arguments and iteration",
          "a zarr checkpoint keeps its common state in its own common.pt", megatron_lm=False),
    Patch(_SERIALIZATION, "load_common_state_dict", stateless(zarr_format.wrap_load_common),
          "load_content_metadata", "the same", megatron_lm=False),
    Patch(_CKPT, "_build_sharded_state_dict_metadata", zarr_format.wrap_sharded_metadata,
          "load_checkpoint and save_checkpoint, before the sharded state dict",
          "per-layer keys under a layout: with stacked layer keys a heterogeneous layout's "
          "shards of one tensor overlap inconsistently"),
    Patch(_SERIALIZATION, "get_default_load_sharded_strategy",
          stateless(zarr_format.wrap_load_strategy),
          "load_checkpoint, before the load",
          "a zarr checkpoint's backend is unknown to Megatron-Core's strategies",
          megatron_lm=False),
    Patch(_CKPT, "get_default_load_sharded_strategy", stateless(zarr_format.wrap_load_strategy),
          "the same, imported by value (core_v0.16.1)", "the same"),
    Patch(_DIST, "load", zarr_format.wrap_load, "load_checkpoint",
          "zarr checkpoints are read by Elastor (any layout); others by Megatron-Core",
          megatron_lm=False),
    Patch(_SERIALIZATION, "load", zarr_format.wrap_load, "the same",
          "the same", megatron_lm=False),
    # 5. training
    Patch(_TRAINING, "build_pretraining_data_loader", training.wrap_data_loader,
          "pretrain, after the model",
          "heterogeneous: each pipeline reads its slice of every global batch"),
    Patch(_TRAINING, "train", training.wrap_train, "pretrain, once",
          "heterogeneous: refuses several optimizers (the global norm is given to one); "
          "--elastor-report-memory: keeps the optimizer for the report"),
    Patch(_TRAINING, "get_forward_backward_func", training.wrap_schedule_getter,
          "every step",
          "heterogeneous: Elastor's 1F1B with its P2P between stages of different TP "
          "(sequence-parallel rows re-split) and the gradient reduction across pipelines "
          "(started during the backward under --overlap-grad-reduce); "
          "--elastor-report-memory: step 2 measured beside the planner (any layout)"),
    Patch(_TRAINING, "train_step", loop.wrap_train_step, "every iteration",
          "a launcher watching the job hears every iteration begin and end, with its loss "
          "and time (heartbeats, metrics, the failure plan's injections)"),
    Patch("megatron.core.optimizer.optimizer", "get_grad_norm_fp32", training.wrap_grad_norm,
          "every step, in the optimizer",
          "heterogeneous: the global norm the schedule computed over every rank"),
    Patch(_TRAINING, "evaluate_and_print_results", loop.between_iterations("evaluation"),
          "every --eval-interval iterations",
          "a launcher watching the job allows an evaluation its start-up timeout"),
    # 6. saving
    Patch(_TRAINING, "save_checkpoint_and_time", loop.between_iterations("save"),
          "every --save-interval iterations, and at the end",
          "a launcher watching the job allows a save its start-up timeout"),
    Patch(_CKPT, "ensure_directory_exists", stateless(object_storage.wrap_ensure_directory),
          "save_checkpoint", "object-store prefixes need no directory"),
    Patch(_DIST, "save", zarr_format.wrap_save, "save_checkpoint",
          "--elastor-ckpt-format zarr: the elastor zarr format, async under --async-save",
          megatron_lm=False),
    Patch(_SERIALIZATION, "save", zarr_format.wrap_save, "the same", "the same",
          megatron_lm=False),
)
"""In the order of a run's first call (``docs/megatron-lm.md`` lists the same)."""

_installed: Installation | None = None
"""This process's installation (one at most)."""


def install(options: ElastorOptions | Callable[[], ElastorOptions],
            on_parallel_state: OnParallelState | None = None) -> Installation:
    """Apply ``PATCHES`` (those of Megatron-LM only where ``megatron.training`` is
    importable). Once per process: a second call replaces the options. Options may be
    given directly (tests, custom scripts) or as a provider called on first use."""
    global _installed
    provider = options if callable(options) else (lambda: options)
    if _installed is not None:
        _installed.reconfigure(provider, on_parallel_state)
        return _installed
    installation = Installation(provider, on_parallel_state)
    megatron_lm = _megatron_lm_importable()
    for patch in PATCHES:
        if patch.megatron_lm and not megatron_lm:
            continue
        module = importlib.import_module(patch.module)
        if not hasattr(module, patch.name):
            log.debug("%s: not in this release", patch.target)
            continue
        original = getattr(module, patch.name)
        installation.originals.append((module, patch.name, original))
        setattr(module, patch.name, patch.make(original, installation))
        log.debug("replaced %s (called %s): %s", patch.target, patch.when, patch.why)
    _installed = installation
    return installation


def _megatron_lm_importable() -> bool:
    try:
        importlib.import_module(_CKPT)
    except ImportError:
        log.debug("megatron.training is not importable; patching Megatron-Core only")
        return False
    return True


def uninstall() -> None:
    """Restore every replaced function (tests; a process normally keeps them)."""
    global _installed
    if _installed is not None:
        for module, name, original in reversed(_installed.originals):
            setattr(module, name, original)
        _installed = None
