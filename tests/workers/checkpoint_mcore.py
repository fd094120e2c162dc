"""Worker: save a GPTModel under mcore's own TP=2 PP=2, load it under TP=1 PP=4.

No elastor layout is involved: groups come from ``parallel_state.initialize_model_parallel``.
Each rank also dumps its saved local shards (``torch.save``, test-only) so the loaded
shards are checked against an independent record rather than against our reader.
Rank 0 writes ``result.json`` into ``--out``. With ``--parallel-state-recipe`` the
world first runs ``parallel_state``'s checks (``tests/test_parallel_state.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from tests.checkpoint_checks import write_world_result

CONFIG = dict(num_layers=8, hidden_size=64, num_attention_heads=8, num_query_groups=4,
              ffn_hidden_size=192)
VOCAB = 512
SEQ = 32


def build_model(tp: int, pp: int, seed: int):
    """The tiny Llama for this rank's stage under mcore's uniform TP x PP groups."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                 pipeline_model_parallel_size=pp)
    torch.manual_seed(seed + dist.get_rank())
    config = TransformerConfig(
        **CONFIG, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32)
    return GPTModel(config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False,
                    position_embedding_type="rope")


def sharded(model) -> dict:
    return model.sharded_state_dict(metadata={"singleton_local_shards": True})


def local_records(state: dict) -> list[tuple[str, tuple, torch.Tensor]]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(state)
    return [(st.key, tuple(st.global_offset), st.data.detach().clone())
            for st in nested_values(state) if isinstance(st, ShardedTensor)]


def compare(records, saved) -> tuple[int, list[str]]:
    """Bytes checked and mismatches of this rank's loaded shards vs every saved piece."""
    from elastor_mcore.geometry import Box, local_view

    checked, bad = 0, []
    for key, offset, data in records:
        mine = Box(offset, tuple(data.shape))
        covered = 0
        for skey, soffset, sdata in saved:
            cell = mine.intersect(Box(soffset, tuple(sdata.shape))) if skey == key else None
            if cell is None:
                continue
            got = local_view(data, mine, cell)
            want = local_view(sdata, Box(soffset, tuple(sdata.shape)), cell)
            if not torch.equal(got, want):
                bad.append(f"{key} at {cell.offset}")
            covered += cell.numel
        if covered < mine.numel:
            bad.append(f"{key}: saved pieces cover {covered} of {mine.numel} elements")
        checked += data.numel() * data.element_size()
    return checked, bad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parallel-state-recipe", default=None,
                        help="first run workers/parallel_state.py's checks, into "
                             "OUT/parallel_state (one world start for both jobs)")
    args = parser.parse_args()
    out = Path(args.out)

    from elastor_mcore.compat import cpu

    cpu.apply_if_needed()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.parallel_state_recipe:
        from tests.workers import parallel_state

        parallel_state.run(out / "parallel_state", args.parallel_state_recipe)
    from elastor_mcore import checkpoint as ck

    ckpt = out / "iter_0000001"
    model = build_model(tp=2, pp=2, seed=1)
    state = sharded(model)
    result = ck.save_sharded_state_dict(state, ckpt, step=1,
                                        manifest_extra={"layout": {"tp": 2, "pp": 2}})
    records = local_records(sharded(model))
    torch.save(records, out / f"saved_{rank}.pt")
    dist.barrier()
    saved = [r for i in range(dist.get_world_size())
             for r in torch.load(out / f"saved_{i}.pt")]

    model = build_model(tp=1, pp=4, seed=2)
    for p in model.parameters():
        p.data.fill_(-7.0)
    before = ck.storage_bytes_read()
    ck.load_sharded_state_dict(sharded(model), ckpt)
    bytes_read = ck.storage_bytes_read() - before
    checked, bad = compare(local_records(sharded(model)), saved)
    report = dict(rank=rank, bytes_read=bytes_read, bytes_needed=checked, mismatches=bad,
                  params=sum(p.numel() for p in model.parameters()))
    write_world_result(out, report, result.plan,
                       [(key, offset, tuple(data.shape)) for key, offset, data in records])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
