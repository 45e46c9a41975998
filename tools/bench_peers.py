"""perfgpt's training step against Hugging Face transformers' implementation of the same model.

    python -m tools.bench_peers                                   # tiny config, eager and compiled, 1 thread
    python -m tools.bench_peers --markdown docs/results/bench_peers_cpu.md --plot docs/results/bench_peers_cpu.png
    python -m tools.bench_peers --modes eager --rounds 15 --model.n_layer=8     # any config override

perfgpt's side is what train.py runs: the engine from the one build path (training/build.py) and
training/loop.train_step, so it pays everything a run pays per step (the schedule's learning rate,
gradient clipping, the finite check, zeroing). The peer is transformers' model for the same
architecture (GPT2LMHeadModel, or LlamaForCausalLM for a Llama-shaped config), built from the
equivalent config (model/interop.to_hf_config; random init, never downloaded) with SDPA attention
and no KV cache, and loaded with perfgpt's initial weights, so both sides start from the same
model: the first step's losses agree. Its step is the minimal training step: forward, the same
cross-entropy on the logits, backward, the same gradient clipping, and an AdamW built by the
function the engine uses (parallel/optim.build_adamw) from the same ``optim`` section on the same
parameter groups (decay on matrices only), so lr, betas, eps, weight decay and fused/foreach
are the same. Both sides train on the same random token batches, in the same order.

GELU: perfgpt's tanh GELU is ``F.gelu(approximate="tanh")``. transformers names that
``gelu_pytorch_tanh``; its ``gelu_new`` is the same function written out in Python-level tensor
ops, several times slower on CPU. The peer takes ``gelu_pytorch_tanh`` by default, so a speed-up
is not the peer's slow GELU; ``--peer-gelu gelu_new`` measures against GPT-2's original form.

Sides run in interleaved rounds in one process (perfgpt eager, peer eager, perfgpt compiled, peer
compiled, then again), so a busy spell of a shared machine slows every side alike. Ratios are
taken round by round and summarized as median (min-max); one whose interval contains 1.0 is
reported as "no difference measured" (common/measure.py). ``--threads`` fixes torch's CPU threads
(default 1: on a shared machine, more threads measure the neighbours). With --markdown the rows
are also written as JSON next to the table (same stem).
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import USER_FACING_ERRORS, CapabilityError, ConfigError
from common.measure import RatioSummary, interleaved, machine_load, provenance, speedup, summarize
from common.report import markdown_table, new_figure, save_figure, text_table, write_results
from model.interop import GPT2, hf_layout, to_hf_config, to_hf_state_dict
from parallel.distributed import DistContext, pick_device
from parallel.optim import build_adamw, decay_groups
from parallel.precision import PrecisionPolicy
from training.build import build_from_config
from training.config import JobConfig, load_config
from training.loop import train_step

MODES = ("eager", "compiled")
OURS, PEER = "perfgpt", "transformers"
PEER_GELUS = ("gelu_pytorch_tanh", "gelu_new")
# Modes whose peer step is the same computation: fp32, or the same autocast around the forward.
# The others keep bf16 weights with fp32 masters or need Transformer Engine, which a plain
# transformers model has no equivalent of.
PEER_PRECISIONS = ("fp32", "bf16")
POOL = 8  # distinct random batches, cycled; every side steps through them in the same order

Batch = list[tuple[torch.Tensor, torch.Tensor]]  # one step: grad_accum_steps micro-batches


@dataclass
class Side:
    """One model and its optimizer, stepping through the shared batch pool."""

    name: str  # OURS or PEER
    mode: str  # eager or compiled
    step_fn: Callable[[Batch], torch.Tensor]  # one optimizer step; returns the mean loss (on device)
    optimizer: torch.optim.Optimizer
    pool: list[Batch]
    seen: list[int] = field(default_factory=list)  # pool index of every batch stepped on, in order
    first_loss: float | None = None

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode}"

    def step(self) -> None:
        index = len(self.seen) % len(self.pool)
        self.seen.append(index)
        loss = self.step_fn(self.pool[index])
        if self.first_loss is None:  # one host read, in warm-up: the two models' first losses agree
            self.first_loss = float(loss)


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's hyperparameters and element count: what must match between sides."""
    return [{**{k: v for k, v in group.items() if k != "params"}, "numel": sum(p.numel() for p in group["params"])}
            for group in optimizer.param_groups]


# --------------------------------------------------------------------------- the two sides


def job_config(config: str, overrides: list[str], compiled: bool) -> JobConfig:
    cfg = load_config(config, overrides + [f"--train.compile={'true' if compiled else 'false'}"])
    if cfg.precision.mode not in PEER_PRECISIONS:
        raise ConfigError(f"precision.mode={cfg.precision.mode} has no transformers equivalent here; "
                          f"use {' or '.join(f'--precision.mode={m}' for m in PEER_PRECISIONS)}")
    if cfg.parallel.strategy != "none" or cfg.parallel.tp * cfg.parallel.pp > 1:
        raise ConfigError("bench_peers measures one process: use --parallel.strategy=none (and tp, pp 1)")
    return cfg


def ours(cfg: JobConfig, device: torch.device, pool: list[Batch], mode: str) -> tuple[Side, nn.Module, PrecisionPolicy]:
    """perfgpt as train.py builds and steps it."""
    built = build_from_config(cfg, DistContext.single(device))
    engine, accum, lr = built.engine, cfg.train.grad_accum_steps, cfg.optim.lr
    step = lambda batch: train_step(engine, iter(batch), accum, lr).loss  # noqa: E731
    [part] = engine.optimized_parts()  # one process: one module, one optimizer
    return Side(OURS, mode, step, part.optimizer, pool), built.model, built.policy


def peer_model(cfg: JobConfig, initial: dict[str, torch.Tensor], device: torch.device, gelu: str) -> nn.Module:
    """transformers' model of the same architecture, holding perfgpt's initial weights."""
    try:
        import transformers
    except ImportError:
        raise CapabilityError("bench_peers needs transformers (in the dev extra): pip install -e '.[dev]'") from None
    extra = {"use_cache": False}  # training keeps no KV cache
    if hf_layout(cfg.model) == GPT2:
        extra["activation_function"] = gelu
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(cfg.model, extra))
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(to_hf_state_dict(cfg.model, initial), strict=False)
    tied = {"lm_head.weight"} if cfg.model.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"perfgpt's weights do not fill transformers' model: missing {missing}, extra {unexpected}")
    model.tie_weights()
    return model.to(device).train()


def peer(cfg: JobConfig, model: nn.Module, policy: PrecisionPolicy, device: torch.device, pool: list[Batch],
         mode: str) -> Side:
    """The minimal training step on the peer: forward, loss, backward, clip, AdamW, zero."""
    optimizer = build_adamw(decay_groups(list(model.named_parameters()), cfg.optim.weight_decay), cfg.optim, device)
    forward = torch.compile(model, mode=cfg.train.compile_mode) if mode == "compiled" else model
    params = [p for p in model.parameters() if p.requires_grad]
    accum, lr, clip = cfg.train.grad_accum_steps, cfg.optim.lr, cfg.optim.grad_clip

    def step(batch: Batch) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for x, y in batch:
            with policy.forward_context(device):
                logits = forward(input_ids=x).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            (loss / accum).backward()
            total += loss.detach() / accum
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return Side(PEER, mode, step, optimizer, pool)


def batch_pool(cfg: JobConfig, device: torch.device, seed: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch_size, cfg.seq_len)

    def micro() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (torch.randint(0, cfg.model.vocab_size, shape, generator=generator) for _ in range(2))
        return x.to(device), y.to(device)

    return [[micro() for _ in range(cfg.train.grad_accum_steps)] for _ in range(POOL)]


def build_sides(config: str, overrides: list[str], modes: list[str], gelu: str, seed: int) -> tuple[JobConfig, list[Side]]:
    """For each mode: perfgpt, then the peer from perfgpt's initial weights (built before any step)."""
    base = job_config(config, overrides, compiled=False)
    device = pick_device(base.train.device, 0)
    pool = batch_pool(base, device, seed)
    sides = []
    for mode in modes:
        cfg = job_config(config, overrides, compiled=mode == "compiled")
        side, model, policy = ours(cfg, device, pool, mode)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        sides += [side, peer(cfg, peer_model(cfg, initial, device, gelu), policy, device, pool, mode)]
    return base, sides


# --------------------------------------------------------------------------- measuring


@dataclass
class Row:
    side: str
    mode: str
    step_s: float  # median over rounds
    step_s_min: float
    step_s_max: float
    tokens_per_s: float  # tokens of one step / the median step
    tokens_per_s_min: float
    tokens_per_s_max: float
    first_loss: float | None
    rounds_s: list[float]  # seconds per step, one per round


@dataclass
class Ratio:
    name: str
    median: float
    min: float
    max: float
    n: int
    measured_difference: bool
    text: str  # the cell: "1.25x (1.20-1.31)", or with "no difference measured"


def measure(sides: list[Side], rounds: int, steps: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of every side, one sample per round, the sides interleaved within each round."""
    for side in sides:  # compilation happens here, not in a timed round
        for _ in range(warmup):
            side.step()

    def run(side: Side) -> Callable[[], None]:
        return lambda: [side.step() for _ in range(steps)]

    samples = interleaved({side.label: run(side) for side in sides}, rounds, warmup=0, device=device,
                          progress="bench_peers: timed rounds")
    return {label: [s / steps for s in seconds] for label, seconds in samples.items()}


def rows_of(sides: list[Side], seconds: dict[str, list[float]], tokens: int) -> list[Row]:
    rows = []
    for side in sides:
        s = summarize(seconds[side.label])
        rows.append(Row(side.name, side.mode, s.median, s.min, s.max, tokens / s.median, tokens / s.max,
                        tokens / s.min, side.first_loss, seconds[side.label]))
    return rows


def ratio(name: str, summary: RatioSummary) -> Ratio:
    return Ratio(name, summary.median, summary.min, summary.max, summary.n, summary.measured_difference, summary.text())


def ratios_of(seconds: dict[str, list[float]], modes: list[str]) -> list[Ratio]:
    """perfgpt against the peer in each mode, and each side's compiled step against its eager one
    (above 1: the first named is faster), every ratio taken round by round."""
    out = [ratio(f"{OURS} / {PEER}, {mode}", speedup(seconds[f"{OURS} {mode}"], seconds[f"{PEER} {mode}"]))
           for mode in modes]
    if set(MODES) <= set(modes):
        out += [ratio(f"{name} compiled / eager", speedup(seconds[f"{name} compiled"], seconds[f"{name} eager"]))
                for name in (OURS, PEER)]
    return out


def profile_sides(sides: list[Side], steps: int) -> dict[str, dict[str, float]]:
    """Self CPU milliseconds per step of each op, per side, from torch.profiler over ``steps`` steps.

    Inductor's generated kernels are not separate profiler events; their time is the self time of
    the graph call that runs them, which is named after a hash: those are summed under one name.
    """
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for side in sides:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                side.step()
        ops: dict[str, float] = {}
        for event in prof.key_averages():
            name = INDUCTOR_KERNELS if event.key.startswith("## Call CompiledFxGraph") else event.key
            ops[name] = ops.get(name, 0.0) + event.self_cpu_time_total / steps / 1e3
        out[side.label] = ops
    return out


INDUCTOR_KERNELS = "inductor kernels (compiled graph calls)"
PROFILE_TOP = 14


def profile_cells(profiles: dict[str, dict[str, float]]) -> tuple[list[str], list[list[str]]]:
    """The ops that cost most on any side, their ms per step on every side, then everything else and the total."""
    labels = list(profiles)
    names = sorted({n for ops in profiles.values() for n in ops}, key=lambda n: -max(o.get(n, 0.0) for o in profiles.values()))
    top = names[:PROFILE_TOP]
    rows = [[name] + [f"{profiles[label].get(name, 0.0):.1f}" for label in labels] for name in top]
    rows.append(["all other ops"] + [f"{sum(v for n, v in profiles[label].items() if n not in top):.1f}"
                                     for label in labels])
    rows.append(["total"] + [f"{sum(profiles[label].values()):.1f}" for label in labels])
    return ["op (self CPU ms per step)"] + labels, rows


# --------------------------------------------------------------------------- reporting

ROW_HEAD = ["side", "mode", "step (ms) median (min-max)", "tokens/s median (min-max)", "first-step loss"]
RATIO_HEAD = ["tokens/s ratio, per round", "median (min-max)"]


def row_cells(rows: list[Row]) -> list[list[str]]:
    return [[r.side, r.mode, f"{r.step_s * 1e3:.1f} ({r.step_s_min * 1e3:.1f}-{r.step_s_max * 1e3:.1f})",
             f"{r.tokens_per_s:,.0f} ({r.tokens_per_s_min:,.0f}-{r.tokens_per_s_max:,.0f})",
             f"{r.first_loss:.6f}" if r.first_loss is not None else "-"] for r in rows]


def ratio_cells(ratios: list[Ratio]) -> list[list[str]]:
    return [[r.name, r.text] for r in ratios]


def setup_lines(cfg: JobConfig, optimizer: torch.optim.Optimizer, gelu: str, args: argparse.Namespace) -> list[str]:
    m, t = cfg.model, cfg.train
    group = optimizer.param_groups[0]
    return [
        f"model: {m.n_layer} layers x {m.d_model}, {m.n_head} heads, vocab {m.vocab_size}, seq {cfg.seq_len}, "
        f"micro-batch {t.micro_batch_size} x {t.grad_accum_steps}, {cfg.precision.mode}, dropout {m.dropout}, "
        f"tied embeddings {m.tie_embeddings}",
        f"peer: transformers {_transformers_version()} {_peer_class(cfg)} from the same config and initial weights, "
        f"sdpa attention" + (f", activation {gelu}" if hf_layout(m) == GPT2 else ""),
        f"both: AdamW lr {group['lr']:g}, betas {tuple(group['betas'])}, eps {group['eps']:g}, weight decay "
        f"{cfg.optim.weight_decay:g} on matrices, fused {bool(group.get('fused'))}, foreach {group.get('foreach')}; "
        f"grad clip {cfg.optim.grad_clip:g}; the same {POOL} random batches in the same order",
        f"timing: {args.rounds} interleaved rounds of {args.steps} steps after {args.warmup} warm-up steps, "
        f"{torch.get_num_threads()} thread(s); ratios per round, median (min-max); {machine_load()} "
        "when the rounds ended",
    ]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _peer_class(cfg: JobConfig) -> str:
    return "GPT2LMHeadModel" if hf_layout(cfg.model) == GPT2 else "LlamaForCausalLM"


def plot(rows: list[Row], path: Path) -> None:
    modes = list(dict.fromkeys(r.mode for r in rows))
    fig, ax = new_figure(width=7, height=4)
    width = 0.38
    for i, name in enumerate((OURS, PEER)):
        mine = [next(r for r in rows if r.side == name and r.mode == mode) for mode in modes]
        xs = [m + (i - 0.5) * width for m in range(len(modes))]
        errors = [[r.tokens_per_s - r.tokens_per_s_min for r in mine], [r.tokens_per_s_max - r.tokens_per_s for r in mine]]
        ax.bar(xs, [r.tokens_per_s for r in mine], width, yerr=errors, capsize=4, label=name)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("tokens/s (median, min-max over rounds)")
    ax.set_title("one training step: perfgpt vs transformers")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (one sample per side each)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (compilation)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--peer-gelu", choices=PEER_GELUS, default=PEER_GELUS[0],
                        help="the peer's tanh GELU (GPT-2 layout only): see above")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batches")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile --steps steps of each side and tabulate the costliest ops")
    parser.add_argument("--markdown", type=Path, help="also write the tables as Markdown here (rows as JSON next to it)")
    parser.add_argument("--plot", type=Path, help="also write a PNG bar chart here")
    args, overrides = parser.parse_known_args(argv)
    threads = torch.get_num_threads()
    try:
        modes = check_args(args)
        torch.set_num_threads(args.threads)
        return run(args, modes, overrides, command="python -m tools.bench_peers " + shlex.join(argv))
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)


def check_args(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ConfigError(f"--modes {args.modes!r}: give a comma-separated list of {', '.join(MODES)}")
    for key in ("rounds", "steps", "threads"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key} must be >= 1 (got {getattr(args, key)})")
    if args.warmup < 1:
        raise ConfigError(f"--warmup must be >= 1 (got {args.warmup}): the first step compiles and allocates")
    return modes


def run(args: argparse.Namespace, modes: list[str], overrides: list[str], command: str) -> int:
    cfg, sides = build_sides(args.config, overrides, modes, args.peer_gelu, args.seed)
    device = pick_device(cfg.train.device, 0)
    seconds = measure(sides, args.rounds, args.steps, args.warmup, device)
    tokens = cfg.train.micro_batch_size * cfg.seq_len * cfg.train.grad_accum_steps
    rows, ratios = rows_of(sides, seconds, tokens), ratios_of(seconds, modes)
    where = provenance(device)
    title = (f"bench_peers: {args.config} {' '.join(overrides)} on {where['hardware']}, torch {where['torch']}, "
             f"{where['date']}; perfgpt vs transformers, one training step").replace("  ", " ")
    setup = setup_lines(cfg, sides[0].optimizer, args.peer_gelu, args)
    print(title + "\n" + "\n".join(setup) + "\n")
    print(text_table(ROW_HEAD, row_cells(rows), left=2) + "\n")
    print(text_table(RATIO_HEAD, ratio_cells(ratios)))
    profiles = profile_sides(sides, args.steps) if args.profile else {}
    profile_part = []
    if profiles:
        head, body = profile_cells(profiles)
        print("\n" + text_table(head, body))
        profile_part = [f"Where a step's time goes: torch.profiler, self CPU time per op, {args.steps} steps per "
                        "side after the timed rounds (one sample, not interleaved)", "",
                        markdown_table(head, body), ""]
    if args.markdown:
        markdown = "\n".join([title, "", *[f"- {line}" for line in setup], f"- command: `{command}`", "",
                              markdown_table(ROW_HEAD, row_cells(rows), left=2), "",
                              markdown_table(RATIO_HEAD, ratio_cells(ratios)), "", *profile_part])
        if args.plot:
            markdown += f"\n![tokens/s per side]({args.plot.name})\n"
        write_results(args.markdown, markdown, title, rows, ratios=ratios, setup=setup, command=command,
                      provenance=where, config=args.config, overrides=overrides,
                      optimizer={side.label: optimizer_settings(side.optimizer) for side in sides},
                      batches={side.label: side.seen for side in sides}, profile_ms_per_step=profiles)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
