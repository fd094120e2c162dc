"""elastor-mcore: heterogeneous layouts, partition-agnostic checkpoints and automatic
recovery for Megatron-Core training.

Importing the package has one effect, on start-up time only: Megatron-Core, if imported
later, compiles its fused kernels on their first call rather than at its import
(``compat.deferred_compile``). The CPU shims in ``compat.cpu`` are applied explicitly
by the runtime when CUDA is absent.
"""

from elastor_mcore.compat import deferred_compile

deferred_compile.install()

__version__ = "0.1.0"
