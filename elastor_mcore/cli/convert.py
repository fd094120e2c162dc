"""``elastor convert SRC DST --to FORMAT``: move a checkpoint between the elastor zarr
format, Megatron-Core torch_dist and Hugging Face Llama, one tensor at a time."""

from __future__ import annotations

import argparse
import sys
from elastor_mcore.checkpoint import CheckpointError, ChunkPolicy
from elastor_mcore.checkpoint.storage import Location, as_path, storage_for
from elastor_mcore.config.recipe import RecipeError, load_recipe

FORMATS = ("zarr", "torch_dist", "hf")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert checkpoints: zarr <-> torch_dist, zarr <-> hf",
        description="Convert a checkpoint, holding one tensor at a time in memory. The "
                    "source format is detected: a torch_dist directory (metadata.json), "
                    "a Hugging Face Llama directory (config.json + safetensors) or an "
                    "elastor checkpoint (a step directory or a root). An elastor "
                    "checkpoint may also be an s3://BUCKET/PREFIX URL, as SRC (--to hf, "
                    "--to torch_dist) or DST (--to zarr); endpoint, region and "
                    "credentials come from the AWS environment.")
    parser.add_argument("src", help="source checkpoint directory (zarr: or s3:// URL)")
    parser.add_argument("dst", help="new directory to write (--to zarr: or s3:// URL)")
    parser.add_argument("--to", required=True, choices=FORMATS, help="target format")
    parser.add_argument("--recipe", default=None,
                        help="-> zarr: record this recipe's model in the manifest, so "
                             "`elastor train --recipe` accepts the checkpoint and --to hf "
                             "can write config.json (from hf, shapes must match "
                             "config.json)")
    parser.add_argument("--split-sizes", type=int, nargs="+", default=None, metavar="TP",
                        help="-> zarr: TP degrees the checkpoint will be loaded with "
                             "(default 1 2 4 8)")
    parser.add_argument("--per-layer-keys", action="store_true",
                        help="zarr -> torch_dist: per-layer keys (mcore's "
                             "singleton_local_shards) instead of Megatron-LM's stacked ones")
    parser.set_defaults(func=run)


def source_format(path: Location) -> str:
    from elastor_mcore.checkpoint.megatron_dir import is_zarr_checkpoint
    from elastor_mcore.convert import hf_llama, torch_dist

    if not storage_for(path).local_files:
        if (path / "manifest.json").is_file() or (path / "latest").is_file():
            return "zarr"
        raise CheckpointError(f"{path} is not an elastor checkpoint (no manifest.json or "
                              f"latest); on object storage only elastor checkpoints are "
                              f"converted: copy other formats to a local directory first")
    if torch_dist.is_torch_dist(path):
        return "torch_dist"
    if hf_llama.is_hf_checkpoint(path):
        return "hf"
    if is_zarr_checkpoint(path) or (path / "manifest.json").is_file() or \
            (path / "latest").is_file():
        return "zarr"
    raise CheckpointError(f"{path} is not a torch_dist, Hugging Face or elastor "
                          f"checkpoint directory")


def run(args: argparse.Namespace) -> int:
    from elastor_mcore.convert import hf_llama, torch_dist  # torch: only to convert

    src, dst = as_path(args.src), as_path(args.dst)

    def progress(done: int, total: int, name: str) -> None:
        print(f"\r[{done}/{total}] {name[:70]:<70}", end="" if done < total else "\n",
              flush=True)

    try:
        kind = source_format(src)
        if not storage_for(dst).local_files and args.to != "zarr":
            raise CheckpointError(
                f"{dst}: --to {args.to} writes a local directory; only elastor zarr "
                f"checkpoints are written to object storage (convert into a local "
                f"directory, then copy it)")
        chunking = ChunkPolicy(split_sizes=tuple(args.split_sizes)) if args.split_sizes \
            else None
        recipe = load_recipe(args.recipe) if args.recipe else None
        print(f"converting {kind} {src} -> {args.to} {dst}")
        if (kind, args.to) == ("torch_dist", "zarr"):
            extra = {"model": recipe.to_dict()["model"]} if recipe else None
            torch_dist.torch_dist_to_zarr(src, dst, manifest_extra=extra, chunking=chunking,
                                          progress=progress)
        elif (kind, args.to) == ("hf", "zarr"):
            hf_llama.hf_to_zarr(src, dst, recipe=recipe, chunking=chunking,
                                progress=progress)
        elif (kind, args.to) == ("zarr", "torch_dist"):
            torch_dist.zarr_to_torch_dist(src, dst, stacked=False if args.per_layer_keys
                                          else None, progress=progress)
        elif (kind, args.to) == ("zarr", "hf"):
            hf_llama.zarr_to_hf(src, dst, progress=progress)
        else:
            print(f"elastor convert: {kind} -> {args.to} is not supported; convert through "
                  f"zarr (e.g. --to zarr, then from the zarr copy)", file=sys.stderr)
            return 2
    except (CheckpointError, RecipeError, OSError) as exc:
        print(f"elastor convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {dst}")
    return 0
