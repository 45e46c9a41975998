"""Fused ops side by side: eager PyTorch, torch.compile of the same reference, and the Triton kernel.

For each op and a few LLM-sized shapes: forward and backward time (CUDA events, warm-up,
medians), achieved GB/s and its share of the device's copy bandwidth measured in the same run,
allocator peak during forward+backward, and whether the kernel matches the fp32 reference.
Without a CUDA device it checks correctness only, in Triton's interpreter on small shapes, and
says so.

    python -m tools.bench_kernels                       # CPU: ~15 s, correctness only
    python -m tools.bench_kernels --quick --markdown gpu_results/kernels.md --plot gpu_results/kernels.png
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

import torch

from analysis import kernel_bench
from common.errors import ConfigError
from common.measure import resolve_device
from kernels.registry import TRITON_OPS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", default=",".join(TRITON_OPS), help="comma-separated ops (default: all): %(default)s")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="activation dtype (default: bf16 on CUDA; fp32 and bf16 both on CPU)")
    parser.add_argument("--quick", action="store_true", help="one shape per op (GPU)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before timing (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=20,
                        help="timed calls; the median is reported (default: %(default)s)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--markdown", metavar="PATH",
                        help="write the table as Markdown, with date and hardware (and its rows as JSON next to it)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of achieved bandwidth (needs a GPU run)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops.split(",")) - set(TRITON_OPS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {list(TRITON_OPS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device("auto")
    ops = set(args.ops.split(","))
    if device.type == "cuda":
        cases = kernel_bench.QUICK_GPU_CASES if args.quick else kernel_bench.GPU_CASES
        dtypes = [DTYPES[args.dtype or "bf16"]]
    else:
        print("no CUDA device: checking correctness only, in Triton's interpreter on small shapes (nothing timed)")
        cases = kernel_bench.CPU_CASES
        dtypes = [DTYPES[args.dtype]] if args.dtype else [torch.float32, torch.bfloat16]
    cases = [c for c in cases if c.op in ops]
    all_results, ok = [], True
    for dtype in dtypes:
        try:
            results = kernel_bench.run_benchmark(cases, dtype, device, args.warmup, args.reps, not args.no_compile,
                                          log=lambda line: print(f"  {line}", file=sys.stderr))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        head, body = kernel_bench.table(results)
        print("\n".join(kernel_bench.header_lines(results, args.warmup, args.reps)))
        print(kernel_bench.format_text(head, body) + "\n")
        all_results.append(results)
        ok &= all(r.check.ok for r in results.rows if r.check is not None)
        if args.plot:
            suffix = f"_{str(dtype).removeprefix('torch.')}.png"
            plot_path = args.plot if len(dtypes) == 1 else args.plot.replace(".png", suffix)
            if kernel_bench.write_plot(results, plot_path):
                print(f"wrote {plot_path}")
            else:
                print(f"--plot: nothing was timed on {device.type}, no plot written")
    if args.markdown:
        written = kernel_bench.write_markdown(all_results, args.warmup, args.reps, Path(args.markdown))
        print("wrote " + ", ".join(str(p) for p in written))
    if not ok:
        print("some kernels did not match the reference within tolerance (see the table)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
