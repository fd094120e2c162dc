"""The CPU shims ``sitecustomize`` registers (see there). Each one runs right after the
module it patches is imported, through a ``sys.meta_path`` finder, so a module that
binds a patched name by value (``from megatron.training.initialize import
initialize_megatron`` in ``training.py``) already gets the patched one.

Line numbers are Megatron-LM ``core_v0.16.1`` / ``core_v0.19.0``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys
from typing import Callable, Iterator

_PATCHES: dict[str, Callable] = {}


def after_import(module_name: str):
    """Run the decorated function with the module once ``module_name`` is executed."""
    def register(fn):
        _PATCHES[module_name] = fn
        return fn
    return register


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def register() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


# ----------------------------------------------------------------- helpers


def _is_cuda(device) -> bool:
    import torch

    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cuda_to_cpu_mode():
    """A TorchFunctionMode creating ``device="cuda"`` tensors on CPU, making
    ``Tensor.cuda()`` / ``Module.cuda()`` keep tensors where they are and naming host
    tensors' types as CUDA ones."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                # clip_grads.py:167 asserts grad.type() == 'torch.cuda.FloatTensor':
                # host tensors stand for device tensors, under the device's type name.
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if args[0].is_cpu else name
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaToCpu()


class _NoStream:
    """``torch.cuda.Stream`` on CPU: nothing to order."""

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def _one_fake_cuda_device() -> Iterator[None]:
    """``torch.cuda.device_count()`` is 1 and ``set_device`` does nothing, for the
    duration of one Megatron-LM function that skips its setup without a device."""
    import torch

    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def _within(context: Callable, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)
    return wrapper


# ----------------------------------------------------------------- the shims


@after_import("megatron.training.initialize")
def _initialize(module) -> None:
    # elastor's own Megatron-Core CPU shims: torch.cuda.current_device() is "cpu" (used
    # as device= all over mcore and megatron/training), synchronize() is a no-op, and
    # the CUDA RNG tracker forks CPU generator states.
    from elastor_mcore.compat import cpu

    cpu.apply()
    # rerun_state_machine.py:957/970 (mcore 0.16; :979/992 in 0.19) and
    # checkpointing.py's get_rng_state save and restore torch.cuda's RNG state next to
    # the CPU one; without CUDA there is none: an empty state, restoring it does nothing.
    import torch

    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    original = module.initialize_megatron

    # initialize.py:60-62 `assert torch.cuda.is_available(), "Megatron requires CUDA."`
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    module.initialize_megatron = initialize_megatron
    # initialize.py:359 (0.16.1) `if device_count > 0:` guards mpu.initialize_model_parallel
    # (and :328 torch.cuda.set_device); :422 guards model_parallel_cuda_manual_seed.
    module._initialize_distributed = _within(_one_fake_cuda_device,
                                             module._initialize_distributed)
    module._set_random_seed = _within(_one_fake_cuda_device, module._set_random_seed)
    # initialize.py:463 (0.16.1; :497 at 0.19.0) `_warmup_jit_function` runs the fused
    # bias-GeLU/SwiGLU and bias-dropout-add kernels on device="cuda" tensors to compile
    # them ahead of training: on CPU that is an inductor compile on every rank (~2 CPU-s)
    # of kernels the tests' `--no-*-fusion` flags never call.
    module._warmup_jit_function = lambda *args, **kwargs: None


@after_import("megatron.training.training")
def _training(module) -> None:
    import torch

    # training.py:806/812 (startup timestamps), :1816, :2072, :2373, :3225, :3406
    # create tensors with device='cuda'; :1258 model_module.cuda(...). One mode, on for
    # the rest of the process, covers them (and the same in utils.py/checkpointing.py).
    _cuda_to_cpu_mode().__enter__()
    # training.py:1325-1344 builds DDP under a side torch.cuda.Stream().
    torch.cuda.Stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    if os.environ.get(WEIGHTS_DIR_ENV):
        module.train = _dumping_weights(module.train, os.environ[WEIGHTS_DIR_ENV])


WEIGHTS_DIR_ENV = "ELASTOR_TEST_WEIGHTS_DIR"
"""Not a CUDA shim but test instrumentation: with this set, every rank saves its model's
parameters, by name, to ``<dir>/rank<R>.pt`` when Megatron-LM's ``train`` returns (the
tests compare replicas that no checkpoint keeps apart, e.g. the norms of TP ranks)."""


def _dumping_weights(train: Callable, directory: str) -> Callable:
    @functools.wraps(train)
    def train_and_dump(forward_step_func, model, *args, **kwargs):
        result = train(forward_step_func, model, *args, **kwargs)
        import torch
        import torch.distributed as dist
        from megatron.core.utils import unwrap_model

        chunks = model if isinstance(model, list) else [model]
        weights = {name: param.detach().clone() for chunk in chunks
                   for name, param in unwrap_model(chunk).named_parameters()}
        os.makedirs(directory, exist_ok=True)
        torch.save(weights, os.path.join(directory, f"rank{dist.get_rank()}.pt"))
        return result
    return train_and_dump


@after_import("megatron.core.datasets.utils")
def _dataset_utils(module) -> None:
    # initialize.py:186-191 (0.16.1) calls compile_helpers(), which runs `make` in the
    # installed megatron/core/datasets; the wheel ships helpers_cpp prebuilt and no
    # Makefile. Compile only if the prebuilt module is missing.
    original = module.compile_helpers

    @functools.wraps(original)
    def compile_helpers():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            original()

    module.compile_helpers = compile_helpers


@after_import("megatron.legacy.fused_kernels")
def _fused_kernels(module) -> None:
    # initialize.py:224/228 (0.16.1) fused_kernels.load(args) runs CUDA_HOME/bin/nvcc -V
    # (CUDA_HOME is None on CPU); it builds no kernel the local transformer uses.
    module.load = lambda args: None


@after_import("megatron.training.utils")
def _training_utils(module) -> None:
    # arguments.py:928/958 (0.16.1; :1414/1444/1484 at 0.19.0) ask
    # get_device_arch_version(), i.e. torch.cuda.get_device_properties("cuda:0").major,
    # when TP > 1. Answer as a pre-Blackwell GPU: Megatron's stricter rules (e.g.
    # CUDA_DEVICE_MAX_CONNECTIONS=1) apply.
    module.get_device_arch_version = lambda: 9



@after_import("megatron.core.transformer.torch_norm")
def _torch_norm(module) -> None:
    # torch_norm.py:32 (mcore 0.16.1; :50 at 0.19.2) `assert not config.sequence_parallel`:
    # mcore's local spec (the only one without Transformer Engine or Apex, i.e. on every
    # CPU) has no sequence-parallel norm. Under --sequence-parallel the RMSNorm is
    # `elastor train`'s (runtime/model.py), whose weight is marked `sequence_parallel`
    # as TE's and Apex's are, so that its gradient is summed over the TP group.
    from elastor_mcore.runtime.model import SequenceParallelRMSNorm

    original = module.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if config.sequence_parallel and config.normalization == "RMSNorm":
            return SequenceParallelRMSNorm(config, hidden_size, eps)
        return original(cls, config, hidden_size, eps, *args, **kwargs)

    module.WrappedTorchNorm.__new__ = staticmethod(__new__)


@after_import("megatron.core.optimizer.distrib_optimizer")
def _distributed_optimizer(module) -> None:
    # Without Apex or Transformer Engine (never on CPU) mcore keeps Adam's step in torch's
    # per-parameter state, which two places of the distributed optimizer's load do not
    # expect. (1) state_dict (mcore 0.16.1 distrib_optimizer.py:640, 0.19.2 :838) asserts
    # there is exactly one step; before the first step, when load_checkpoint asks it for
    # the template to load into, there is none: a fresh optimizer gets step 0 while the
    # template is built (load_state_dict then sets the saved step). (2) The fully
    # reshardable load (:940 / :1136) copies every per-parameter state entry from the
    # checkpoint's tensors, which hold no step: the step load_state_dict set is kept,
    # as each parameter's own tensor (load_state_dict gives all parameters one shared
    # tensor, which torch's AdamW then increments once per parameter, every step).
    import torch

    original = module.DistributedOptimizer.state_dict

    @functools.wraps(original)
    def state_dict(self):
        inner = self.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if module.HAVE_APEX_OR_TE or any("step" in inner.state[p] for p in params):
            return original(self)
        for p in params:
            inner.state[p]["step"] = torch.tensor(0.0)
        try:
            return original(self)
        finally:
            for p in params:
                del inner.state[p]["step"]
                if not inner.state[p]:
                    del inner.state[p]

    module.DistributedOptimizer.state_dict = state_dict

    original_set = module.DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original_set)
    def set_states(self, model_param, tensors):
        if not module.HAVE_APEX_OR_TE and "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                state["step"] = state["step"].clone()
                tensors = {**tensors, "step": state["step"]}
        return original_set(self, model_param, tensors)

    module.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
