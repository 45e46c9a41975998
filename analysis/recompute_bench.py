"""Measured activation memory and recompute overhead of each activation recompute policy.

The library behind ``tools/bench_memory.py`` and the "measured here" column of the chapter's
recompute table (``analysis/chapter_measurements.py``). For every (attention backend, policy) pair it builds
the same GPT (same seed, same weights), runs one forward and backward on the same batch and
reports:

- bytes saved for backward per block: every tensor autograd saves, seen through an outer
  ``saved_tensors_hooks`` and counted once per storage (views of one buffer keep one buffer
  alive); parameters and buffers are not activations and are left out. Two kinds of memory an
  outer hook cannot see are added from the policy itself: the outputs op_selective's SAC cache
  keeps, and what offload moves to host memory (reported in its own column);
- on CUDA, the allocator's view: memory held after the forward and the peak during forward +
  backward, both above what was allocated before the step;
- step time (forward + backward, no optimizer) as a ratio to ``none``, measured in the same run
  with the policies interleaved round by round (common/measure.py), median over the rounds;
- next to the measurement, two estimates from ``analysis.estimator``: its tensor-by-tensor
  count for our Block (``saved_bytes_per_layer``) and Korthikanti et al. 2022's per-layer
  formula generalized to any width (``activation_bytes_per_layer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from analysis import estimator as est
from common.errors import ConfigError
from common.measure import interleaved, provenance, resolve_device, summarize, synchronize
from common.report import markdown_table, new_figure, save_figure, text_table, write_results
from model.config import ModelConfig
from model.gpt import GPT, indexed_blocks
from model.recompute import apply_recompute

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIB = 2**20


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
    for index, block in indexed_blocks(model):

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
    apply_recompute(model, policy, model_cfg.recompute_every_k, observer=observer)
    return model


def make_batch(model_cfg: ModelConfig, seq_len: int, micro_batch: int, device: torch.device, seed: int = 1):
    if seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; raise --max-seq-len")
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
    synchronize(device)
    if device.type == "cuda":
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
    samples = interleaved(
        {p: (lambda model=model: _train_step(model, idx, targets)) for p, model in models.items()},
        rounds=steps, warmup=1, device=device, before=lambda p: models[p].zero_grad(set_to_none=True),
        progress="recompute policies",
    )
    return {p: summarize(s).median for p, s in samples.items()}


# --------------------------------------------------------------------------- analytic column


# The backends whose saved tensors analysis.estimator.saved_bytes_per_layer counts one by one;
# flash_attn's (CUDA only) are not modelled there, so its rows have no exact-count cell.
EXACT_COUNT_BACKENDS = ("sdpa", "reference")


def analytic_per_layer_bytes(model_cfg: ModelConfig, seq_len: int, micro_batch: int, policy: str,
                             dtype: torch.dtype, attention_backend: str, device: str | torch.device = "cpu") -> float:
    """Korthikanti et al.'s per-layer estimate (analysis.estimator.activation_bytes_per_layer)."""
    dtype_bytes = torch.finfo(dtype).bits // 8
    mask_bytes = dtype_bytes if torch.device(device).type == "cpu" else 1  # CPU dropout masks: input width
    return float(est.activation_bytes_per_layer(model_cfg, seq_len, micro_batch, policy, dtype_bytes,
                                                attention=attention_backend, dropout_mask_bytes=mask_bytes))


def exact_per_layer_bytes(model_cfg: ModelConfig, seq_len: int, micro_batch: int, policy: str,
                          dtype: torch.dtype, attention_backend: str,
                          device: str | torch.device = "cpu") -> float | None:
    """The estimator's tensor-by-tensor count for our Block (analysis.estimator.saved_bytes_per_layer);
    None for a backend it does not model (EXACT_COUNT_BACKENDS)."""
    if attention_backend not in EXACT_COUNT_BACKENDS:
        return None
    return float(est.saved_bytes_per_layer(model_cfg, seq_len, micro_batch, policy, torch.finfo(dtype).bits // 8,
                                           attention=attention_backend, device=torch.device(device).type))


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


def table_columns(rows: list[dict]) -> list[tuple[str, Callable[[dict], str]]]:
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


def _cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = table_columns(rows)
    return [name for name, _ in columns], [[fmt(r) for _, fmt in columns] for r in rows]


def format_table(rows: list[dict]) -> str:
    return text_table(*_cells(rows), left=2)


TITLE = "Activation memory and recompute overhead per recompute policy"


def format_markdown(rows: list[dict], settings: str) -> str:
    lines = [f"# {TITLE}", "", settings, "", markdown_table(*_cells(rows), left=2)]
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


def write_markdown(rows: list[dict], settings: str, path: Path) -> list[Path]:
    """The Markdown table, and its rows as JSON next to it (same stem)."""
    return write_results(path, format_markdown(rows, settings), f"{TITLE}: {settings}", rows)


def write_plot(rows: list[dict], path: Path) -> None:
    attentions = list(dict.fromkeys(r["attention"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (ax_mem, ax_time) = new_figure(ncols=2, width=6.0, height=4.5)
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
    save_figure(fig, path)


def settings_line(
    model_cfg: ModelConfig, seq_len: int, micro_batch: int, dtype: torch.dtype, device: torch.device, steps: int
) -> str:
    where = provenance(device)
    return (
        f"Measured {where['date']} on {where['hardware']}, torch {where['torch']}: "
        f"d_model={model_cfg.d_model}, n_head={model_cfg.n_head}, n_layer={model_cfg.n_layer}, d_ff={model_cfg.d_ff}, "
        f"mlp={model_cfg.mlp}, dropout={model_cfg.dropout}, seq_len={seq_len}, micro_batch={micro_batch}, "
        f"{str(dtype).removeprefix('torch.')}, every_k={model_cfg.recompute_every_k}, {steps} timed rounds."
    )
