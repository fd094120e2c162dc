"""Compile Megatron-Core's kernels on their first call, not when it is imported.

megatron.core decorates kernels with ``torch.compile`` while it is imported: its fused
kernels (bias-GELU, SwiGLU, bias-dropout, norms, ...) through ``megatron.core.jit``'s
``jit_fuser``, and in 0.19 the MoE router directly. ``torch.compile`` imports
``torch._dynamo`` and ``torch._inductor`` when it decorates: about 3 CPU-seconds per
process, half of a CPU rank's start-up, whether or not any of those kernels ever runs
(CPU training turns the fusions off). ``install`` makes ``torch.compile``, while the
``megatron.core`` package itself executes (which imports most of mcore), a decorator
that calls the real ``torch.compile`` with the same arguments on a kernel's first call:
the same compiled kernel, paid for when it is used. Outside that import nothing
changes; ``jit_fuser`` keeps the deferring decorator (mcore's ``disable_jit_fuser``,
Megatron-LM's ``--disable-jit-fuser``, still replace it), and a process that imported
megatron.core before this package is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, Iterator

PACKAGE = "megatron.core"


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator like ``compile_fn`` (``torch.compile``: ``@d``, ``d(fn, **options)``
    or ``@d(**options)``) that calls ``compile_fn(fn, **options)`` on the decorated
    function's first call and the compiled function from then on."""

    def decorator(fn: Callable[..., Any] | None = None, **options: Any):
        if fn is None:
            return functools.partial(decorator, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)

        return call

    return decorator


@contextlib.contextmanager
def deferring_torch_compile() -> Iterator[None]:
    """Inside, ``torch.compile`` is ``compile_on_first_call(torch.compile)``."""
    torch = importlib.import_module("torch")
    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        yield
    finally:
        torch.compile = real


class DeferringLoader(importlib.abc.Loader):
    """Executes ``megatron.core`` with its own loader, inside ``deferring_torch_compile``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_code, get_resource_reader, ...
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        with deferring_torch_compile():
            self.loader.exec_module(module)


class MegatronCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` where the import system would, with ``DeferringLoader``."""

    def find_spec(self, name, path, target=None):
        if name != PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Defer the compilation of mcore's kernels in this process (idempotent; imports
    nothing heavy). Without effect once ``megatron.core`` is imported."""
    if not any(isinstance(finder, MegatronCoreFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MegatronCoreFinder())
