"""Megatron-LM integration: hooks, checkpoint conversion and the real-model recipes.

One 4-rank world (``tests/workers/megatron_integration.py``) covers everything that
needs process groups; the rest runs in the test process.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from elastor_mcore import checkpoint as ck
from elastor_mcore.checkpoint import megatron_dir
from elastor_mcore.convert import hf_llama
from elastor_mcore.config.recipe import load_recipe
from tests.conftest import REPO, THIRD_PARTY, TINY, run_world

try:  # the "hf" extra
    import transformers
    from safetensors import torch as safetensors_torch
except ImportError:
    transformers = safetensors_torch = None
needs_hf = pytest.mark.skipif(transformers is None, reason="needs the hf extra: pip install "
                              "transformers safetensors")

HF_SEED = 5


def tiny_hf_model():
    """A random ``LlamaForCausalLM`` with the tiny recipe's shape (vocab 500)."""
    model = load_recipe(TINY).model
    config = transformers.LlamaConfig(
        hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups, vocab_size=model.vocab_size,
        max_position_embeddings=model.seq_length, rms_norm_eps=model.norm_epsilon,
        rope_theta=float(model.rotary_base), tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)
    torch.manual_seed(HF_SEED)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """An HF directory, its zarr conversion, input tokens and transformers' logits."""
    if transformers is None:
        pytest.skip("needs the hf extra: pip install transformers safetensors")
    root = tmp_path_factory.mktemp("hf")
    model = tiny_hf_model()
    model.save_pretrained(root / "hf", safe_serialization=True)
    hf_llama.hf_to_zarr(root / "hf", root / "hf_zarr", recipe=load_recipe(TINY))
    tokens = torch.randint(0, model.config.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(3))
    torch.save(tokens, root / "tokens.pt")
    with torch.no_grad():
        logits = model(tokens).logits
    return root, logits


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    """The 4-rank world; it also runs the HF model when the hf extra is installed."""
    out = tmp_path_factory.mktemp("megatron_world")
    args, reference = ["--out", str(out), "--recipe", str(TINY)], None
    if transformers is not None:
        root, reference = request.getfixturevalue("hf_checkpoint")
        args += ["--hf-zarr", str(root / "hf_zarr"), "--tokens", str(root / "tokens.pt")]
    run_world(4, "tests.workers.megatron_integration", args, timeout=400)
    return out, json.loads((out / "result.json").read_text()), reference


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_hooks_save_zarr_on_hetero_layout_and_load_under_another(world):
    _, reports, _ = world
    for report in reports:
        hooks = report["hooks"]
        assert hooks["saved_zarr"], report["rank"]
        assert hooks["mismatches"] == [], (report["rank"], hooks["mismatches"][:5])
        assert hooks["async_mismatches"] == [], (report["rank"], hooks["async_mismatches"][:5])
        assert hooks["async_iteration"] == 8
        assert hooks["iteration"] == hooks["common_iteration"] == 7
        assert hooks["args_lr"] == 0.5
        assert hooks["rng"] == {"rank": report["rank"]}
        assert hooks["content_metadata"] == {"elastor_test": True}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_mcore_torch_dist_converted_to_zarr_loads_under_hetero_layout(world):
    _, reports, _ = world
    for report in reports:
        assert report["mcore"]["zarr_mismatches"] == [], report["rank"]
        assert report["mcore"]["iteration"] == 3


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_torch_dist_zarr_torch_dist_round_trip_is_bit_exact(world):
    out, reports, _ = world
    for report in reports:  # mcore itself loaded the round trip under TP=2 PP=2
        assert report["mcore"]["round_trip_mismatches"] == [], report["rank"]
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    original = FileSystemReader(str(out / "torch_dist")).read_metadata().state_dict_metadata
    back = FileSystemReader(str(out / "back")).read_metadata().state_dict_metadata
    assert sorted(original) == sorted(back)
    for key, meta in original.items():
        pair = []
        for directory in ("torch_dist", "back"):
            if isinstance(meta, TensorStorageMetadata):
                state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
            else:  # a ShardedObject: mcore stores torch.save([data])
                state = {key: io.BytesIO()}
            load(state, storage_reader=FileSystemReader(str(out / directory)), no_dist=True)
            pair.append(state[key])
        if isinstance(meta, TensorStorageMetadata):
            assert torch.equal(*pair), key
        else:
            assert pair[0] == pair[1], key
    # common.pt up to mcore 0.18, a common_state object inside the DCP files from 0.19
    from megatron.core.dist_checkpointing import load_common_state_dict
    assert load_common_state_dict(str(out / "back")) == \
        load_common_state_dict(str(out / "torch_dist"))


@pytest.mark.slow
@pytest.mark.timeout(480)
@needs_hf
def test_cli_converts_mcore_torch_dist_to_hf_through_zarr(world, tmp_path, capsys):
    from elastor_mcore.cli import main

    out, _, _ = world
    assert main(["convert", str(out / "torch_dist"), str(tmp_path / "z"), "--to", "zarr",
                 "--recipe", str(TINY)]) == 0
    assert main(["convert", str(tmp_path / "z"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert "wrote" in capsys.readouterr().out
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.lm_head.weight.shape == (500, 64)  # padded rows dropped
    assert model.config.num_key_value_heads == 4


@pytest.mark.slow
@pytest.mark.timeout(480)
@needs_hf
def test_hf_llama_logits_match_transformers_on_hetero_layout(world):
    out, _, reference = world
    logits = torch.load(out / "logits.pt")
    vocab = reference.shape[-1]
    assert logits.shape == (*reference.shape[:-1], 512)
    assert torch.all(logits[..., vocab:] == 0)  # padded rows are zero
    assert (logits[..., :vocab] - reference).abs().max().item() <= 1e-4


@pytest.mark.timeout(120)
@needs_hf
def test_hf_zarr_hf_round_trip_is_bit_exact(hf_checkpoint, tmp_path):
    root, _ = hf_checkpoint
    hf_llama.zarr_to_hf(root / "hf_zarr", tmp_path / "hf", max_shard_bytes=300_000)
    original = safetensors_torch.load_file(root / "hf" / "model.safetensors")
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "hf" / hf_llama.INDEX_FILE).is_file()
    back = {}
    for file in files:
        back.update(safetensors_torch.load_file(file))
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == \
        json.loads((root / "hf" / "config.json").read_text())
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(reloaded.lm_head.weight, original["lm_head.weight"])


def test_qkv_fusion_groups_rows_per_query_group():
    model = load_recipe(TINY).model  # 8 heads, 4 groups, head dim 8
    d, h = model.kv_channels, model.hidden_size
    q = torch.arange(8 * d)[:, None].float().expand(-1, h)
    k = 1000 + torch.arange(4 * d)[:, None].float().expand(-1, h)
    v = 2000 + torch.arange(4 * d)[:, None].float().expand(-1, h)
    qkv = hf_llama.fuse_qkv(q, k, v, model.num_query_groups)
    group1 = qkv[(2 * d + 2 * d):(2 * (2 * d + 2 * d)), 0]
    assert group1.tolist() == [*range(2 * d, 4 * d), *range(1000 + d, 1000 + 2 * d),
                               *range(2000 + d, 2000 + 2 * d)]
    assert all(torch.equal(a, b) for a, b in zip(hf_llama.split_qkv(qkv, model), (q, k, v)))


def test_cli_convert_rejects_unknown_source(tmp_path, capsys):
    from elastor_mcore.cli import main

    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--to", "zarr"]) == 2
    assert "is not a torch_dist, Hugging Face or elastor checkpoint" in capsys.readouterr().err


@needs_hf
def test_cli_convert_hf_to_zarr_prints_progress(hf_checkpoint, tmp_path, capsys):
    from elastor_mcore.checkpoint import open as open_checkpoint
    from elastor_mcore.cli import main

    root, _ = hf_checkpoint
    assert main(["convert", str(root / "hf"), str(tmp_path / "z"), "--to", "zarr",
                 "--recipe", str(TINY)]) == 0
    assert "[59/59] output_layer.weight" in capsys.readouterr().out
    reader = open_checkpoint(tmp_path / "z")
    assert reader.manifest.model == load_recipe(TINY).to_dict()["model"]
    assert main(["convert", str(root / "hf"), str(tmp_path / "z"), "--to", "zarr"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert torch.equal(reader.read("embedding.word_embeddings.weight")[500:],
                       torch.zeros(12, 64))


# ----------------------------------------------------------------- flags and hooks


def test_hooks_route_by_marker_and_restore(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    from elastor_mcore.integrations.megatron_lm import hooks
    from elastor_mcore.integrations.megatron_lm.installation import ElastorOptions
    from elastor_mcore.integrations.megatron_lm.zarr_format import ZarrLoadStrategy

    original = dist_checkpointing.load_common_state_dict
    zarr_dir = tmp_path / "iter_0000001"
    zarr_dir.mkdir()
    torch.save({"iteration": 1}, zarr_dir / megatron_dir.COMMON_FILE)
    megatron_dir.write_config(zarr_dir)
    hooks.install(ElastorOptions(ckpt_format="zarr"))
    try:
        assert dist_checkpointing.load_common_state_dict(str(zarr_dir)) == {"iteration": 1}
        assert isinstance(serialization.get_default_load_sharded_strategy(str(zarr_dir)),
                          ZarrLoadStrategy)
        assert dist_checkpointing.check_is_distributed_checkpoint(str(zarr_dir))
    finally:
        hooks.uninstall()
    assert dist_checkpointing.load_common_state_dict is original


def test_docs_list_every_replacement_in_run_order():
    """docs/megatron-lm.md's table names what ``hooks.PATCHES`` replaces, in its order."""
    from elastor_mcore.integrations.megatron_lm.hooks import PATCHES

    doc = (REPO / "docs" / "megatron-lm.md").read_text()
    section = doc.split("## What Elastor replaces in Megatron-LM, in order", 1)[1]
    section = section.split("\n## ", 1)[0]
    listed = [row.split("|")[2].strip().strip("`") for row in section.splitlines()
              if row.startswith("| ") and "`megatron." in row.split("|")[2]]
    assert listed == [patch.target for patch in PATCHES]


def test_translation_imports_neither_megatron_nor_torch():
    """A launcher can translate Megatron-LM's arguments without Megatron or torch."""
    code = ("import json, sys\n"
            "import elastor_mcore.integrations.megatron_lm.translate\n"
            "print(json.dumps(sorted(m for m in sys.modules\n"
            "                        if m.split('.')[0] in ('torch', 'megatron'))))")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == []


def test_prune_keeps_the_newest_zarr_checkpoints(tmp_path):
    for it in (1, 2, 3, 4):
        d = tmp_path / f"iter_{it:07d}"
        d.mkdir()
        megatron_dir.write_config(d)
    other = tmp_path / "iter_0000000"  # not an elastor checkpoint: left alone
    other.mkdir()
    megatron_dir.prune(tmp_path, 2, tmp_path / "iter_0000004")
    ck.wait_for_pruning()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000000", "iter_0000003", "iter_0000004"]


# ----------------------------------------------------------------- recipes


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-13b", "llama3-8b", "llama3-70b",
                                  "llama3-405b"])
def test_recipe_builds_transformer_config(name):
    from elastor_mcore.runtime.model import transformer_config

    path = REPO / "recipes" / f"{name}.yaml"
    if not path.is_file():
        pytest.skip(f"{path} is not written yet")
    recipe = load_recipe(path)
    model = recipe.model
    tp = max(t for t in model.valid_tp_sizes if t <= 8)
    stages = [model.num_layers // 4] * 3
    stages.append(model.num_layers - sum(stages))
    config = transformer_config(recipe, tp, stages)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.num_query_groups, config.ffn_hidden_size, config.kv_channels) == (
        model.num_layers, model.hidden_size, model.num_attention_heads,
        model.num_query_groups, model.ffn_hidden_size, model.kv_channels)
    assert config.tensor_model_parallel_size == tp
    assert config.pipeline_model_parallel_size == 4
    assert config.gated_linear_unit and config.normalization == "RMSNorm"
    assert config.params_dtype == (torch.bfloat16 if recipe.training.params_dtype ==
                                   "bfloat16" else torch.float32)
    assert model.padded_vocab_size % (tp * model.make_vocab_size_divisible_by) == 0


# ----------------------------------------------------------------- patches


PATCH_FOR_RELEASE = {  # Megatron-LM archive in ../shared/third_party -> the patch for it
    "v0.16.1": "megatron-lm-core_v0.16.1-pretrain_gpt.patch",
    "v0.19.0": "megatron-lm-core_v0.19.0-pretrain_gpt.patch",
}


def _patch_lines(patch: Path) -> tuple[list[str], list[str]]:
    """The lines a patch removes and the lines it adds, in order."""
    removed, added, in_hunk = [], [], False
    for line in patch.read_text().splitlines(keepends=True):
        if line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line[:1] == "-":
            removed.append(line[1:])
        elif in_hunk and line[:1] == "+":
            added.append(line[1:])
    return removed, added


def _real_pretrain_gpt(release: str, into: Path) -> Path:
    """pretrain_gpt.py of the unmodified Megatron-LM archive of ``release``."""
    archive = THIRD_PARTY / f"megatron-lm-core_{release}.tar.gz"
    if not archive.is_file():
        pytest.skip(f"needs {archive} (an unmodified Megatron-LM {release} archive)")
    with tarfile.open(archive) as tar:
        member = tar.getmember(f"megatron-lm-core_{release}/pretrain_gpt.py")
        into.mkdir(parents=True, exist_ok=True)
        (into / "pretrain_gpt.py").write_bytes(tar.extractfile(member).read())
    return into / "pretrain_gpt.py"


def test_every_patch_is_tested_against_a_real_release():
    assert sorted(PATCH_FOR_RELEASE.values()) == sorted(
        p.name for p in (REPO / "patches").glob("*.patch"))


@pytest.mark.parametrize("release", sorted(PATCH_FOR_RELEASE))
def test_apply_script_patches_the_real_pretrain_gpt_once(release, tmp_path):
    script = REPO / "tools" / "apply_megatron_patch.sh"
    patch = REPO / "patches" / PATCH_FOR_RELEASE[release]
    assert "Applies to: NVIDIA/Megatron-LM " in patch.read_text()
    target = _real_pretrain_gpt(release, tmp_path / "megatron-lm")
    original = target.read_text()

    result = subprocess.run([str(script), str(target.parent)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    tried = sorted(p.name for p in (REPO / "patches").glob("*.patch"))
    for other in tried[:tried.index(patch.name)]:   # tried first, each by a dry run
        assert f"does not fit: {other}" in result.stdout, result.stdout
    assert f"dry run OK: {patch.name}" in result.stdout, result.stdout
    patched = target.read_text()

    # The change is exactly the patch's lines, found by diffing (not by the patch tool).
    before, after = original.splitlines(keepends=True), patched.splitlines(keepends=True)
    removed, added = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
            None, before, after, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += before[i1:i2]
            added += after[j1:j2]
    assert (removed, added) == _patch_lines(patch)
    tree = ast.parse(patched)
    imported = [(node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith("elastor_mcore") for alias in node.names]
    assert len(imported) == 2, imported
    for module, name in imported:   # the names the patched script imports exist
        assert callable(getattr(importlib.import_module(module), name)), (module, name)

    again = subprocess.run([str(script), str(target.parent)], capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert target.read_text() == patched
    target.write_text("print('not Megatron-LM')\n")
    refused = subprocess.run([str(script), str(target.parent)], capture_output=True, text=True)
    assert refused.returncode == 1 and "no patch" in refused.stderr
    assert target.read_text() == "print('not Megatron-LM')\n"


# The real megatron.training.checkpointing, imported in a fresh interpreter with the
# Megatron-LM checkout first on sys.path: check that the hooks patch the names it
# imported by value, that the patched ones route by the checkpoint's marker, and that
# uninstall puts the very same originals back.
HOOKS_IN_MEGATRON_TRAINING = r"""
import argparse, json, sys
sys.path.insert(0, sys.argv[1])
import megatron.training.checkpointing as ckpt
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from elastor_mcore.integrations.megatron_lm import hooks
from elastor_mcore.integrations.megatron_lm.installation import ElastorOptions
from elastor_mcore.integrations.megatron_lm.zarr_format import ZarrLoadStrategy
from elastor_mcore.parallel.layout import layout_from_dict

zarr_dir, torch_dist_dir = sys.argv[2], sys.argv[3]
# Megatron-LM 0.19 no longer imports get_default_load_sharded_strategy (it builds
# TorchDistLoadShardedStrategy itself; the patched dist_checkpointing.load dispatches).
names = tuple(n for n in ("get_default_load_sharded_strategy",
                          "_build_sharded_state_dict_metadata") if hasattr(ckpt, n))
originals = {name: getattr(ckpt, name) for name in names}
args = argparse.Namespace(use_distributed_optimizer=False, ckpt_format="torch_dist")
group = object()    # dp_cp_group given: the real function then needs no process group
out = {"file": ckpt.__file__, "names": names,
       "before": ckpt._build_sharded_state_dict_metadata(args, group)["singleton_local_shards"]}
layout = layout_from_dict({"pipelines": [{"micro_batches": 16, "stages": [
    {"tp": 2, "layers": 8}]}]})
hooks.install(ElastorOptions(layout=layout, ckpt_format="zarr"))
try:
    out["patched"] = [getattr(ckpt, name) is not originals[name] for name in names]
    out["during"] = ckpt._build_sharded_state_dict_metadata(args, group)["singleton_local_shards"]
    if "get_default_load_sharded_strategy" in names:
        out["zarr"] = isinstance(ckpt.get_default_load_sharded_strategy(zarr_dir),
                                 ZarrLoadStrategy)
        out["torch_dist"] = isinstance(ckpt.get_default_load_sharded_strategy(torch_dist_dir),
                                       TorchDistLoadShardedStrategy)
finally:
    hooks.uninstall()
out["restored"] = [getattr(ckpt, name) is originals[name] for name in names]
out["after"] = ckpt._build_sharded_state_dict_metadata(args, group)["singleton_local_shards"]
print(json.dumps(out))
"""


@pytest.mark.timeout(240)
def test_hooks_patch_the_names_megatron_training_imported(megatron_lm_dir, tmp_path):
    """On CPU, importing megatron.training needs ``six`` (its BERT tokenizer) and ``triton``
    (megatron/training/initialize.py imports megatron.core's batch-invariant Triton
    kernels); both come with CUDA torch, neither with the CPU wheel. Importing it does
    no CUDA call."""
    for module, why in (("six", "megatron/training/tokenizer/bert_tokenization.py imports it"),
                        ("triton", "megatron/training/initialize.py imports megatron.core."
                         "transformer.custom_layers.batch_invariant_kernels, which imports "
                         "triton (a dependency of CUDA torch, not of the CPU wheel)")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"importing the real megatron.training needs {module}: {why}")
    zarr_dir = tmp_path / "iter_0000001"
    zarr_dir.mkdir()
    megatron_dir.write_config(zarr_dir)
    torch_dist_dir = tmp_path / "torch_dist"
    torch_dist_dir.mkdir()
    (torch_dist_dir / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", HOOKS_IN_MEGATRON_TRAINING, str(megatron_lm_dir),
         str(zarr_dir), str(torch_dist_dir)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).resolve() == megatron_lm_dir / "megatron/training/checkpointing.py"
    assert "_build_sharded_state_dict_metadata" in out["names"]
    assert all(out["patched"]) and all(out["restored"])
    assert (out["before"], out["during"], out["after"]) == (False, True, False)
    assert out.get("zarr", True) and out.get("torch_dist", True)
