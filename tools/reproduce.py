"""Regenerate the chapter's tables: chapter's claim | our analytic figure at its scale | measured here.

Writes one Markdown file and one PNG per table into --out (default docs/results), plus an index
(README.md). Analytic columns come from analysis/estimator/; "measured here" runs small
side-by-side measurements on this machine and names it. Cells that need a GPU say so; a run on
a CUDA machine measures them and saves gpu_measurements.json (with date and hardware) in --out,
which later CPU runs read back to fill those cells. A CPU run saves its own measurements in
cpu_measurements.json, so that a change to the analytic side can be regenerated with
--reuse-measurements instead of measuring again (timings on a shared machine are noisy).
Measured files other tools wrote (bench_train, bench_parallel, bench_data) are read through the
rows each wrote as JSON next to its Markdown, never by parsing the Markdown.

Examples:
  python -m tools.reproduce                      # all tables, measurements at a small CPU scale
  python -m tools.reproduce --quick --out /tmp/r  # the CI path: tiny measurements, seconds
  python -m tools.reproduce --no-measure          # analytic columns only
  python -m tools.reproduce --reuse-measurements  # new analytic columns, the saved measurements
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from analysis import chapter_measurements
from analysis.chapter_tables import DATA_FORMATS_MEASURED_NAME, MEASURED_FILES, Measured, build_tables
from common.errors import USER_FACING_ERRORS
from common.measure import hardware_name, resolve_device
from common.report import read_results, rows_path
from model.config import ModelConfig
from training.config import from_dict, upgrade_renamed

GPU_RESULTS = "gpu_measurements.json"
CPU_RESULTS = "cpu_measurements.json"
REPO_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output directory (default docs/results)")
    parser.add_argument("--quick", action="store_true", help="tiny measurements (CI): every table in seconds")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--no-measure", action="store_true", help="skip measurements; analytic columns only")
    what.add_argument("--reuse-measurements", action="store_true",
                      help=f"measure nothing: rebuild the tables from the measurements an earlier run saved in "
                      f"<out>/{CPU_RESULTS} (<out>/{GPU_RESULTS} with --device cuda)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where to measure; auto: cuda when available")
    parser.add_argument("--threads", type=int,
                        help="CPU threads for the measurements (default: 1 with --quick, else torch's default); "
                        "one thread is steadier on a shared machine")
    parser.add_argument("--gpu-results", type=Path,
                        help=f"GPU measurements to fill 'needs GPU' cells (default: <out>/{GPU_RESULTS} if present)")
    return parser.parse_args(argv)


def run_measurements(device: torch.device, quick: bool) -> dict:
    """Everything 'measured here' for this device, as JSON-ready dicts."""
    cfg, seq_len, micro_batch = chapter_measurements.measurement_model(quick, device.type)
    rounds = 2 if quick else 5
    attention_shape = (1, 4, 256, 32) if quick else (2, 8, 1024, 64)
    if device.type == "cuda" and not quick:
        attention_shape = (4, 16, 4096, 128)  # the chapter's d_head, a length the reference still fits
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {
        "precision": chapter_measurements.measure_precision_modes(cfg, seq_len, micro_batch, device, rounds),
        "attention": chapter_measurements.measure_attention(*attention_shape, device, dtype, rounds),
    }
    recompute = chapter_measurements.measure_recompute(cfg, seq_len, micro_batch, device, steps=1 if quick else 3)
    recompute["model"] = dataclasses.asdict(cfg)
    recompute["device"] = device.type
    results["recompute"] = recompute
    return results


def saved_measurements_path(out: Path, device: torch.device) -> Path:
    return out / (GPU_RESULTS if device.type == "cuda" else CPU_RESULTS)


def load_saved_measurements(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"error: --reuse-measurements: {path} does not exist; run once without it to measure")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: {path} is not valid JSON ({exc}); run without --reuse-measurements") from None


def load_gpu_results(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: {path} is not valid JSON ({exc}); delete it or rerun on a GPU") from None


def read_measured_documents(out: Path) -> dict[str, dict]:
    """The rows of the measured files the tables quote (MEASURED_FILES; each tool writes them as JSON
    next to its Markdown), from --out, else from the repository's docs/results/; a file found in
    neither is left out and its cells say "not measured"."""
    documents = {}
    for name in MEASURED_FILES:
        for folder in (out, REPO_RESULTS):
            if rows_path(folder / name).is_file():
                documents[name] = read_results(rows_path(folder / name))
                break
    return documents


def saved_model_config(fields: dict) -> ModelConfig:
    """The measured model's config as a measurement file saved it, with keys renamed since then
    (``ModelConfig.renamed_keys``) read under their new names."""
    return from_dict(ModelConfig, upgrade_renamed(ModelConfig, fields), "model.")


def assemble(measurements: dict, device: torch.device, gpu_results: dict, out: Path) -> Measured:
    recompute = measurements.get("recompute")
    if recompute is not None:
        recompute = {**recompute, "model_cfg": saved_model_config(recompute["model"])}
    gpu = measurements if device.type == "cuda" else gpu_results
    data_rows = rows_path(out / DATA_FORMATS_MEASURED_NAME)
    return Measured(
        formats=chapter_measurements.measure_formats(),
        precision=measurements.get("precision"),
        attention=measurements.get("attention"),
        recompute=recompute,
        gpu=gpu,
        data_bench=read_results(data_rows) if data_rows.is_file() else None,
        documents=read_measured_documents(out),
    )


def write_index(tables, out: Path, device_line: str) -> Path:
    lines = [
        "# The chapter's tables, reproduced",
        "",
        "Generated by `python -m tools.reproduce`. Each table has three columns: the chapter's claim, our "
        "analytic figure at the chapter's scale (analysis/estimator/), and what was measured here (scale "
        f"and hardware named in the table). {device_line}",
        "",
        "Where the chapter is wrong, each correction the project relies on and the tests that establish it: "
        "[chapter_corrections.md](../chapter_corrections.md).",
        "",
        "How far the analytic columns' model is from published large-scale runs (Megatron-LM, Llama 3, MosaicML, "
        "NeMo, torchtitan): [published_vs_estimator.md](published_vs_estimator.md), written by "
        "`python -m tools.published`.",
        "",
    ]
    lines += [f"- [{t.title}]({t.name}.md)" for t in tables]
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except USER_FACING_ERRORS as exc:  # no CUDA for --device cuda, a damaged results file
        raise SystemExit(f"error: {exc}") from None


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    threads = args.threads or (1 if args.quick else None)
    if threads is not None:
        if threads < 1:
            raise SystemExit("error: --threads must be >= 1")
        torch.set_num_threads(threads)
    start = time.perf_counter()
    saved = saved_measurements_path(args.out, device)
    if args.reuse_measurements:
        measurements = load_saved_measurements(saved)
    else:
        measurements = {} if args.no_measure else run_measurements(device, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    fresh = bool(measurements) and not args.reuse_measurements
    if fresh and not args.quick:  # --quick reuses an earlier result if there is one
        data_md = args.out / DATA_FORMATS_MEASURED_NAME
        chapter_measurements.run_data_benchmark(data_md, data_md.with_suffix(".png"))
    if fresh:
        saved.write_text(json.dumps(measurements, indent=1, default=str) + "\n")
    gpu_results = load_gpu_results(args.gpu_results or args.out / GPU_RESULTS)
    measured = assemble(measurements, device, gpu_results, args.out)
    tables = build_tables(measured)
    if measurements:  # from the measurements themselves, also when they were saved by an earlier run
        where = measurements.get("precision", {}).get("hardware") or hardware_name(device)
    else:
        where = "no measurements (--no-measure)"
    written = []
    for table in tables:
        written += table.write(args.out)
    written.append(write_index(tables, args.out, f"Measured on: {where}."))
    print(f"{'table':<22} {'rows':>4}  files")
    for table in tables:
        files = ", ".join(p.name for p in written if p.stem == table.name)
        print(f"{table.name:<22} {len(table.rows):>4}  {files}")
    print(f"wrote {len(written)} files to {args.out} in {time.perf_counter() - start:.1f} s (measured on {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
