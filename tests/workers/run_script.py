"""Run a Python script as ``python SCRIPT ARGS...`` would, in this process:

    python -m elastor_mcore.elastic.rank.keeper tests.workers.run_script SCRIPT ARGS...

``elastic.rank.keeper`` runs a module in a rank forked from the pre-imported worker;
``tests/pretrain_gpt_run.py`` runs Megatron-LM's ``pretrain_gpt.py`` through this one."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as the interpreter does
    runpy.run_path(script, run_name="__main__")
