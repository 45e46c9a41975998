"""Training-step throughput of one config under several variants, measured side by side.

    python tools/bench_train.py --config configs/tiny.yaml
    python tools/bench_train.py --config configs/gpt2-124m.yaml --variants precision.mode=fp32 \
        precision.mode=bf16 "precision.mode=bf16 train.compile=true" --steps 20 --markdown out.md --plot out.png

Each variant is a space-separated list of config overrides applied on top of the base config.
Every variant builds the real model and engine (the same code train.py runs) and trains on
random tokens, so the numbers measure the step, not the data pipeline (tools/bench_data.py does
that). Ratios are against the first variant, measured in the same process. With --markdown the
rows are also written as JSON next to the table (same stem), which tools/reproduce.py reads.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.errors import USER_FACING_ERRORS  # noqa: E402
from common.hardware import peak_tflops_for  # noqa: E402
from common.measure import hardware_name, provenance, repeat, resolve_device, summarize  # noqa: E402
from common.report import markdown_table, new_figure, save_figure, write_results  # noqa: E402
from model.flops import flops_per_token  # noqa: E402
from parallel.distributed import DistContext, pick_device  # noqa: E402
from training.build import build_from_config  # noqa: E402
from training.config import load_config  # noqa: E402
from training.loop import train_step  # noqa: E402

DEFAULT_VARIANTS = [
    "precision.mode=fp32",
    "precision.mode=bf16",
    "precision.mode=fp32 model.attention=reference",
    "precision.mode=fp32 train.compile=true",
]


@dataclass
class Result:
    variant: str
    step_s: float
    tokens_per_s: float
    mfu: float | None
    peak_gib: float | None
    status: str = "ok"


def measure_variant(config: str | None, base_overrides: list[str], variant: str, steps: int, warmup: int) -> Result:
    overrides = base_overrides + [f"--{item}" for item in variant.split()]
    cfg = load_config(config, overrides)
    device = pick_device(cfg.train.device, 0)
    engine = build_from_config(cfg, DistContext.single(device)).engine
    b, t, accum = cfg.train.micro_batch_size, cfg.seq_len, cfg.train.grad_accum_steps
    x = torch.randint(0, cfg.model.vocab_size, (b, t), device=device)
    y = torch.randint(0, cfg.model.vocab_size, (b, t), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = repeat(lambda: train_step(engine, iter([(x, y)] * accum), accum, cfg.optim.lr), device, steps, warmup)
    step_s = summarize(times).median
    tokens = b * t * accum
    peak, _ = peak_tflops_for(hardware_name(device), cfg.precision.mode)
    mfu = flops_per_token(cfg.model, t) * tokens / step_s / (peak * 1e12) if peak else None
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return Result(variant, step_s, tokens / step_s, mfu, mem)


HEAD = ["variant", "step (ms)", "tokens/s", "vs first", "MFU", "peak mem (GiB)", "status"]


def format_table(results: list[Result], header: str) -> str:
    base = next((r for r in results if r.status == "ok"), None)
    body = []
    for r in results:
        if r.status != "ok":
            body.append([r.variant, "-", "-", "-", "-", "-", r.status])
            continue
        ratio = r.tokens_per_s / base.tokens_per_s if base else math.nan
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
        mem = f"{r.peak_gib:.2f}" if r.peak_gib is not None else "n/a (CPU)"
        body.append([r.variant, f"{r.step_s * 1e3:.1f}", f"{r.tokens_per_s:,.0f}", f"{ratio:.2f}x", mfu, mem, "ok"])
    return f"{header}\n\n{markdown_table(HEAD, body)}"


def plot(results: list[Result], path: Path) -> None:
    ok = [r for r in results if r.status == "ok"]
    fig, ax = new_figure(width=8, height=0.6 * len(ok) + 1.5)
    ax.barh([r.variant for r in ok], [r.tokens_per_s for r in ok])
    ax.set_xlabel("tokens/s")
    ax.invert_yaxis()
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="each: space-separated overrides")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here "
                        "(and its rows as JSON next to it)")
    parser.add_argument("--plot", type=Path, help="also write a PNG bar chart here")
    args, base_overrides = parser.parse_known_args(argv)
    results = []
    for variant in args.variants:
        try:
            results.append(measure_variant(args.config, base_overrides, variant, args.steps, args.warmup))
        except USER_FACING_ERRORS as exc:
            results.append(Result(variant, math.nan, math.nan, None, None, status=f"skipped: {exc}"))
    where = provenance(resolve_device("auto"))
    header = (f"bench_train: {args.config} {' '.join(base_overrides)} on {where['hardware']}, torch {where['torch']}, "
              f"{where['date']}; median of {args.steps} steps after {args.warmup} warm-up")
    table = format_table(results, header)
    print(table)
    if args.markdown:
        write_results(args.markdown, table + "\n", header, results, provenance=where, config=args.config,
                      overrides=base_overrides, steps=args.steps, warmup=args.warmup)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
