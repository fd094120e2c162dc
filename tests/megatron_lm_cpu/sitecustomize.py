"""CPU shims for Megatron-LM's training code (tests only): put this directory first on
``PYTHONPATH`` and every Python process started there (torchrun, its workers, helper
processes) runs Megatron-LM's ``pretrain_gpt.py`` on CPU with gloo.

Megatron-LM assumes CUDA in a handful of places; ``megatron_lm_cpu_shims`` patches
each one right after the module holding it is imported (nothing is imported here, so
processes that never import Megatron-LM pay nothing). Each shim names the lines it is for.
"""

import os

if os.environ.get("ELASTOR_MEGATRON_CPU_SHIMS", "1") == "1":
    import megatron_lm_cpu_shims

    megatron_lm_cpu_shims.register()
