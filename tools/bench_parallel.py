"""Loss parity and per-rank model-state memory of every data-parallel strategy, side by side.

    python tools/bench_parallel.py                                   # tiny config, 2 ranks, 20 steps
    python tools/bench_parallel.py --nproc 4 --steps 50 --markdown docs/results/parallel.md --plot parallel.png
    python tools/bench_parallel.py --strategies ddp,fsdp -- --model.n_layer=4 --precision.mode=bf16

For each strategy the tool launches ``torchrun --nproc_per_node=N`` on itself; each rank builds
the model and engine exactly as train.py does (training/build.py, the one build path), trains
``--steps`` steps, and reports:

- the loss after the last step next to a single-process run that sees the same global batch
  (micro-batch x N in one process: the loader gives rank r every N-th window, so the union of
  the ranks' micro-batches is the single process's batch);
- per-rank bytes of parameters, gradients and optimizer state, measured as the sum of the
  *local* storages each rank holds (DTensor shards for FSDP2, DeepSpeed's partitions for ZeRO),
  gradients read right after the last backward, before the optimizer step frees them;
- the ZeRO paper's formula for the same model (Rajbhandari et al. 2020, section 5, as coded in
  analysis/estimator.model_state_bytes): params/grads/optimizer of Psi x (bytes per element)
  divided by N where the stage shards them.

Measured and formula differ where the engines hold more than the paper counts; the notes under
the table say where (e.g. DeepSpeed keeps an fp32 master partition even in fp32 training, FSDP2
pads shards to a multiple of N rows, DDP/ZeRO buckets). With --markdown the rows are also
written as JSON next to the table (same stem), which tools/reproduce.py reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from analysis.estimator import model_state_bytes  # noqa: E402
from common.measure import provenance  # noqa: E402
from common.report import markdown_table, new_figure, save_figure, text_table, write_results  # noqa: E402
from model.flops import count_parameters  # noqa: E402
from parallel.distributed import init_distributed, shutdown_distributed  # noqa: E402
from parallel.engine import TorchEngine  # noqa: E402
from parallel.optim import lr_at  # noqa: E402
from parallel.zero import ZeroEngine  # noqa: E402
from training.build import build_batches, build_from_config  # noqa: E402
from training.config import load_config  # noqa: E402
from training.loop import train_step  # noqa: E402

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
DEFAULT_OVERRIDES = ["--train.eval_interval=0", "--checkpoint.interval=0", "--checkpoint.save_final=false",
                     "--logging.progress=plain", "--logging.jsonl=false", "--train.device=cpu"]


# --------------------------------------------------------------------------- measuring (inside a rank)


class StorageLedger:
    """Bytes of distinct storages per category; a storage is counted once, in its first category."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.bytes: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}

    def add(self, category: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.owner:
            return
        self.owner[key] = category
        self.bytes[category] += storage.nbytes()


def _tensors_in(obj, depth: int = 4):
    """(attribute path, tensor) for tensors reachable from a DeepSpeed object through its
    attributes, lists, tuples and dicts."""
    seen: set[int] = set()
    stack = [(obj, "", depth)]
    while stack:
        item, path, d = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            yield path, item
            continue
        if d == 0 or isinstance(item, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        if isinstance(item, dict):
            stack += [(v, f"{path}[{k!r}]", d - 1) for k, v in item.items()]
        elif isinstance(item, (list, tuple, set)):
            stack += [(v, f"{path}[{i}]", d - 1) for i, v in enumerate(item)]
        elif hasattr(item, "__dict__") and type(item).__module__.startswith("deepspeed"):
            stack += [(v, f"{path}.{k}", d - 1) for k, v in vars(item).items()]


def record_params_and_grads(engine, ledger: StorageLedger) -> None:
    """Call right after the last backward of a step."""
    for p in _model_of(engine).parameters():
        ledger.add("params", getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p)
    for p in _model_of(engine).parameters():
        ledger.add("grads", p.grad)
    ds_optimizer = _deepspeed_optimizer(engine)
    if ds_optimizer is not None:
        # fp32 master partitions (ZeRO-1/2: single_partition_of_fp32_groups; ZeRO-3:
        # fp32_partitioned_groups_flat, handed to the inner optimizer only during its step).
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            for t in getattr(ds_optimizer, name, None) or []:
                ledger.add("optimizer", t)
        _add_inner_optimizer(ds_optimizer.optimizer, ledger, with_state=False)
        # DeepSpeed's gradient partitions (attributes named *grad*: grads_in_partition,
        # averaged_gradients, grad_partitions_flat_buffer, ...) and its fixed-size reduce buckets
        # (ipg_buffer, __ipg_bucket_flat_buffer), which ZeRO-R calls constant buffers.
        found = list(_tensors_in(ds_optimizer))
        for path, t in found:
            if "grad" in path.rsplit(".", 1)[-1].lower():
                ledger.add("grads", t)
        for _, t in found:
            ledger.add("buffers", t)


def record_optimizer(engine, ledger: StorageLedger) -> None:
    """Call after the optimizer step (AdamW state exists from the first step on)."""
    ds_optimizer = _deepspeed_optimizer(engine)
    if ds_optimizer is not None:
        _add_inner_optimizer(ds_optimizer.optimizer, ledger, with_state=True)
        return
    _add_inner_optimizer(engine.optimizer, ledger, with_state=True)
    if isinstance(engine, TorchEngine) and engine.masters is not None:
        for m in engine.masters.masters:
            ledger.add("optimizer", m)


def _add_inner_optimizer(optimizer, ledger: StorageLedger, with_state: bool) -> None:
    # The optimizer's own parameters are masters when they are not the model's (DeepSpeed's
    # fp32 partitions): the paper counts them with the optimizer state.
    for group in optimizer.param_groups:
        for p in group["params"]:
            ledger.add("optimizer", p)
    for p in optimizer.state:  # keyed by the tensors it steps
        ledger.add("optimizer", p)
    if with_state:
        for state in optimizer.state.values():
            for value in state.values():
                ledger.add("optimizer", value)


def _model_of(engine):
    return engine.module()


def _deepspeed_optimizer(engine):
    return engine.engine.optimizer if isinstance(engine, ZeroEngine) else None


def run_rank(config: str | None, overrides: list[str], steps: int, out: Path) -> None:
    """One rank (or the single process): train like train.py, then write this rank's numbers."""
    cfg = load_config(config, overrides)
    p = cfg.parallel
    ctx = init_distributed(cfg.train.device, p.backend, p.timeout_s, p.nccl, p.local_world_size)
    try:
        built = build_from_config(cfg, ctx)
        n_params = sum(p.numel() for p in built.model.parameters())  # unique tensors: a tied weight once
        engine = built.engine
        _, batches = build_batches(cfg, ctx)
        engine.train(True)
        losses, ledger = [], StorageLedger()
        schedule = cfg.optim.schedule(steps)
        for step in range(steps):
            # Gradients exist between the last backward and the optimizer step that frees them.
            record = (lambda: record_params_and_grads(engine, ledger)) if step == steps - 1 else None
            outcome = train_step(engine, batches, cfg.train.grad_accum_steps, lr_at(step, **schedule),
                                 before_optimizer_step=record)
            losses.append(float(ctx.all_reduce_mean(outcome.loss.detach().clone())))
        record_optimizer(engine, ledger)
        result = {"rank": ctx.rank, "world": ctx.world_size, "losses": losses, "bytes": ledger.bytes,
                  "n_params": n_params, "n_params_config": count_parameters(cfg.model)}
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    finally:
        shutdown_distributed(ctx)


# --------------------------------------------------------------------------- launching (the parent)


@dataclass
class Row:
    strategy: str
    loss: float
    delta: float
    measured: dict[str, float]  # max over ranks, bytes
    formula: dict[str, float]
    status: str = "ok"


def launch(strategy: str, args: argparse.Namespace, extra: list[str], work: Path) -> list[dict]:
    out = work / strategy
    out.mkdir(parents=True, exist_ok=True)
    micro = args.micro_batch_size * (args.nproc if strategy == "none" else 1)
    rank_args = [str(Path(__file__).resolve()), "--worker", str(out), "--steps", str(args.steps),
                 *(["--config", args.config] if args.config else []), "--",
                 *DEFAULT_OVERRIDES, f"--parallel.strategy={strategy}", f"--train.micro_batch_size={micro}",
                 f"--logging.run_dir={work / 'runs' / strategy}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR": "cpu",
           "PYTHONUNBUFFERED": "1"}
    if strategy == "none":
        cmd = [sys.executable, *rank_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               *rank_args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{strategy}: exit {proc.returncode}: " + " | ".join(tail))
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def formula_bytes(n_params: int, strategy: str, world: int, precision: str) -> dict[str, float]:
    s = model_state_bytes(n_params, strategy, world, precision)
    return {"params": s.param, "grads": s.grad, "optimizer": s.optimizer}


def measure_all(args: argparse.Namespace, extra: list[str]) -> tuple[list[Row], dict]:
    precision = load_config(args.config, [*DEFAULT_OVERRIDES, *extra]).precision.mode
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        single = launch("none", args, extra, work)[0]
        n_params = single["n_params"]
        reference = single["losses"][-1]
        rows.append(Row("single process", reference, 0.0, single["bytes"],
                        formula_bytes(n_params, "none", 1, precision)))
        for strategy in args.strategies:
            try:
                ranks = launch(strategy, args, extra, work)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append(Row(strategy, float("nan"), float("nan"), {}, {}, status=str(exc)[:200]))
                continue
            loss = ranks[0]["losses"][-1]
            measured = {k: max(r["bytes"][k] for r in ranks) for k in ("params", "grads", "optimizer", "buffers")}
            rows.append(Row(strategy, loss, loss - reference, measured,
                            formula_bytes(n_params, strategy, args.nproc, precision)))
    return rows, {"n_params": n_params, "precision": precision}


# --------------------------------------------------------------------------- output


def _kib(x: float) -> str:
    return f"{x / 1024:,.0f}"


def table(rows: list[Row], markdown: bool) -> str:
    head = ["strategy", "loss", "Δ vs 1 proc", "params KiB", "(formula)", "grads KiB", "(formula)",
            "optim KiB", "(formula)", "states KiB", "(formula)", "+ buckets KiB"]
    body = []
    for r in rows:
        if r.status != "ok":
            body.append([r.strategy, "failed: " + r.status] + [""] * (len(head) - 2))
            continue
        m, f = r.measured, r.formula
        cells = [r.strategy, f"{r.loss:.6f}", f"{r.delta:+.1e}"]
        for key in ("params", "grads", "optimizer"):
            cells += [_kib(m[key]), _kib(f[key])]
        cells += [_kib(m["params"] + m["grads"] + m["optimizer"]), _kib(sum(f.values())), _kib(m["buffers"])]
        body.append(cells)
    return markdown_table(head, body) if markdown else text_table(head, body)


NOTES = [
    "Measured: max over ranks of the bytes of distinct local storages (DTensor shards, DeepSpeed partitions); "
    "gradients right after the last backward, optimizer state after the step.",
    "Formula: ZeRO paper section 5 (analysis/estimator.model_state_bytes): Psi x bytes/element, divided by the "
    "rank count for what a stage shards (zero1: optimizer; zero2: + gradients; zero3 and fsdp: + parameters).",
    "DeepSpeed keeps a separate fp32 master partition even in fp32 training (optimizer column: 12 instead of "
    "8 bytes/param over N). zero1 measures partitioned gradients: DeepSpeed frees the full gradients once they are "
    "reduced at the accumulation boundary, so the paper's full-size gradient term is a transient peak during "
    "backward, not what is held afterwards.",
    "'+ buckets': DeepSpeed's fixed-size reduce/all-gather buffers (ZeRO-R's constant buffers, sized by "
    "parallel.ddp_bucket_cap_mb, not by the model); DDP's buckets are the gradients themselves "
    "(gradient_as_bucket_view). Not part of the formula.",
    "FSDP2 pads every tensor to a multiple of the rank count along dim 0 (small extra on each shard). With a "
    "16-bit MixedPrecisionPolicy its sharded parameters and gradients stay fp32 and are the masters, so it "
    "holds 4 + 4 + 8 bytes/param over N where the formula counts 2 + 2 + 12: the same total, split differently.",
]


def plot(rows: list[Row], path: Path) -> None:
    ok = [r for r in rows if r.status == "ok"]
    fig, ax = new_figure(width=8, height=4)
    x = range(len(ok))
    bottom = [0.0] * len(ok)
    for key, colour in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868")):
        values = [r.measured[key] / 1024 for r in ok]
        ax.bar(x, values, bottom=bottom, color=colour, label=f"{key} (measured)")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(list(x), [sum(r.formula.values()) / 1024 for r in ok], color="black", marker="_", s=600,
               label="ZeRO formula (total)", zorder=3)
    ax.set_xticks(list(x), [r.strategy for r in ok])
    ax.set_ylabel("KiB per rank")
    ax.set_title("Model-state memory per rank")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write_markdown(rows: list[Row], setting: str, nproc: int, command: str, path: Path) -> list[Path]:
    """The table with its notes as Markdown, and the rows as JSON next to it (same stem)."""
    where = provenance(torch.device("cpu"))  # the ranks run on CPU (DEFAULT_OVERRIDES)
    title = (f"Data-parallel strategies, loss parity and model-state memory: gloo, {nproc} processes, "
             f"{where['hardware']}, torch {where['torch']}, {where['date']}")
    text = [f"# {title}", "", setting, "", table(rows, markdown=True), "", *[f"- {n}" for n in NOTES], "",
            f"Command: `{command}`", ""]
    return write_results(path, "\n".join(text), title, rows, provenance=where, setting=setting, nproc=nproc,
                         command=command, notes=NOTES)


# --------------------------------------------------------------------------- entry


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Loss after N steps and per-rank parameter/gradient/optimizer bytes for ddp, fsdp and "
        "ZeRO 1-3 on N processes, against one process and the ZeRO paper's formula. Config overrides go "
        "after '--' (e.g. -- --model.n_layer=4 --precision.mode=bf16).")
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config (default: configs/tiny.yaml)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per strategy run (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--strategies", type=lambda s: [x for x in s.split(",") if x], default=list(STRATEGIES),
                        help="comma-separated subset of " + ",".join(STRATEGIES))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here "
                        "(and its rows as JSON next to it)")
    parser.add_argument("--plot", type=Path, help="also write a PNG bar chart here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: run one rank
    if "--" in argv:
        split = argv.index("--")
        args, extra = parser.parse_args(argv[:split]), argv[split + 1:]
    else:
        args, extra = parser.parse_args(argv), []
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad:
        parser.error(f"unknown strategy {bad[0]!r}; choose from {', '.join(STRATEGIES)}")
    if args.nproc < 2:
        parser.error("--nproc must be >= 2 (the single-process reference is always run)")
    return args, extra


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    if args.worker is not None:
        run_rank(args.config, extra, args.steps, args.worker)
        return 0
    rows, info = measure_all(args, extra)
    title = (f"{args.nproc} ranks, {args.steps} steps, {info['n_params']:,} parameters (Psi), precision "
             f"{info['precision']}, micro-batch {args.micro_batch_size}/rank (single process: "
             f"{args.micro_batch_size * args.nproc})")
    print(title)
    print(table(rows, markdown=False))
    for note in NOTES:
        print("- " + note)
    if args.markdown:
        write_markdown(rows, title, args.nproc, f"python tools/bench_parallel.py {' '.join(argv)}", args.markdown)
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
