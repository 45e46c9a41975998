"""Measured activation memory and recompute overhead of each activation checkpointing policy.

For every (attention backend, policy) pair it builds the same GPT (same seed, same weights), runs
one forward and backward on the same batch and reports:

- bytes saved for backward per block: every tensor autograd saves, seen through an outer
  ``saved_tensors_hooks`` and counted once per storage (views of one buffer keep one buffer
  alive); parameters and buffers are not activations and are left out. Two kinds of memory an
  outer hook cannot see are added from the policy itself: the outputs op_selective's SAC cache
  keeps, and what offload moves to host memory (reported in its own column);
- on CUDA, the allocator's view: memory held after the forward and the peak during forward +
  backward, both above what was allocated before the step;
- step time (forward + backward, no optimizer) as a ratio to ``none``, measured in the same run
  with the policies interleaved round by round, median over ``--steps`` rounds.

Where ``analysis.estimator`` exists, two estimate columns sit next to the measurement: its
tensor-by-tensor count for our Block (``saved_bytes_per_layer``) and Korthikanti et al. 2022's
per-layer formula generalized to any width (``activation_bytes_per_layer``).

    python tools/bench_memory.py                       # default: small GPT, CPU fp32
    python tools/bench_memory.py --attention reference --markdown docs/results/recompute.md \
        --plot docs/results/recompute.png
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.checkpointing import apply_activation_checkpointing  # noqa: E402
from model.config import CHECKPOINT_POLICIES, ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIB = 2**20


class BenchError(ValueError):
    """Bad benchmark input; the message names the option and the fix."""


# --------------------------------------------------------------------------- counting saved tensors


@dataclass
class SavedTensorLedger:
    """Bytes kept for backward, per block ('outside' for embeddings, final norm, head and loss)."""

    excluded_storages: set[tuple[str, int]]  # parameters and buffers: not activations
    current: int | str = "outside"
    saved: dict = field(default_factory=dict)  # {layer: bytes kept on the compute device}
    cached: dict = field(default_factory=dict)  # {layer: bytes of those kept by op_selective's cache}
    offloaded: dict = field(default_factory=dict)  # {layer: bytes moved to host memory}
    _seen: set = field(default_factory=set)
    _seen_offloaded: set = field(default_factory=set)

    def reset(self) -> None:
        """Forget everything seen so far (after a warm-up step)."""
        self.current = "outside"
        for counts in (self.saved, self.cached, self.offloaded, self._seen, self._seen_offloaded):
            counts.clear()

    def record_saved(self, tensor: torch.Tensor) -> None:
        nbytes = self._new_storage_bytes(tensor, self._seen)
        self.saved[self.current] = self.saved.get(self.current, 0) + nbytes

    def observe(self, kind: str, tensor: torch.Tensor) -> None:
        """The checkpointing Observer: memory the policy keeps outside autograd's saved tensors."""
        if kind == "cached":
            nbytes = self._new_storage_bytes(tensor, self._seen)
            self.saved[self.current] = self.saved.get(self.current, 0) + nbytes
            self.cached[self.current] = self.cached.get(self.current, 0) + nbytes
        elif kind == "offloaded":
            nbytes = self._host_bytes(tensor)
            self.offloaded[self.current] = self.offloaded.get(self.current, 0) + nbytes

    def _new_storage_bytes(self, tensor: torch.Tensor, seen: set) -> int:
        key = _storage_key(tensor)
        if key in self.excluded_storages or key in seen:
            return 0
        seen.add(key)
        return tensor.untyped_storage().nbytes()

    def _host_bytes(self, tensor: torch.Tensor) -> int:
        # save_on_cpu copies each saved device tensor on its own (views of one buffer are copied
        # once each); a CPU tensor is kept as it is, so count its storage once.
        if tensor.device.type != "cpu":
            return tensor.numel() * tensor.element_size()
        return self._new_storage_bytes(tensor, self._seen_offloaded)


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _model_storages(model: torch.nn.Module) -> set[tuple[str, int]]:
    tensors = list(model.parameters()) + list(model.buffers())
    return {_storage_key(t) for t in tensors if t.numel()}


def _track_current_block(model: GPT, ledger: SavedTensorLedger) -> list:
    handles = []
    for index, block in enumerate(model.blocks):

        def enter(module, args, index=index):
            ledger.current = index

        def leave(module, args, output):
            ledger.current = "outside"

        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    return handles


def _pack_counting(ledger: SavedTensorLedger):
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ledger.record_saved(tensor)
        return tensor.detach()  # a detached alias: keeps no reference cycle through the graph

    return pack


# --------------------------------------------------------------------------- one measurement


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is visible here; use --device cpu")
    return torch.device(name)


def build_model(
    model_cfg: ModelConfig,
    policy: str,
    attention_backend: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    observer=None,
) -> GPT:
    """The same weights for every policy (fixed seed), then the policy applied in place."""
    torch.manual_seed(seed)
    model = GPT(model_cfg, attention_backend=attention_backend).to(device=device, dtype=dtype)
    model.train()
    apply_activation_checkpointing(model, policy, model_cfg.checkpoint_every_k, observer=observer)
    return model


def make_batch(model_cfg: ModelConfig, seq_len: int, micro_batch: int, device: torch.device, seed: int = 1):
    if seq_len > model_cfg.max_seq_len:
        raise BenchError(f"--seq-len {seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; raise --max-seq-len")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


def measure_saved_bytes(
    model_cfg: ModelConfig,
    policy: str,
    seq_len: int,
    micro_batch: int,
    attention_backend: str = "reference",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Bytes saved for backward by one training step of ``policy`` (see the module docstring)."""
    device = resolve_device(device) if isinstance(device, str) else device
    ledger = SavedTensorLedger(excluded_storages=set())
    model = build_model(model_cfg, policy, attention_backend, dtype, device, observer=ledger.observe)
    ledger.excluded_storages = _model_storages(model)
    idx, targets = make_batch(model_cfg, seq_len, micro_batch, device)
    _train_step(model, idx, targets)  # warm-up: one-time buffers (cuBLAS workspaces, ...) are not activations
    model.zero_grad(set_to_none=True)
    ledger.reset()  # the policy's observer already reported the warm-up's cache and offload
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    handles = _track_current_block(model, ledger)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack_counting(ledger), lambda t: t):
            loss = model(idx, targets)
    finally:
        for handle in handles:
            handle.remove()
    after_forward = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None
    loss.backward()
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return _summarize(ledger, model_cfg, policy, seq_len, micro_batch, attention_backend, dtype, after_forward, peak)


def _summarize(ledger, model_cfg, policy, seq_len, micro_batch, attention_backend, dtype, after_forward, peak) -> dict:
    layers = range(model_cfg.n_layer)
    block_bytes = [ledger.saved.get(i, 0) for i in layers]
    block_offloaded = [ledger.offloaded.get(i, 0) for i in layers]
    outside = ledger.saved.get("outside", 0)
    return {
        "policy": policy,
        "attention": attention_backend,
        "dtype": str(dtype).removeprefix("torch."),
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "n_layer": model_cfg.n_layer,
        "block_bytes": block_bytes,
        "block_cached_bytes": [ledger.cached.get(i, 0) for i in layers],
        "block_offloaded_bytes": block_offloaded,
        "per_layer_bytes": sum(block_bytes) / len(block_bytes),
        "outside_bytes": outside,
        "saved_bytes": sum(block_bytes) + outside,
        "offloaded_bytes": sum(block_offloaded) + ledger.offloaded.get("outside", 0),
        "device_after_forward_bytes": after_forward,
        "device_peak_bytes": peak,
    }


# --------------------------------------------------------------------------- step time, side by side


def _train_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> None:
    model(idx, targets).backward()


def time_policies(
    model_cfg: ModelConfig,
    policies: list[str],
    seq_len: int,
    micro_batch: int,
    attention_backend: str,
    dtype: torch.dtype,
    device: torch.device,
    steps: int = 5,
) -> dict[str, float]:
    """Median seconds of forward + backward per policy; policies interleaved so drift hits all alike."""
    models = {p: build_model(model_cfg, p, attention_backend, dtype, device) for p in policies}
    idx, targets = make_batch(model_cfg, seq_len, micro_batch, device)
    for model in models.values():  # warm-up round, not timed
        _train_step(model, idx, targets)
    samples: dict[str, list[float]] = {p: [] for p in policies}
    for _ in range(steps):
        for policy, model in models.items():
            model.zero_grad(set_to_none=True)
            _synchronize(device)
            start = time.perf_counter()
            _train_step(model, idx, targets)
            _synchronize(device)
            samples[policy].append(time.perf_counter() - start)
    return {p: statistics.median(s) for p, s in samples.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- analytic column


def analytic_per_layer_bytes(model_cfg, seq_len, micro_batch, policy, dtype, attention_backend, device="cpu"):
    """Korthikanti et al.'s per-layer estimate (analysis.estimator.activation_bytes_per_layer), or None."""
    mask_bytes = torch.finfo(dtype).bits // 8 if str(device).startswith("cpu") else 1  # CPU masks: input width
    return _estimate(
        "activation_bytes_per_layer", model_cfg, seq_len, micro_batch, policy,
        dtype_bytes=torch.finfo(dtype).bits // 8, attention=attention_backend, dropout_mask_bytes=mask_bytes,
    )


def exact_per_layer_bytes(model_cfg, seq_len, micro_batch, policy, dtype, attention_backend, device="cpu"):
    """The estimator's tensor-by-tensor count for our Block (analysis.estimator.saved_bytes_per_layer), or None."""
    return _estimate(
        "saved_bytes_per_layer", model_cfg, seq_len, micro_batch, policy,
        dtype_bytes=torch.finfo(dtype).bits // 8, attention=attention_backend, device=torch.device(device).type,
    )


def _estimate(function_name: str, model_cfg, seq_len, micro_batch, policy, **options) -> float | None:
    # The estimator is another module's work: imported lazily, options passed only where it takes them,
    # and None (no column) when it or the policy is not there.
    try:
        estimator = importlib.import_module("analysis.estimator")
    except ImportError:
        return None
    estimate = getattr(estimator, function_name, None)
    if estimate is None:
        return None
    params = inspect.signature(estimate).parameters
    accepted = {k: v for k, v in options.items() if k in params}
    try:
        return float(estimate(model_cfg, seq_len, micro_batch, policy, **accepted))
    except (ValueError, KeyError, NotImplementedError):
        return None


# --------------------------------------------------------------------------- the whole benchmark


def run_benchmark(
    model_cfg: ModelConfig,
    policies: list[str],
    attentions: list[str],
    seq_len: int,
    micro_batch: int,
    dtype: torch.dtype,
    device: torch.device,
    steps: int,
) -> list[dict]:
    """One row per (attention, policy): measured bytes, analytic bytes and time relative to none."""
    rows = []
    timed = policies if "none" in policies else ["none", *policies]
    for attention in attentions:
        seconds = time_policies(model_cfg, timed, seq_len, micro_batch, attention, dtype, device, steps)
        baseline = None
        for policy in policies:
            row = measure_saved_bytes(model_cfg, policy, seq_len, micro_batch, attention, dtype, device)
            if policy == "none":
                baseline = row["saved_bytes"]
            estimate_args = (model_cfg, seq_len, micro_batch, policy, dtype, attention, device)
            row["analytic_per_layer_bytes"] = analytic_per_layer_bytes(*estimate_args)
            row["exact_per_layer_bytes"] = exact_per_layer_bytes(*estimate_args)
            row["step_seconds"] = seconds[policy]
            row["overhead"] = seconds[policy] / seconds["none"]
            row["saved_vs_none"] = row["saved_bytes"] / baseline if baseline else None
            rows.append(row)
    return rows


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.2f}"


def table_columns(rows: list[dict]) -> list[tuple[str, callable]]:
    columns = [
        ("attention", lambda r: r["attention"]),
        ("policy", lambda r: r["policy"]),
        ("saved/block MiB", lambda r: _mib(r["per_layer_bytes"])),
    ]
    if any(r.get("exact_per_layer_bytes") is not None for r in rows):
        columns.append(("exact count/block MiB", lambda r: _mib(r.get("exact_per_layer_bytes"))))
    if any(r.get("analytic_per_layer_bytes") is not None for r in rows):
        columns.append(("Korthikanti/block MiB", lambda r: _mib(r.get("analytic_per_layer_bytes"))))
    columns += [
        ("outside blocks MiB", lambda r: _mib(r["outside_bytes"])),
        ("total saved MiB", lambda r: _mib(r["saved_bytes"])),
        ("vs none", lambda r: "-" if r.get("saved_vs_none") is None else f"{r['saved_vs_none']:.2f}"),
        ("offloaded MiB", lambda r: _mib(r["offloaded_bytes"]) if r["offloaded_bytes"] else "-"),
    ]
    if any(r["device_peak_bytes"] is not None for r in rows):
        columns += [
            ("alloc after fwd MiB", lambda r: _mib(r["device_after_forward_bytes"])),
            ("peak fwd+bwd MiB", lambda r: _mib(r["device_peak_bytes"])),
        ]
    columns += [
        ("step ms", lambda r: f"{r['step_seconds'] * 1e3:.1f}"),
        ("time vs none", lambda r: f"{r['overhead']:.2f}x"),
    ]
    return columns


def format_table(rows: list[dict]) -> str:
    columns = table_columns(rows)
    cells = [[name for name, _ in columns]] + [[fmt(r) for _, fmt in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: list[dict], settings: str) -> str:
    columns = table_columns(rows)
    lines = [
        "# Activation memory and recompute overhead per checkpointing policy",
        "",
        settings,
        "",
        "| " + " | ".join(name for name, _ in columns) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(columns))) + "|",
    ]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in rows]
    lines += [
        "",
        "saved/block: bytes autograd keeps for backward per transformer block (mean over blocks; every_k "
        "alternates), one count per storage, parameters excluded, op_selective's SAC cache included. "
        "exact count: analysis.estimator's count of the tensors our Block saves; Korthikanti: the paper's "
        "per-layer formula at this width (it omits our fp32 norm statistics and the reference attention's copies; "
        "offload is 0 because nothing stays on the device, while the exact count gives the bytes moved to the host). "
        "outside blocks: embeddings, final norm, LM head and loss. offloaded: bytes offload keeps in host "
        "memory instead. time vs none: median forward+backward time over the same rounds, no optimizer.",
    ]
    return "\n".join(lines) + "\n"


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attentions = list(dict.fromkeys(r["attention"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(attentions)
    for i, attention in enumerate(attentions):
        subset = {r["policy"]: r for r in rows if r["attention"] == attention}
        xs = [p + i * width for p in range(len(policies))]
        ax_mem.bar(xs, [subset[p]["per_layer_bytes"] / MIB for p in policies], width, label=attention)
        ax_time.bar(xs, [subset[p]["overhead"] for p in policies], width, label=attention)
    for ax, title in ((ax_mem, "saved for backward per block (MiB)"), (ax_time, "step time vs none")):
        ax.set_xticks([p + width * (len(attentions) - 1) / 2 for p in range(len(policies))], policies, rotation=20)
        ax.set_title(title)
        ax.legend(title="attention")
    ax_time.axhline(1.0, color="grey", linewidth=0.8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def settings_line(
    model_cfg: ModelConfig, seq_len: int, micro_batch: int, dtype: torch.dtype, device: torch.device, steps: int
) -> str:
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"CPU, torch threads: {torch.get_num_threads()}"
    return (
        f"Measured {datetime.date.today().isoformat()} on {hardware}, torch {torch.__version__}: "
        f"d_model={model_cfg.d_model}, n_head={model_cfg.n_head}, n_layer={model_cfg.n_layer}, d_ff={model_cfg.d_ff}, "
        f"mlp={model_cfg.mlp}, dropout={model_cfg.dropout}, seq_len={seq_len}, micro_batch={micro_batch}, "
        f"{str(dtype).removeprefix('torch.')}, every_k={model_cfg.checkpoint_every_k}, {steps} timed rounds."
    )


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measure bytes saved for backward and step-time overhead of each activation "
        "checkpointing policy on one GPT, side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", help="YAML job config; its model section is used (flags below override)")
    parser.add_argument("--d-model", type=int, help="residual width (default 256, or the config's)")
    parser.add_argument("--n-head", type=int, help="attention heads (default 4, or the config's)")
    parser.add_argument("--n-layer", type=int, help="blocks (default 4, or the config's)")
    parser.add_argument("--dropout", type=float, help="dropout (default 0, or the config's)")
    parser.add_argument("--every-k", type=int, help="k for every_k (default 2, or the config's)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=list(CHECKPOINT_POLICIES), choices=CHECKPOINT_POLICIES)
    parser.add_argument(
        "--attention", nargs="+", default=["reference", "sdpa"], choices=["reference", "sdpa", "flash_attn"],
        help="backends to measure; reference stores the (B,H,T,T) scores, sdpa does not",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (median is reported)")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is steadier on a shared machine)"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    parser.add_argument("--plot", type=Path, help="also write a PNG bar chart here")
    return parser.parse_args(argv)


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    if args.config:
        from training.config import load_config

        cfg = load_config(args.config).model
    else:
        cfg = ModelConfig(d_model=256, n_head=4, n_layer=4)
    overrides = {
        "d_model": args.d_model, "n_head": args.n_head, "n_layer": args.n_layer,
        "dropout": args.dropout, "checkpoint_every_k": args.every_k,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "d_model" in overrides and not args.config:
        overrides["d_ff"] = None  # re-derive from the new width
    cfg = replace(cfg, **overrides, max_seq_len=max(cfg.max_seq_len, args.seq_len))
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_cfg = model_config_from_args(args)
        device = resolve_device(args.device)
        dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        if args.steps < 1:
            raise BenchError("--steps must be >= 1")
        if args.threads is not None:
            if args.threads < 1:
                raise BenchError("--threads must be >= 1")
            torch.set_num_threads(args.threads)
        rows = run_benchmark(
            model_cfg, args.policies, args.attention, args.seq_len, args.micro_batch, DTYPES[dtype_name], device, args.steps
        )
    except ValueError as exc:  # BenchError, ConfigError, CheckpointError, attention errors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = settings_line(model_cfg, args.seq_len, args.micro_batch, DTYPES[dtype_name], device, args.steps)
    print(settings)
    print(format_table(rows))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(format_markdown(rows, settings))
        print(f"wrote {args.markdown}")
    if args.plot:
        write_plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
