"""Every Triton kernel compiles for a Hopper GPU (sm_90) ahead of time, on a machine without one.

The interpreter that runs tests/unit/kernels/test_triton_kernels.py on CPU executes kernels as numpy and accepts
programs the compiler rejects (mistyped loop-carried values, names bound in one constexpr branch
only, non-constexpr globals, ...). This test pushes both branches of every kernel through
Triton's whole pipeline down to a cubin with the ptxas bundled in the triton wheel. It runs in a
subprocess because this test session has Triton in interpreter mode (see test_kernels.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="needs the triton package (pip install triton)")

ROOT = Path(__file__).resolve().parents[3]

NORM_FWD = dict(stride_x="i32", stride_y="i32", n_cols="i32", eps="fp32")
NORM_BWD = dict(stride_x="i32", stride_dy="i32", stride_dx="i32", n_rows="i32", n_cols="i32", rows_per_group="i32")

# (op file, kernel, argument types, constexpr values, num_warps): the launch configurations the
# host code uses for a bf16 model at d_model 4096, plus the blocked path of rows wider than a block.
VARIANTS = [
    ("layer_norm", "_layer_norm_fwd_kernel",
     dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16", MEAN="*fp32", RSTD="*fp32", **NORM_FWD),
     dict(HAS_BIAS=True, GELU=True, EXACT_GELU=True, BLOCK_N=4096, ONE_BLOCK=True), 16),
    ("layer_norm", "_layer_norm_fwd_kernel",
     dict(X="*bf16", W="*fp32", B="*fp32", Y="*bf16", MEAN="*fp32", RSTD="*fp32", **NORM_FWD),
     dict(HAS_BIAS=False, GELU=False, EXACT_GELU=False, BLOCK_N=8192, ONE_BLOCK=False), 16),
    ("layer_norm", "_layer_norm_bwd_kernel",
     dict(X="*bf16", W="*bf16", B="*bf16", DY="*bf16", DX="*bf16", MEAN="*fp32", RSTD="*fp32",
          DW_PARTIAL="*fp32", DB_PARTIAL="*fp32", **NORM_BWD),
     dict(HAS_BIAS=True, GELU=True, EXACT_GELU=False, BLOCK_N=4096, ONE_BLOCK=True), 16),
    ("layer_norm", "_layer_norm_bwd_kernel",
     dict(X="*fp32", W="*fp32", B="*fp32", DY="*fp32", DX="*fp32", MEAN="*fp32", RSTD="*fp32",
          DW_PARTIAL="*fp32", DB_PARTIAL="*fp32", **NORM_BWD),
     dict(HAS_BIAS=True, GELU=True, EXACT_GELU=True, BLOCK_N=8192, ONE_BLOCK=False), 16),
    ("rms_norm", "_rms_norm_fwd_kernel", dict(X="*bf16", W="*bf16", Y="*bf16", RSTD="*fp32", **NORM_FWD),
     dict(BLOCK_N=4096, ONE_BLOCK=True), 16),
    ("rms_norm", "_rms_norm_fwd_kernel", dict(X="*fp16", W="*fp32", Y="*fp16", RSTD="*fp32", **NORM_FWD),
     dict(BLOCK_N=8192, ONE_BLOCK=False), 16),
    ("rms_norm", "_rms_norm_bwd_kernel",
     dict(X="*bf16", W="*bf16", DY="*bf16", DX="*bf16", RSTD="*fp32", DW_PARTIAL="*fp32", **NORM_BWD),
     dict(BLOCK_N=4096, ONE_BLOCK=True), 16),
    ("rms_norm", "_rms_norm_bwd_kernel",
     dict(X="*bf16", W="*bf16", DY="*bf16", DX="*bf16", RSTD="*fp32", DW_PARTIAL="*fp32", **NORM_BWD),
     dict(BLOCK_N=8192, ONE_BLOCK=False), 16),
    ("bias_gelu", "_bias_gelu_fwd_kernel",
     dict(X="*bf16", BIAS="*bf16", Y="*bf16", stride_x="i32", stride_y="i32", n_rows="i32", n_cols="i32"),
     dict(HAS_BIAS=True, EXACT=True, BLOCK_M=4, BLOCK_N=1024), 8),
    ("bias_gelu", "_bias_gelu_bwd_kernel",
     dict(X="*bf16", BIAS="*bf16", DY="*bf16", DX="*bf16", DBIAS_PARTIAL="*fp32",
          stride_x="i32", stride_dy="i32", stride_dx="i32", n_rows="i32", n_cols="i32", rows_per_group="i32"),
     dict(HAS_BIAS=True, EXACT=False, BLOCK_M=4, BLOCK_N=1024), 8),
    ("swiglu", "_swiglu_fwd_kernel",
     dict(GATE="*bf16", UP="*bf16", Y="*bf16", stride_gate="i32", stride_up="i32", stride_y="i32",
          n_rows="i32", n_cols="i32"),
     dict(BLOCK_M=4, BLOCK_N=1024), 8),
    ("swiglu", "_swiglu_bwd_kernel",
     dict(GATE="*bf16", UP="*bf16", DY="*bf16", DGATE="*bf16", DUP="*bf16", stride_gate="i32", stride_up="i32",
          stride_dy="i32", stride_dgrad="i32", n_rows="i32", n_cols="i32"),
     dict(BLOCK_M=4, BLOCK_N=1024), 8),
    ("cross_entropy", "_cross_entropy_fwd_kernel",
     dict(LOGITS="*bf16", TARGETS="*i64", LOSS="*fp32", LSE="*fp32", stride_row="i32", n_cols="i32",
          ignore_index="i32"),
     dict(BLOCK_V=4096), 16),
    ("cross_entropy", "_cross_entropy_bwd_kernel",
     dict(LOGITS="*bf16", TARGETS="*i64", LSE="*fp32", DLOSS="*fp32", DLOGITS="*bf16", stride_row="i32",
          stride_drow="i32", stride_dloss="i32", n_cols="i32", ignore_index="i32"),
     dict(BLOCK_V=4096), 16),
    ("rope", "_rope_kernel",
     dict(X="*bf16", Y="*bf16", COS="*fp32", SIN="*fp32", seq_len="i32", n_heads="i32", half="i32",
          stride_xb="i32", stride_xt="i32", stride_xh="i32", stride_yb="i32", stride_yt="i32", stride_yh="i32",
          stride_cos="i32", stride_sin="i32"),
     dict(INVERSE=True, BLOCK_H=32, BLOCK_HALF=64), 4),
    ("moe_permute", "_permute_fwd_kernel",
     dict(X="*bf16", SRC="*i64", OUT="*bf16", stride_x="i32", stride_out="i32", n_rows="i32", n_cols="i32"),
     dict(BLOCK_M=16, BLOCK_N=256), 4),
    ("moe_permute", "_sum_slots_kernel",
     dict(ROWS="*bf16", POS="*i64", W="*fp32", OUT="*bf16", stride_rows="i32", stride_out="i32", n_tokens="i32",
          n_cols="i32"),
     dict(K=2, HAS_W=True, BLOCK_M=16, BLOCK_N=256), 4),
    ("moe_permute", "_sum_slots_kernel",
     dict(ROWS="*bf16", POS="*i64", W="*i64", OUT="*bf16", stride_rows="i32", stride_out="i32", n_tokens="i32",
          n_cols="i32"),
     dict(K=8, HAS_W=False, BLOCK_M=16, BLOCK_N=256), 4),
    ("moe_permute", "_unpermute_bwd_kernel",
     dict(DY="*bf16", Y="*bf16", SRC="*i64", W="*fp32", DROWS="*bf16", DW="*fp32", stride_dy="i32", stride_y="i32",
          stride_drows="i32", n_rows="i32", n_cols="i32"),
     dict(BLOCK_M=16, BLOCK_N=256), 4),
]


def compile_all_for_sm90() -> None:
    """Run in a fresh interpreter with TRITON_INTERPRET unset; raises on the first kernel that fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton import load_op_modules

    modules = load_op_modules()
    target = GPUTarget("cuda", 90, 32)
    for module, name, types, constexprs, num_warps in VARIANTS:
        kernel = getattr(modules[module], name)
        signature = {arg: "constexpr" if arg in constexprs else types[arg] for arg in kernel.arg_names}
        try:
            triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=target,
                           options={"num_warps": num_warps})
        except Exception as exc:
            raise SystemExit(f"{module}.{name} {constexprs}: {type(exc).__name__}: {exc}") from exc
        print(f"compiled {module}.{name} {constexprs}", flush=True)


@pytest.mark.timeout(300)
def test_every_kernel_compiles_for_sm90(tmp_path):
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("needs the ptxas bundled with triton's NVIDIA backend (a CUDA build of the triton package)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset; 1 is the GPU default
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # an empty cache: every kernel is really compiled
    code = f"from {__name__} import compile_all_for_sm90; compile_all_for_sm90()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("compiled ") == len(VARIANTS)
