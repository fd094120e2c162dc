"""The two calls ``patches/`` add to ``pretrain_gpt.py``, and what they do to
Megatron-LM's arguments.

``extra_args_provider`` adds Elastor's flags to Megatron-LM's parser (a separate
``--elastor-ckpt-format``: Megatron's ``--ckpt-format`` choices are a fixed list) and
makes the parser, right after it parses, set TP, PP and the global batch from
``--elastor-layout`` (``translate.apply_layout_args``) and refuse what cannot run:
parser errors on every rank, before torch.distributed starts.

``install_hooks`` applies ``hooks.PATCHES`` with options read from Megatron-LM's parsed
arguments on first use (it parses them inside ``pretrain`` at core_v0.16.1, just before
it at core_v0.19.0). Once the parallel state exists, each rank's arguments are
rewritten to its own stage of the layout (``adapt_args``: TP degree, stage count,
layers per stage, data-parallel size, layout-independent vocabulary padding), so
Megatron-LM's model provider builds exactly that rank's stage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

from elastor_mcore.checkpoint import ChunkPolicy
from elastor_mcore.checkpoint.megatron_dir import ZarrSaveSettings
from elastor_mcore.compat.mcore import set_tensor_parallel_args
from elastor_mcore.integrations.megatron_lm import hooks, training
from elastor_mcore.integrations.megatron_lm.installation import (
    CKPT_FORMATS, ElastorOptions, Installation)
from elastor_mcore.integrations.megatron_lm.translate import (
    apply_layout_args, check_checkpoint_flags, explicit_flags, llama_differences,
    recipe_from_args, requested_sequence_parallel)
from elastor_mcore.parallel.groups import RankGroups
from elastor_mcore.parallel.layout import Layout, LayoutError, load_layout, mcore_pipeline_layout

log = logging.getLogger(__name__)


def add_elastor_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Elastor's flags to Megatron-LM's parser (an ``extra_args_provider``)."""
    group = parser.add_argument_group("elastor", "Elastor: heterogeneous layouts and "
                                      "partition-agnostic zarr checkpoints")
    group.add_argument("--elastor-layout", default=None, metavar="SPEC",
                       help="layout YAML file or shorthand like dp2-tp2-pp2; builds "
                            "Elastor's process groups instead of Megatron's uniform grid")
    group.add_argument("--elastor-ckpt-format", default=None, choices=CKPT_FORMATS,
                       help="save checkpoints in the elastor zarr format (any layout "
                            "loads them); zarr and torch_dist checkpoints both load, "
                            "told apart by metadata.json")
    group.add_argument("--elastor-ckpt-keep", type=int, default=0, metavar="N",
                       help="keep only the N newest zarr checkpoints under --save "
                            "(default 0: keep all)")
    group.add_argument("--elastor-split-sizes", type=int, nargs="+", default=None,
                       metavar="TP",
                       help="TP degrees that later layouts may load the checkpoint with; "
                            "inner chunks are cut so each one reads whole chunks "
                            "(default: every TP degree the model allows)")
    group.add_argument("--elastor-report-memory", action="store_true",
                       help="with --elastor-layout: log every rank's memory in the second "
                            "training step (weights, gradients, optimizer state, "
                            "activations saved for backward) beside the planner's "
                            "prediction for its stage")
    group.add_argument("--elastor-hardware", default=None, metavar="PROFILE",
                       help="hardware profile of --elastor-report-memory's prediction "
                            "(default: the shipped CPU profile on CPU, none on GPUs)")
    _derive_from_layout_on_parse(parser)
    return parser


def _derive_from_layout_on_parse(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` fill the layout's flags in as soon as it has parsed, i.e. before
    Megatron-LM validates them; a bad layout is a parser error on every rank, before
    torch.distributed starts."""
    original = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None, namespace=None):
        parsed, extras = original(args, namespace)
        # Megatron-LM's validation turns it off where TP is 1, as it is on a
        # heterogeneous layout until each rank knows its stage (adapt_args).
        parsed.elastor_sequence_parallel = bool(parsed.sequence_parallel)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            check_checkpoint_flags(parsed)
            if parsed.elastor_report_memory and not parsed.elastor_layout:
                raise ValueError("--elastor-report-memory compares each rank with the "
                                 "planner's stage of --elastor-layout; add --elastor-layout "
                                 "(a shorthand such as dp2-tp2-pp1 for Megatron's grid)")
            if parsed.elastor_layout:
                layout = apply_layout_args(parsed, explicit_flags(argv),
                                           int(os.environ.get("WORLD_SIZE", "1")))
                reason = None if layout.is_uniform else training.unsupported_reason(
                    layout, parsed)
                if reason:
                    raise ValueError(f"--elastor-layout {parsed.elastor_layout}: {reason}")
        except (ValueError, LayoutError) as exc:
            parser.error(str(exc))
        return parsed, extras

    parser.parse_known_args = parse_known_args


def extra_args_provider(base: Callable | None = None) -> Callable:
    """``extra_args_provider`` adding Elastor's flags after ``base``'s (e.g. ModelOpt's)."""
    def provider(parser):
        if base is not None:
            parser = base(parser)
        return add_elastor_args(parser)
    return provider


def _tokenizer_vocab_size() -> int | None:
    """The unpadded vocabulary of Megatron-LM's tokenizer (built before the parallel
    state), or None before it exists."""
    from megatron.training import get_tokenizer

    try:
        return get_tokenizer().vocab_size
    except AssertionError:  # megatron.training.global_vars: "tokenizer is not initialized"
        return None


def options_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> ElastorOptions:
    """Hook options from parsed Megatron-LM arguments (validates the layout)."""
    check_checkpoint_flags(args)
    recipe = recipe_from_args(args, vocab_size)
    layout = load_layout(args.elastor_layout, recipe) if args.elastor_layout else None
    split = tuple(args.elastor_split_sizes or recipe.model.valid_tp_sizes)
    differences = llama_differences(args)
    extra = {} if differences else {"model": recipe.to_dict()["model"]}
    if differences:
        log.info("not recording a model in zarr manifests: the Megatron-LM model is not "
                 "Llama-style (needs %s); `elastor convert --to hf` will need --recipe",
                 ", ".join(differences))
    if layout is not None:
        extra["layout"] = layout.to_dict()
    return ElastorOptions(
        layout=layout, ckpt_format=args.elastor_ckpt_format,
        save=ZarrSaveSettings(chunking=ChunkPolicy(split_sizes=split),
                              keep=args.elastor_ckpt_keep, manifest_extra=extra),
        sequence_parallel=recipe.training.sequence_parallel,
        report_memory=getattr(args, "elastor_report_memory", False),
        hardware=getattr(args, "elastor_hardware", None))


def adapt_args(args: argparse.Namespace, groups: RankGroups | None, layout: Layout) -> None:
    """Rewrite this rank's Megatron arguments to its own stage of ``layout``."""
    if groups is None:
        raise RuntimeError(
            f"rank {args.rank} is idle in --elastor-layout: Megatron-LM needs work on "
            f"every rank; start exactly the ranks the layout uses ({layout.num_gpus})")
    pipeline = layout.pipelines[groups.position.pipeline]
    stage_layers = [s.layers for s in pipeline.stages]
    tp = pipeline.stages[groups.position.stage].tp
    set_tensor_parallel_args(args, tp)
    args.sequence_parallel = requested_sequence_parallel(args) and tp > 1  # Megatron's rule
    args.pipeline_model_parallel_size = len(stage_layers)
    if args.data_parallel_size != len(groups.dp_ranks):  # the rank's exact replicas
        from megatron.core.num_microbatches_calculator import (
            reconfigure_num_microbatches_calculator)

        args.data_parallel_size = len(groups.dp_ranks)
        reconfigure_num_microbatches_calculator(
            args.rank, args.rampup_batch_size, args.global_batch_size,
            args.micro_batch_size, args.data_parallel_size,
            getattr(args, "decrease_batch_size_if_needed", False))
    if len(set(stage_layers)) > 1:
        args.pipeline_model_parallel_layout = mcore_pipeline_layout(stage_layers)
        args.decoder_first_pipeline_num_layers = None
        args.decoder_last_pipeline_num_layers = None
    args.padded_vocab_size = recipe_from_args(
        args, _tokenizer_vocab_size()).model.padded_vocab_size


def install_hooks() -> Installation:
    """The call ``patches/`` add before ``pretrain``: ``hooks.install`` with options
    from Megatron-LM's parsed arguments when first needed. Calling it again keeps the
    installation (and its ``observer``)."""
    from megatron.training import get_args

    return hooks.install(
        lambda: options_from_args(get_args(), _tokenizer_vocab_size()),
        on_parallel_state=lambda groups, layout: adapt_args(get_args(), groups, layout))
