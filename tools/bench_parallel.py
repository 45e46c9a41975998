"""Loss parity, per-rank model-state memory and bytes communicated of every data-parallel strategy
and of the tensor-, pipeline- and data-parallel layouts, side by side.

    python -m tools.bench_parallel                                   # tiny config, every row, 20 steps
    python -m tools.bench_parallel --layouts tp,pp --strategies ""   # two layout rows only
    python -m tools.bench_parallel --with-3d                         # also pp x tp x fsdp on 8 ranks
    python -m tools.bench_parallel --strategies ddp,fsdp -- --model.n_layer=4 --precision.mode=bf16
    python -m tools.bench_parallel --config configs/tiny-moe.yaml --strategies "" --layouts ep2,ep2_fsdp

A thin command line over ``analysis/parallel_bench.py`` (its docstring says what is measured and
how). Every row launches this module again under torchrun, one process per rank, in its hidden
``--worker`` mode. With --markdown the rows are also written as JSON next to the table (same
stem), which tools/reproduce.py reads.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import shlex
import sys
from pathlib import Path

from analysis.parallel_bench import (
    CP_NOTES,
    DEFAULT_LAYOUTS,
    EP_NOTES,
    LAYOUTS,
    NOTES,
    STRATEGIES,
    Plan,
    comm_table,
    cp_table,
    ep_table,
    launch_count,
    measure_all,
    plot,
    run_rank,
    table,
    write_markdown,
)
from common.progress import Progress
from training.config import load_config


def _names(choices) -> callable:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [n for n in names if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown name {bad[0]!r}; choose from {', '.join(choices)}")
        return names
    return parse


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Loss after N steps, per-rank parameter/gradient/optimizer bytes and bytes sent per step for "
        "ddp, fsdp and ZeRO 1-3 on N processes and for tp, pp, fsdp x tp, pp x fsdp (and pp x tp x fsdp, cp2, cp4, and "
        "with an MoE config ep2, ep2_fsdp) layouts, against one process and the formulas (ep: all-to-all bytes "
        "per step). Config overrides go after '--' (e.g. -- --model.n_layer=4).")
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config (default: configs/tiny.yaml)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per strategy run (default 2); the global batch "
                        "is micro-batch x nproc for every row")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank per step of the "
                        "strategy rows (default 4)")
    parser.add_argument("--strategies", type=_names(STRATEGIES), default=list(STRATEGIES),
                        help="comma-separated subset of " + ",".join(STRATEGIES) + " ('' for none)")
    parser.add_argument("--layouts", type=_names(tuple(LAYOUTS)), default=list(DEFAULT_LAYOUTS),
                        help=f"comma-separated subset of {','.join(LAYOUTS)} ('' for none; default "
                        f"{','.join(DEFAULT_LAYOUTS)})")
    parser.add_argument("--with-3d", action="store_true", help="also the 3-D pp x tp x fsdp row (8 ranks)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--markdown", type=Path, help="also write the tables as Markdown here "
                        "(and their rows as JSON next to them)")
    parser.add_argument("--plot", type=Path, help="also write a PNG bar chart here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: run one rank
    if "--" in argv:
        split = argv.index("--")
        args, extra = parser.parse_args(argv[:split]), argv[split + 1:]
    else:
        args, extra = parser.parse_args(argv), []
    if args.worker is not None:
        return args, extra
    if args.with_3d and "pp_tp_fsdp" not in args.layouts:
        args.layouts.append("pp_tp_fsdp")
    if args.nproc < 2:
        parser.error("--nproc must be >= 2 (the single-process reference is always run)")
    global_batch = args.micro_batch_size * args.nproc
    for key in args.layouts:
        layout = LAYOUTS[key]
        if global_batch % (layout.data_ranks * layout.microbatches):
            parser.error(f"layout {key} splits the global batch of {global_batch} (--micro-batch-size x --nproc) "
                         f"over {layout.data_ranks} data-parallel ranks (dp_replicate x dp_shard) x {layout.microbatches} "
                         "micro-batches: make it divisible")
    experts = [key for key in args.layouts if LAYOUTS[key].ep > 1]
    if experts and load_config(args.config, extra).model.moe.experts is None:
        parser.error(f"layout {experts[0]} needs an MoE model: {args.config} has none (e.g. --config "
                     "configs/tiny-moe.yaml)")
    if not args.strategies and not args.layouts:
        parser.error("nothing to measure: --strategies and --layouts are both empty")
    return args, extra


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    if args.worker is not None:
        run_rank(args.config, extra, args.steps, args.worker)
        return 0
    plan = Plan(worker_module="tools.bench_parallel", config=args.config, steps=args.steps, nproc=args.nproc,
                micro_batch_size=args.micro_batch_size, strategies=tuple(args.strategies),
                layouts=tuple(args.layouts), timeout=args.timeout, overrides=tuple(extra))
    with Progress(launch_count(plan), "bench_parallel", "launch") as progress:
        rows, info = measure_all(plan, progress)
    models = [f"{r.n_params:,} ({'untied embeddings' if 'untied' in r.strategy else 'as configured'})" for r in rows
              if r.status == "ok" and r.ranks == 1]
    title = (f"{args.steps} steps, precision {info['precision']}, global batch {info['global_batch']} sequences "
             f"(strategies: {args.nproc} ranks x micro-batch {args.micro_batch_size}; single process: one micro-batch "
             f"of {info['global_batch']}); parameters (Psi) {' and '.join(models) or 'n/a'}")
    print(title)
    print(table(rows, markdown=False))
    print(comm_table(rows, markdown=False))
    context = cp_table(rows, markdown=False)
    if context:
        print(context)
        for note in CP_NOTES:
            print("- " + note)
    experts = ep_table(rows, markdown=False)
    if experts:
        print(experts)
        for note in EP_NOTES:
            print("- " + note)
    for note in NOTES:
        print("- " + note)
    if args.markdown:
        write_markdown(rows, title, args.nproc, f"python -m tools.bench_parallel {shlex.join(argv)}", args.markdown)
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
