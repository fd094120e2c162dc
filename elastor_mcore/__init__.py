"""elastor-mcore: heterogeneous layouts, partition-agnostic checkpoints and automatic
recovery for Megatron-Core training.

Importing the package has no side effects; the CPU shims in ``compat.cpu`` are applied
explicitly by the runtime when CUDA is absent.
"""

__version__ = "0.1.0"
