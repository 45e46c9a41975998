"""common/measure.py, the one home for measurement: interleaved rounds, per-round ratios and their
verdict, device resolution, and the kernel tolerance rule the kernel tests and tools/bench_kernels.py
share; common/report.py's rows-as-JSON next to every Markdown table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from analysis import kernel_bench
from common.errors import CapabilityError, ConfigError, DataError
from common.measure import (
    NO_DIFFERENCE,
    ToleranceCheck,
    check_against_fp32,
    error_floor,
    interleaved,
    kernel_tolerance,
    peak_bytes,
    provenance,
    ratio_summary,
    repeat,
    resolve_device,
    speedup,
    summarize,
)
from common.report import read_results, rows_path, write_results
from kernels import reference

CPU = torch.device("cpu")


def test_interleaved_runs_the_variants_round_by_round_after_the_warmup():
    calls: list[str] = []
    cleared: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    samples = interleaved(fns, rounds=3, warmup=1, device=CPU, before=cleared.append)
    assert calls == ["a", "b", "c"] * 4  # one warm-up round, then three timed ones, A B C each time
    assert cleared == ["a", "b", "c"] * 3  # `before` runs for timed calls only
    assert {name: len(s) for name, s in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for s in samples.values() for t in s)


def test_repeat_times_each_call_after_the_warmup():
    calls = []
    times = repeat(lambda: calls.append(1), CPU, reps=4, warmup=2)
    assert len(calls) == 6 and len(times) == 4
    with pytest.raises(ConfigError, match="reps must be >= 1"):
        repeat(lambda: None, CPU, reps=0)
    assert peak_bytes(lambda: calls.append(1), CPU) is None and len(calls) == 6  # no allocator count off CUDA


def test_ratio_is_taken_per_round_and_a_spread_across_one_says_no_difference():
    # a slow second round hits both variants: per-round ratios stay 2.0 although the medians blur
    baseline, variant = [1.0, 3.0, 1.2], [0.5, 1.5, 0.6]
    faster = speedup(variant, baseline)
    assert (faster.median, faster.min, faster.max, faster.n) == (2.0, 2.0, 2.0, 3)
    assert faster.measured_difference and faster.text() == "2.00x (2.00-2.00)"
    noisy = ratio_summary([1.1, 0.9, 1.05], [1.0, 1.0, 1.0])
    assert not noisy.measured_difference
    assert noisy.text() == f"1.05x (0.90-1.10): {NO_DIFFERENCE}"
    assert summarize([3.0, 1.0, 2.0]).median == 2.0
    with pytest.raises(ValueError, match="same non-zero number of rounds"):
        ratio_summary([1.0], [1.0, 2.0])


def test_resolve_device_names_the_flag_in_its_one_line_errors(monkeypatch):
    assert resolve_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    with pytest.raises(CapabilityError, match="--device cuda: no CUDA device is visible here; use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="--gpu 'tpu9' is not a device"):
        resolve_device("tpu9", option="--gpu")


def test_provenance_names_hardware_date_and_torch():
    where = provenance(CPU)
    assert set(where) == {"hardware", "date", "torch"}
    assert where["hardware"].startswith("CPU") and where["torch"] == torch.__version__


def _rms_norm_args(dtype):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 40, generator=generator) * 2).to(dtype)
    w = (torch.randn(40, generator=generator) + 1).to(dtype)
    return [x, w, 1e-6]


def test_the_tolerance_rule_passes_eager_itself_and_fails_a_kernel_twice_as_wrong():
    args = _rms_norm_args(torch.bfloat16)
    same = check_against_fp32(reference.rms_norm, reference.rms_norm, args, [0, 1], interpreted=False)
    assert same.ok and same.errors == same.eager_errors
    assert all(t > 2 * e for e, t in zip(same.eager_errors, same.tolerances))  # twice eager, plus a floor

    def sloppy(x, w, eps):  # a kernel off by a few ulps more than eager bf16 in its output
        out = reference.rms_norm(x, w, eps)
        return out + (out.detach().float().abs().max() * 2.0**-5).to(out.dtype)

    bad = check_against_fp32(sloppy, reference.rms_norm, args, [0, 1], interpreted=False)
    assert not bad.ok and bad.errors[0] > bad.tolerances[0]
    assert bad.failures()[0].startswith("output: kernel error") and "eager error" in bad.failures()[0]


def test_the_tolerance_rule_reports_a_wrong_output_dtype():
    args = _rms_norm_args(torch.bfloat16)
    upcast = check_against_fp32(lambda x, w, eps: reference.rms_norm(x, w, eps).float(), reference.rms_norm,
                                args, [0], interpreted=False)
    assert not upcast.ok and "torch.float32 vs eager's" in upcast.failures()[0]


def test_kernel_bench_and_kernel_tests_share_the_one_rule():
    """tools/bench_kernels.py's correctness column comes from common.measure, not a copy of it."""
    args = _rms_norm_args(torch.float32)
    check = kernel_bench.check_op(reference.rms_norm, reference.rms_norm, args, [0, 1], interpreted=True)
    assert isinstance(check, ToleranceCheck)
    expected = check_against_fp32(reference.rms_norm, reference.rms_norm, args, [0, 1], interpreted=True, seed=1)
    assert (check.errors, check.tolerances) == (expected.errors, expected.tolerances)
    assert error_floor(torch.float32, torch.tensor([3.0]), True) == pytest.approx(4e-5)
    assert kernel_tolerance(0.25, 0.01) == 0.51


def test_results_are_written_as_markdown_with_their_rows_as_strict_json(tmp_path):
    md = tmp_path / "bench.md"
    written = write_results(md, "# table\n", "bench: CPU, 2030-01-01", [{"a": 1.0, "b": math.nan}], setting="s")
    assert written == [md, tmp_path / "bench.json"] and rows_path(md) == tmp_path / "bench.json"
    assert json.loads(rows_path(md).read_text()) == {"title": "bench: CPU, 2030-01-01", "setting": "s",
                                                     "rows": [{"a": 1.0, "b": None}]}
    assert read_results(rows_path(md))["rows"][0]["a"] == 1.0
    rows_path(md).write_text("{not json")
    with pytest.raises(DataError, match="bench.json: cannot read the results"):
        read_results(rows_path(md))
    rows_path(md).write_text('{"rows": 3}')
    with pytest.raises(DataError, match="not a results file"):
        read_results(rows_path(md))


def test_interleaved_counts_every_call_in_its_progress(monkeypatch):
    import common.measure as measure

    made = []

    class Counted(measure.Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(measure, "Progress", Counted)
    calls = []
    measure.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1,
                        progress="two variants")
    measure.interleaved({"a": lambda: None}, rounds=2)
    assert [(p.total, p.done, p.desc, p.enabled) for p in made] == [(8, 8, "two variants", True), (3, 3, "", False)]
    assert calls == ["a", "b"] * 4
