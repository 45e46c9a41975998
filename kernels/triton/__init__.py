"""Triton kernels, one op per file; importing this package does not import Triton.

Use :func:`load_op_modules` rather than importing the op files directly: Triton decides between
compiling and interpreting (TRITON_INTERPRET=1) when ``@triton.jit`` runs, i.e. when a file (and
triton.language itself) is first imported, and the loader refuses kernels built for the other
setting instead of failing obscurely at the first launch.
"""

from __future__ import annotations

from types import ModuleType

from common.errors import ConfigError

OP_MODULES = ("layer_norm", "rms_norm", "bias_gelu", "swiglu", "cross_entropy", "rope", "moe_permute")


def load_op_modules() -> dict[str, ModuleType]:
    """The op modules by name; raises if they were built for another TRITON_INTERPRET setting."""
    # These files import triton at their top: only a run that asks for the Triton kernels pays
    # for (and needs) it.
    from kernels.triton import _common as common
    from kernels.triton import bias_gelu, cross_entropy, layer_norm, moe_permute, rms_norm, rope, swiglu

    modules = {"layer_norm": layer_norm, "rms_norm": rms_norm, "bias_gelu": bias_gelu, "swiglu": swiglu,
               "cross_entropy": cross_entropy, "rope": rope, "moe_permute": moe_permute}
    assert tuple(modules) == OP_MODULES
    wanted = common.interpreter_active()
    if common.language_interpreted() != wanted:
        raise ConfigError(
            f"triton was first imported with TRITON_INTERPRET {'unset' if wanted else 'set'} and it is now "
            f"{'set' if wanted else 'unset'}: Triton reads it when triton.language is first imported (import "
            "torch._dynamo does that), so set TRITON_INTERPRET in the environment before starting Python"
        )
    if any(module.INTERPRETED != wanted for module in (common, *modules.values())):
        built = "interpreted" if common.INTERPRETED else "compiled"
        raise ConfigError(
            f"the Triton kernels were imported {built}, but TRITON_INTERPRET is now "
            f"{'set' if wanted else 'unset'}: Triton reads it when a kernel file is imported, so set "
            "TRITON_INTERPRET before the first use of the kernels in this process"
        )
    return modules
