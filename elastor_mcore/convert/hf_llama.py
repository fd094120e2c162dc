"""Hugging Face Llama checkpoints (``config.json`` + safetensors) to the elastor zarr
format and back, one tensor at a time.

How HF's tensors become mcore's:

* ``q_proj``/``k_proj``/``v_proj`` fuse into ``linear_qkv``, whose rows mcore groups
  per query group: ``[q heads of group g; k_g; v_g]`` for g = 0..G-1.
* ``gate_proj``/``up_proj`` are ``linear_fc1.weight_w``/``weight_v`` (mcore's halves of
  the fused ``fc1``), ``down_proj`` is ``linear_fc2``.
* The norms before attention and MLP are the ``layer_norm_weight`` of ``linear_qkv`` and
  ``linear_fc1`` (mcore's fused-norm names, also used by its local layer spec).
* RoPE needs no permutation: HF's Llama rows are already in rotate-half order (its
  conversion from Meta's weights permuted them), which is what mcore's rotary
  embedding with ``rotary_interleaved=False`` applies.
* Embedding and output rows are padded with zeros to the layout-independent padded
  vocabulary on import and cut back on export; a tied ``lm_head`` is written as an
  untied copy of the embedding.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch

from elastor_mcore.checkpoint import CheckpointError, ChunkPolicy
from elastor_mcore.checkpoint import open as open_checkpoint
from elastor_mcore.convert.zarr_io import Progress, StreamingZarrWriter
from elastor_mcore.config.recipe import ModelConfig, Recipe

log = logging.getLogger(__name__)

SOURCE_KEY = "converted_from"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and (
        (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file())


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """The recipe model section a Llama ``config.json`` describes."""
    if config.get("model_type") != "llama":
        raise CheckpointError(f"config.json has model_type={config.get('model_type')!r}; "
                              f"only 'llama' checkpoints convert")
    if config.get("rope_scaling"):
        log.warning("config.json has rope_scaling=%s; the elastor model applies plain "
                    "RoPE, so long-context logits will differ", config["rope_scaling"])
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim * heads != config["hidden_size"]:
        raise CheckpointError(f"config.json: head_dim={head_dim} x num_attention_heads="
                              f"{heads} != hidden_size={config['hidden_size']}; mcore's "
                              f"Llama needs hidden_size = heads x head_dim")
    max_pos = config.get("max_position_embeddings", 4096)
    return ModelConfig(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        seq_length=max_pos, max_position_embeddings=max_pos,
        rotary_base=int(config.get("rope_theta", 10000)),
        norm_epsilon=config.get("rms_norm_eps", 1e-5),
        init_method_std=config.get("initializer_range", 0.02))


def hf_config_from_model(model: ModelConfig, dtype: str) -> dict[str, Any]:
    """A ``config.json`` for ``LlamaForCausalLM`` with ``model``'s shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups, "head_dim": model.kv_channels,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings or model.seq_length,
        "rms_norm_eps": model.norm_epsilon, "rope_theta": float(model.rotary_base),
        "initializer_range": model.init_method_std, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def _layer_names(i: int) -> dict[str, str]:
    """HF name -> elastor key of layer ``i``'s tensors that map one to one."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    return {
        hf + "input_layernorm.weight": mc + "self_attention.linear_qkv.layer_norm_weight",
        hf + "self_attn.o_proj.weight": mc + "self_attention.linear_proj.weight",
        hf + "post_attention_layernorm.weight": mc + "mlp.linear_fc1.layer_norm_weight",
        hf + "mlp.gate_proj.weight": mc + "mlp.linear_fc1.weight_w",
        hf + "mlp.up_proj.weight": mc + "mlp.linear_fc1.weight_v",
        hf + "mlp.down_proj.weight": mc + "mlp.linear_fc2.weight",
    }


def _qkv_names(i: int) -> tuple[list[str], str]:
    hf = f"model.layers.{i}.self_attn."
    return ([hf + "q_proj.weight", hf + "k_proj.weight", hf + "v_proj.weight"],
            f"decoder.layers.{i}.self_attention.linear_qkv.weight")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             groups: int) -> torch.Tensor:
    """mcore's ``linear_qkv`` rows: per query group, its q heads, then its k and v."""
    hidden = q.shape[1]
    return torch.cat([q.reshape(groups, -1, hidden), k.reshape(groups, -1, hidden),
                      v.reshape(groups, -1, hidden)], dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, ...]:
    """The inverse of ``fuse_qkv``: HF's q, k and v projections."""
    groups, d = model.num_query_groups, model.kv_channels
    per_group = model.num_attention_heads // groups * d
    grouped = qkv.reshape(groups, per_group + 2 * d, qkv.shape[1])
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, qkv.shape[1]).contiguous() for t in (q, k, v))


class _SafetensorsSource:
    """Reads named tensors from an HF directory's safetensors files on demand."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        if (path / INDEX_FILE).is_file():
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        else:
            with safe_open(os.fspath(path / SINGLE_FILE), framework="pt") as f:
                weight_map = {name: SINGLE_FILE for name in f.keys()}
        self.path, self.weight_map = path, weight_map
        self._files: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path} has no tensor {name}; is it a Llama "
                                  f"checkpoint with the shape config.json describes?")
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = self._open(os.fspath(self.path / file), framework="pt")
        return self._files[file].get_tensor(name)

    def dtype(self) -> torch.dtype:
        return self.get("model.norm.weight").dtype  # a small tensor


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    out = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    out[: tensor.shape[0]] = tensor
    return out


def hf_to_zarr(src: str | os.PathLike, dst: str | os.PathLike, *,
               recipe: Recipe | None = None, chunking: ChunkPolicy | None = None,
               progress: Progress | None = None) -> Path:
    """Convert an HF Llama directory into the elastor checkpoint step ``dst``.

    With ``recipe``, its model section is recorded (so ``elastor train`` with that
    recipe accepts the checkpoint) after checking the shapes agree.
    """
    src = Path(src)
    if not is_hf_checkpoint(src):
        raise CheckpointError(f"{src} is not a Hugging Face checkpoint directory (needs "
                              f"config.json and {SINGLE_FILE} or {INDEX_FILE})")
    hf_config = json.loads((src / "config.json").read_text())
    model = model_config_from_hf(hf_config)
    if recipe is not None:
        _check_same_shape(model, recipe.model, src)
        model = recipe.model
    source = _SafetensorsSource(src)
    dtype = source.dtype()
    dname = str(dtype).removeprefix("torch.")
    h, vocab = model.hidden_size, model.padded_vocab_size
    kv = model.num_query_groups * model.kv_channels
    shapes = {"embedding.word_embeddings.weight": (vocab, h),
              "decoder.final_layernorm.weight": (h,), "output_layer.weight": (vocab, h)}
    for i in range(model.num_layers):
        mc = f"decoder.layers.{i}."
        shapes.update({
            mc + "self_attention.linear_qkv.layer_norm_weight": (h,),
            mc + "self_attention.linear_qkv.weight": (h + 2 * kv, h),
            mc + "self_attention.linear_proj.weight": (h, h),
            mc + "mlp.linear_fc1.layer_norm_weight": (h,),
            mc + "mlp.linear_fc1.weight_w": (model.ffn_hidden_size, h),
            mc + "mlp.linear_fc1.weight_v": (model.ffn_hidden_size, h),
            mc + "mlp.linear_fc2.weight": (h, model.ffn_hidden_size)})
    extra = {"model": asdict(model),
             SOURCE_KEY: {"format": "hf_llama", "config": hf_config}}
    writer = StreamingZarrWriter(dst, {k: (s, dname) for k, s in shapes.items()},
                                 manifest_extra=extra, chunking=chunking)
    total, done = len(shapes), 0

    def put(key: str, tensor: torch.Tensor) -> None:
        nonlocal done
        if tuple(tensor.shape) != shapes[key]:
            raise CheckpointError(f"{src}: tensor for {key} has shape "
                                  f"{tuple(tensor.shape)}, config.json implies {shapes[key]}")
        writer.write(key, tensor.to(dtype))
        done += 1
        if progress:
            progress(done, total, key)

    put("embedding.word_embeddings.weight",
        _pad_rows(source.get("model.embed_tokens.weight"), vocab))
    for i in range(model.num_layers):
        for hf_name, key in _layer_names(i).items():
            put(key, source.get(hf_name))
        names, key = _qkv_names(i)
        put(key, fuse_qkv(*(source.get(n) for n in names), model.num_query_groups))
    put("decoder.final_layernorm.weight", source.get("model.norm.weight"))
    head = "lm_head.weight" if "lm_head.weight" in source else "model.embed_tokens.weight"
    put("output_layer.weight", _pad_rows(source.get(head), vocab))
    return writer.commit()


def _check_same_shape(hf: ModelConfig, run: ModelConfig, where: Path) -> None:
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "vocab_size")
    diffs = [f"{f}: config.json {getattr(hf, f)}, recipe {getattr(run, f)}"
             for f in fields if getattr(hf, f) != getattr(run, f)]
    if diffs:
        raise CheckpointError(f"{where}/config.json does not match the recipe's model: "
                              + "; ".join(diffs))


def zarr_to_hf(src: str | os.PathLike, dst: str | os.PathLike, *,
               max_shard_bytes: int = 5 * 2**30, progress: Progress | None = None) -> Path:
    """Write an elastor checkpoint as an HF Llama directory ``dst`` (config.json,
    safetensors files of at most ``max_shard_bytes``, and their index if several)."""
    reader = open_checkpoint(src)
    manifest = reader.manifest
    if manifest.model is None:
        raise CheckpointError(f"{reader.path} records no model config; it cannot be "
                              f"written as a Llama config.json")
    model = ModelConfig(**manifest.model)
    dtype = manifest.tensors["embedding.word_embeddings.weight"].dtype
    source = manifest.extra.get(SOURCE_KEY) or {}
    config = source.get("config") if source.get("format") == "hf_llama" else None
    config = config or hf_config_from_model(model, dtype)
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; choose a new directory")
    dst.mkdir(parents=True, exist_ok=True)

    names = list(_hf_order(model, manifest))
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    sizes = {name: math.prod(shape) * itemsize for name, shape, _ in names}
    shards: list[list[tuple]] = [[]]
    for item in names:
        if shards[-1] and sum(sizes[n] for n, _, _ in shards[-1]) + sizes[item[0]] \
                > max_shard_bytes:
            shards.append([])
        shards[-1].append(item)
    files = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    done, total = 0, len(names)
    for file, shard in zip(files, shards):
        with _SafetensorsWriter(dst / file, [(n, s) for n, s, _ in shard], dtype) as out:
            for name, _, read in shard:
                out.write(name, read(reader))
                done += 1
                if progress:
                    progress(done, total, name)
    if len(files) > 1:
        (dst / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {n: f for f, shard in zip(files, shards) for n, _, _ in shard}},
            indent=2))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _hf_order(model: ModelConfig, manifest) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """(HF name, shape, read(reader) -> tensor) for every HF tensor, in file order."""
    h, v = model.hidden_size, model.vocab_size
    kv = model.num_query_groups * model.kv_channels

    def plain(key):
        return manifest.tensors[key].shape, lambda reader: reader.read(key)

    def qkv_part(key, part, rows):
        return (rows, h), lambda reader: split_qkv(reader.read(key), model)[part]

    def unpadded(key):
        return (v, h), lambda reader: reader.read(key)[:v].contiguous()

    yield "model.embed_tokens.weight", *unpadded("embedding.word_embeddings.weight")
    for i in range(model.num_layers):
        (q, k, vv), key = _qkv_names(i)
        for name, part, rows in ((q, 0, h), (k, 1, kv), (vv, 2, kv)):
            yield name, *qkv_part(key, part, rows)
        for hf_name, mc_key in _layer_names(i).items():
            yield hf_name, *plain(mc_key)
    yield "model.norm.weight", *plain("decoder.final_layernorm.weight")
    yield "lm_head.weight", *unpadded("output_layer.weight")


class _SafetensorsWriter:
    """Writes a safetensors file tensor by tensor: the header (names, shapes, offsets)
    is known up front, so no tensor waits in memory for the others."""

    def __init__(self, path: Path, tensors: list[tuple[str, tuple[int, ...]]],
                 dtype: str) -> None:
        self.dtype = getattr(torch, dtype)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self.expected = []
        for name, shape in tensors:
            size = math.prod(shape) * itemsize
            header[name] = {"dtype": _ST_DTYPES[self.dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
            self.expected.append((name, tuple(shape)))
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.path, self.header = path, struct.pack("<Q", len(text)) + text
        self.position = 0

    def __enter__(self) -> "_SafetensorsWriter":
        self.tmp = self.path.with_name(f".tmp_{self.path.name}")
        self.file = open(self.tmp, "wb")
        self.file.write(self.header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, want_shape = self.expected[self.position]
        if name != want_name or tuple(tensor.shape) != want_shape:
            raise CheckpointError(f"{self.path}: expected {want_name} {want_shape}, got "
                                  f"{name} {tuple(tensor.shape)}")
        data = tensor.to(self.dtype).contiguous()
        self.file.write(data.view(torch.uint8).numpy().tobytes())
        self.position += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        self.file.close()
        if exc_type is None:
            if self.position != len(self.expected):
                raise CheckpointError(f"{self.path}: only {self.position} of "
                                      f"{len(self.expected)} tensors were written")
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)
