"""Worker (4 ranks): the Megatron-LM hooks and converted checkpoints, through the mcore API.

1. Hooks: the patched ``initialize_model_parallel`` installs heterogeneous layout A;
   the patched ``dist_checkpointing.save`` writes the zarr format, in the foreground
   and with ``async_sharded_save`` through mcore's ``AsyncCallsQueue``; layout B loads
   both with the patched ``load``.
2. mcore's own TP=2 PP=2 ``dist_checkpointing.save`` (torch_dist, stacked keys); rank 0
   converts it to zarr and back to torch_dist; mcore loads the round trip under TP=2
   PP=2 and layout A loads the zarr copy.
3. A Hugging Face Llama converted to zarr (by the test) runs forward under layout A;
   the last stage writes the logits.

Every load is checked bit-exact against the seeded global tensors
(``model.initial_value``). Rank 0 writes ``result.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUT_A = {"pipelines": [{"micro_batches": 16, "stages": [
    {"tp": 1, "layers": 3}, {"tp": 2, "layers": 3}, {"tp": 1, "layers": 2}]}]}
LAYOUT_B = {"pipelines": [
    {"micro_batches": 8, "stages": [{"tp": 2, "layers": 8}]},
    {"micro_batches": 8, "stages": [{"tp": 1, "layers": 5}, {"tp": 1, "layers": 3}]}]}
SEED_HOOKS, SEED_MCORE = 11, 22


def mismatches(model, recipe, seed: int) -> list[str]:
    """Local shards that differ from the seeded global tensors."""
    from elastor_mcore.runtime.model import initial_value
    from elastor_mcore.parallel.shards import sharded_tensors

    bad = []
    for st in sharded_tensors(model):
        box = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.local_shape))
        if not torch.equal(st.data, initial_value(st.key, tuple(st.global_shape), recipe,
                                                  seed)[box]):
            bad.append(st.key)
    return bad


def poison(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-7.0)


def hooked_stage(recipe, layout_dict, options_kwargs):
    """Install the hooks for a layout, build this rank's stage through the patched
    ``initialize_model_parallel``."""
    from megatron.core import parallel_state

    from elastor_mcore.integrations.megatron_lm import hooks
    from elastor_mcore.integrations.megatron_lm.installation import ElastorOptions
    from elastor_mcore.parallel.layout import layout_from_dict
    from elastor_mcore.runtime.model import build_stage_model

    layout = layout_from_dict(layout_dict)
    layout.validate(recipe)
    installation = hooks.install(ElastorOptions(layout=layout, **options_kwargs))
    parallel_state.initialize_model_parallel()
    groups = installation.groups
    return groups, build_stage_model(recipe, groups, installation.pg_collection)


def mcore_stage(recipe):
    """The tiny Llama under mcore's own TP=2 PP=2 groups (no elastor layout)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from elastor_mcore.integrations.megatron_lm import hooks
    from elastor_mcore.integrations.megatron_lm.installation import ElastorOptions
    from elastor_mcore.runtime.model import layer_spec, transformer_config

    hooks.install(ElastorOptions())
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2,
                                 pipeline_model_parallel_size=2)
    return GPTModel(config=transformer_config(recipe, 2, [4, 4]),
                    transformer_layer_spec=layer_spec(),
                    vocab_size=recipe.model.padded_vocab_size,
                    max_sequence_length=recipe.model.seq_length,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", rotary_base=recipe.model.rotary_base)


def check_hooks(recipe, out: Path, save_settings) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from elastor_mcore.checkpoint import megatron_dir
    from elastor_mcore.runtime.model import initialize_weights
    from elastor_mcore.parallel.shards import SHARDED_METADATA

    rank = dist.get_rank()
    ckpt = out / "hooks" / "iter_0000007"
    if rank == 0:
        ckpt.mkdir(parents=True)
    dist.barrier()
    _, model = hooked_stage(recipe, LAYOUT_A, dict(ckpt_format="zarr", save=save_settings))
    initialize_weights(model, recipe, SEED_HOOKS)

    def state(iteration: int) -> dict:
        return {"model": model.sharded_state_dict(metadata=dict(SHARDED_METADATA)),
                "iteration": iteration,
                "args": argparse.Namespace(lr=0.5, dtype=torch.bfloat16),
                "rng_state": ShardedObject("rng_state", {"rank": rank}, (4,), (rank,),
                                           replica_id=0)}

    dist_checkpointing.save(state(7), str(ckpt), None, async_sharded_save=False,
                            content_metadata={"elastor_test": True})
    saved_ok = megatron_dir.is_zarr_checkpoint(ckpt) and (ckpt / "manifest.json").is_file()
    # --async-save: Megatron-LM's queue runs the request; training changes the weights
    # while the save is in flight, and the checkpoint must hold the values at the call.
    async_ckpt = out / "hooks" / "iter_0000008"
    request = dist_checkpointing.save(state(8), str(async_ckpt), None, async_sharded_save=True)
    poison(model)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)

    _, model = hooked_stage(recipe, LAYOUT_B, dict(ckpt_format="zarr", save=save_settings))
    poison(model)
    dist_checkpointing.load({"model": model.sharded_state_dict(metadata=dict(SHARDED_METADATA))},
                            str(async_ckpt))
    async_bad = mismatches(model, recipe, SEED_HOOKS)
    poison(model)
    loaded = dist_checkpointing.load(
        {"model": model.sharded_state_dict(metadata=dict(SHARDED_METADATA)),
         "rng_state": ShardedObject("rng_state", None, (4,), (rank,), replica_id=0)},
        str(ckpt))
    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    return {
        "saved_zarr": saved_ok,
        "async_mismatches": async_bad,
        "async_iteration": dist_checkpointing.load_common_state_dict(
            str(async_ckpt))["iteration"],
        "mismatches": mismatches(model, recipe, SEED_HOOKS),
        "iteration": loaded.get("iteration"), "common_iteration": common.get("iteration"),
        "args_lr": loaded["args"].lr, "rng": loaded["rng_state"],
        "content_metadata": dist_checkpointing.load_content_metadata(
            preloaded_state_dict=common),
    }


def check_mcore_conversion(recipe, out: Path, chunking) -> dict:
    from megatron.core import dist_checkpointing

    from elastor_mcore.convert.torch_dist import torch_dist_to_zarr, zarr_to_torch_dist
    from elastor_mcore.runtime.model import initialize_weights
    from elastor_mcore.parallel.shards import SHARDED_METADATA

    rank = dist.get_rank()
    torch_dir, zarr_dir, back_dir = out / "torch_dist", out / "from_torch_dist", out / "back"
    if rank == 0:
        torch_dir.mkdir()
    dist.barrier()
    model = mcore_stage(recipe)
    initialize_weights(model, recipe, SEED_MCORE)
    # As Megatron-LM saves: default (stacked) layer keys, mcore's torch_dist strategy.
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 3},
                            str(torch_dir))
    dist.barrier()
    if rank == 0:
        torch_dist_to_zarr(torch_dir, zarr_dir, chunking=chunking)
        zarr_to_torch_dist(zarr_dir, back_dir)
    dist.barrier()
    poison(model)
    dist_checkpointing.load({"model": model.sharded_state_dict()}, str(back_dir))
    round_trip_bad = mismatches(model, recipe, SEED_MCORE)

    _, model = hooked_stage(recipe, LAYOUT_A, {})
    poison(model)
    loaded = dist_checkpointing.load(
        {"model": model.sharded_state_dict(metadata=dict(SHARDED_METADATA))}, str(zarr_dir))
    return {"round_trip_mismatches": round_trip_bad,
            "zarr_mismatches": mismatches(model, recipe, SEED_MCORE),
            "iteration": loaded.get("iteration")}


@torch.no_grad()
def hf_logits(recipe, hf_zarr: Path, tokens: torch.Tensor, out: Path) -> None:
    """Forward ``tokens`` through layout A's stages with the converted HF weights."""
    from elastor_mcore.checkpoint import load_sharded_state_dict
    from elastor_mcore.runtime.p2p import StageCommunicator, stage_links
    from elastor_mcore.parallel.shards import SHARDED_METADATA

    groups, model = hooked_stage(recipe, LAYOUT_A, {})
    poison(model)
    load_sharded_state_dict(model.sharded_state_dict(metadata=dict(SHARDED_METADATA)),
                            hf_zarr)
    model.eval()
    batch, seq = tokens.shape
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(seq)[None].expand(batch, seq)
    comm = StageCommunicator(stage_links(groups.layout, groups.rank),
                             (seq, batch, recipe.model.hidden_size), torch.float32,
                             torch.device("cpu"))
    if not groups.is_first_stage:
        model.set_input_tensor(comm.recv_forward())
    output = model(tokens if groups.is_first_stage else None, positions, attention_mask=mask)
    if not groups.is_last_stage:
        comm.send_forward(output)
        return
    parts = [torch.empty_like(output) for _ in groups.tp_ranks]
    dist.all_gather(parts, output.contiguous(), group=groups.tp)
    if groups.position.tp_rank == 0:
        torch.save(torch.cat(parts, dim=-1), out / "logits.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--hf-zarr", default=None, help="omit to skip the HF forward")
    parser.add_argument("--tokens", default=None)
    args = parser.parse_args()
    out = Path(args.out)

    from elastor_mcore.compat import cpu

    cpu.apply_if_needed()
    dist.init_process_group("gloo")
    from elastor_mcore.checkpoint import ChunkPolicy
    from elastor_mcore.checkpoint.megatron_dir import ZarrSaveSettings
    from elastor_mcore.config.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    chunking = ChunkPolicy(split_sizes=tuple(recipe.model.valid_tp_sizes))
    report = {"rank": dist.get_rank(),
              "hooks": check_hooks(recipe, out, ZarrSaveSettings(chunking=chunking)),
              "mcore": check_mcore_conversion(recipe, out, chunking)}
    if args.hf_zarr:
        hf_logits(recipe, Path(args.hf_zarr), torch.load(args.tokens), out)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(reports, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
