"""Parse and validate Megatron-LM arguments with Megatron-LM's own parser and checks
(``megatron.training.arguments``) plus Elastor's flags, as ``pretrain_gpt.py`` does.

    python tests/pretrain_gpt_args_check.py MEGATRON_LM_DIR CASES.json

``CASES.json`` is a list of ``{"world_size": N, "argv": [...]}``; one JSON line is
printed per case: the values Megatron validated and the recipe Elastor translates the
arguments into, as parsed and as validated, or the parser's error. Run with
``tests/megatron_lm_cpu`` on ``PYTHONPATH`` (validation asks for the GPU's
architecture when TP > 1).
"""

import contextlib
import io
import json
import os
import sys

sys.path.insert(0, sys.argv[1])

from megatron.training.arguments import parse_args, validate_args  # noqa: E402

from elastor_mcore.integrations.megatron_lm.args import extra_args_provider  # noqa: E402
from elastor_mcore.integrations.megatron_lm.translate import recipe_from_args  # noqa: E402


def translated(args) -> dict:
    """What ``recipe_from_args`` makes of ``args`` beyond the plain model flags."""
    recipe = recipe_from_args(args)
    t = recipe.training
    return {"ffn_hidden_size": recipe.model.ffn_hidden_size, "params_dtype": t.params_dtype,
            "sequence_parallel": t.sequence_parallel,
            "distributed_optimizer": t.distributed_optimizer,
            "recompute": [t.recompute_granularity, t.recompute_method,
                          t.recompute_num_layers]}


for case in json.loads(open(sys.argv[2]).read()):
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    os.environ["WORLD_SIZE"] = str(case["world_size"])
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(extra_args_provider())
            parsed = translated(args)
            validate_args(args, {})
    except SystemExit as exc:
        result = {"exit": exc.code, "error": stderr.getvalue().strip().splitlines()[-1]}
    else:
        result = {"exit": 0, "tp": args.tensor_model_parallel_size,
                  "pp": args.pipeline_model_parallel_size, "dp": args.data_parallel_size,
                  "gbs": args.global_batch_size,
                  "recipe": {"parsed": parsed, "validated": translated(args)}}
    print(json.dumps(result), flush=True)
