"""mcore's fused kernels compile on their first call (``compat.deferred_compile``):
importing megatron.core after elastor_mcore no longer imports torch's compiler stack."""

import subprocess
import sys

from elastor_mcore.compat.deferred_compile import compile_on_first_call
from tests.conftest import REPO


def test_importing_mcore_after_elastor_imports_no_compiler():
    code = ("import warnings; warnings.filterwarnings('ignore')\n"
            "import sys, torch, elastor_mcore\n"
            "from megatron.core.models.gpt import GPTModel\n"
            "from megatron.core import jit\n"
            "from megatron.core.fusions import fused_bias_swiglu\n"
            "print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules,\n"
            "      jit.jit_fuser is torch.compile, fused_bias_swiglu.swiglu.__wrapped__.__name__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False", "swiglu"]


def test_the_kernel_is_compiled_once_on_its_first_call_with_its_options():
    calls = []

    def compile_fn(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    jit = compile_on_first_call(compile_fn)

    @jit
    def plain(x):
        return x + 1

    def with_options(x, y=0):
        return x * y

    optioned = jit(with_options, dynamic=False)
    factory = jit(mode="max-autotune")(plain.__wrapped__)
    assert calls == [] and plain.__name__ == "plain"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert optioned(3, y=4) == ("compiled", 12)
    assert factory(0) == ("compiled", 1)
    assert calls == [("plain", {}), ("with_options", {"dynamic": False}),
                     ("plain", {"mode": "max-autotune"})]
