"""Small side-by-side measurements behind the "measured here" column of tools/reproduce.py.

Each function runs on whatever device it is given and returns plain dicts (JSON-ready) that
name the hardware. On CPU the figures are what this machine can say (numeric formats, bytes
saved for backward, relative CPU throughput); figures that only mean something on a GPU
(kernel time, allocator peaks) are measured only when the device is CUDA. Ratios are always
measured in one run with the variants interleaved (common/measure.py), never against a number
from another run.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from analysis import data_bench, recompute_bench
from common.measure import interleaved, peak_bytes, provenance, summarize
from model.attention import AttentionCore
from model.config import RECOMPUTE_POLICIES, ModelConfig
from model.gpt import GPT
from training.config import load_config

FORMAT_DTYPES = {
    "FP32": "float32",
    "FP16": "float16",
    "BF16": "bfloat16",
    "FP8 (E4M3)": "float8_e4m3fn",
    "FP8 (E5M2)": "float8_e5m2",
}


# --------------------------------------------------------------------------- numeric formats


def measure_formats() -> dict[str, dict]:
    """torch.finfo of each format, plus whether +inf survives a cast into it."""
    rows = {}
    for label, name in FORMAT_DTYPES.items():
        dtype = getattr(torch, name, None)
        if dtype is None:
            rows[label] = {"dtype": name, "missing": True}
            continue
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))
        inf_cast = torch.tensor(float("inf")).to(dtype).float().item()
        rows[label] = {
            "dtype": name,
            "bits": info.bits,
            "exponent_bits": info.bits - 1 - mantissa,
            "mantissa_bits": mantissa,
            "max": info.max,
            "min_normal": info.smallest_normal,
            "min_subnormal": info.smallest_normal * info.eps,
            "eps": info.eps,
            "inf_casts_to": inf_cast,
        }
    return rows


# --------------------------------------------------------------------------- saved-tensor counting


@contextlib.contextmanager
def count_saved_bytes(exclude: list[torch.Tensor]):
    """Count bytes autograd saves for backward inside the block, once per storage.

    ``exclude`` are tensors that are not activations (parameters, buffers). Yields a dict whose
    ``bytes`` entry is filled as tensors are saved.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude if t.numel()}
    seen: set[int] = set()
    result = {"bytes": 0}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in excluded and ptr not in seen:
            seen.add(ptr)
            result["bytes"] += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result


# --------------------------------------------------------------------------- precision modes


PRECISION_VARIANTS = ("fp32", "bf16_autocast", "fp16_autocast", "bf16_model")


def _precision_context(variant: str, device: torch.device):
    if variant == "bf16_autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if variant == "fp16_autocast":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def measure_precision_modes(
    model_cfg: ModelConfig, seq_len: int, micro_batch: int, device: torch.device, rounds: int = 3
) -> dict:
    """Tokens/s of forward + backward + AdamW step, and bytes saved for backward, per precision.

    fp32; bf16/fp16 autocast over fp32 weights; the whole model in bf16 (what bf16_master runs its
    forward in; the fp32 master copy only changes the optimizer). Variants are interleaved round by
    round and the median is reported, with ratios to fp32 from the same run. fp16 here has no
    loss scaler: this measures speed, not training stability.
    """
    torch.manual_seed(0)
    idx = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len + 1), device=device)
    inputs, targets = idx[:, :-1], idx[:, 1:]
    models, optimizers = {}, {}
    for variant in PRECISION_VARIANTS:
        torch.manual_seed(0)
        model = GPT(model_cfg).to(device)
        if variant == "bf16_model":
            model = model.to(torch.bfloat16)
        model.train()
        models[variant] = model
        optimizers[variant] = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(variant: str) -> None:
        with _precision_context(variant, device):
            loss = models[variant](inputs, targets)
        loss.backward()
        optimizers[variant].step()
        optimizers[variant].zero_grad(set_to_none=True)

    saved = {}
    for variant, model in models.items():
        step(variant)  # warm-up (and lazily created optimizer state)
        exclude = list(model.parameters()) + list(model.buffers())
        with count_saved_bytes(exclude) as counted, _precision_context(variant, device):
            loss = model(inputs, targets)
        loss.backward()
        model.zero_grad(set_to_none=True)
        saved[variant] = counted["bytes"]
    # warm-up already done above, with the saved-bytes count
    samples = interleaved({v: (lambda v=v: step(v)) for v in PRECISION_VARIANTS}, rounds, warmup=0, device=device,
                          progress="precision modes")
    tokens = seq_len * micro_batch
    seconds = {v: summarize(s).median for v, s in samples.items()}
    return {
        **provenance(device),
        "setup": _model_setup(model_cfg, seq_len, micro_batch) + f", {rounds} interleaved rounds",
        "tokens_per_s": {v: tokens / s for v, s in seconds.items()},
        "speed_vs_fp32": {v: seconds["fp32"] / s for v, s in seconds.items()},
        "saved_bytes": saved,
        "saved_vs_fp32": {v: b / saved["fp32"] for v, b in saved.items()},
    }


def _model_setup(cfg: ModelConfig, seq_len: int, micro_batch: int) -> str:
    return (
        f"GPT d_model={cfg.d_model}, n_head={cfg.n_head}, n_layer={cfg.n_layer}, seq_len={seq_len}, "
        f"micro_batch={micro_batch}"
    )


# --------------------------------------------------------------------------- attention


def measure_attention(
    batch: int, heads: int, seq_len: int, head_dim: int, device: torch.device, dtype: torch.dtype, rounds: int = 3
) -> dict:
    """Bytes the attention core saves for backward, reference (explicit scores) vs SDPA, and on
    CUDA their forward+backward time side by side."""
    torch.manual_seed(0)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    cores = {name: AttentionCore(name, 0.0) for name in ("reference", "sdpa")}
    saved = {}
    for name, core in cores.items():
        with count_saved_bytes([q, k, v]) as counted:
            out = core(q, k, v)
        out.sum().backward()
        saved[name] = counted["bytes"]
    result = {
        **provenance(device),
        "setup": f"b={batch}, heads={heads}, s={seq_len}, d_head={head_dim}, {str(dtype).removeprefix('torch.')}",
        "saved_bytes": saved,
        "saved_ratio": saved["reference"] / saved["sdpa"],
    }
    if device.type == "cuda":
        steps = {name: (lambda core=core: core(q, k, v).sum().backward()) for name, core in cores.items()}
        samples = interleaved(steps, rounds, warmup=1, device=device, progress="attention backends")
        result["seconds"] = {name: summarize(s).median for name, s in samples.items()}
        result["speedup"] = result["seconds"]["reference"] / result["seconds"]["sdpa"]
        result["peak_bytes"] = {name: peak_bytes(fn, device) for name, fn in steps.items()}
    return result


# --------------------------------------------------------------------------- the benches' libraries


def measure_recompute(model_cfg: ModelConfig, seq_len: int, micro_batch: int, device: torch.device, steps: int) -> dict:
    """Rows of the recompute benchmark (analysis/recompute_bench.py): saved bytes per block, time vs none."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = recompute_bench.run_benchmark(
        model_cfg, list(RECOMPUTE_POLICIES), ["reference", "sdpa"], seq_len, micro_batch, dtype, device, steps
    )
    return {
        **provenance(device),
        "setup": _model_setup(model_cfg, seq_len, micro_batch) + f", {str(dtype).removeprefix('torch.')}",
        "rows": rows,
    }


# The data-loader grid the chapter's data-format table quotes: small enough for every CPU run.
DATA_GRID = data_bench.GridOptions(mb=2, seq_len=1024, batch_sizes=[8], workers=[0, 2], batches=20, tokenizer="byte")


def run_data_benchmark(markdown: Path, plot: Path) -> list[Path]:
    """The data-loader benchmark (analysis/data_bench.py) at the small DATA_GRID scale, written to ``markdown``
    (with its rows as JSON next to it) and ``plot``."""
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    tiny = data_bench.ConsumerModel("tiny", cfg.model, cfg.data.seq_len or cfg.model.max_seq_len,
                                    cfg.train.micro_batch_size)
    result = data_bench.run_benchmark(DATA_GRID, [tiny], log=lambda line: print(line, flush=True))
    data_bench.write_plot(result, plot)
    where = provenance(data_bench.CPU)  # loaders run on the host whatever the model's device
    command = " ".join(["python -m tools.bench_data", *DATA_GRID.as_flags(), "--models configs/tiny.yaml"])
    return data_bench.write_markdown(result, where, markdown, command) + [plot]


def measurement_model(quick: bool, device_type: str = "cpu") -> tuple[ModelConfig, int, int]:
    """The GPT the side-by-side measurements use: (config, seq_len, micro_batch).

    Tiny with ``quick`` (CI); small on CPU; on a GPU large enough that kernels, not launches, dominate.
    """
    if quick:
        cfg = ModelConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, d_model=64)
        return cfg, 64, 2
    if device_type == "cuda":
        cfg = ModelConfig(vocab_size=32000, max_seq_len=2048, n_layer=8, n_head=16, d_model=2048)
        return cfg, 2048, 4
    cfg = ModelConfig(vocab_size=256, max_seq_len=256, n_layer=4, n_head=4, d_model=128)
    return cfg, 256, 4
