"""tools/diagnose.py: each bottleneck, induced on the CPU, is the one the verdict names.

The slowed loader, the memory budget and selective recompute over SDPA run in this process (a
few steps of a 2-layer model); the communication-heavy layout, on two gloo processes, is in
tests/integration/analysis/test_doctor.py.
"""

from __future__ import annotations

import itertools
import time
import typing

import pytest

from analysis.doctor import Breakdown, Job, Span, attribute, verdicts
from common.errors import ConfigError
from data.prefetch import DevicePrefetcher
from model.config import ModelConfig
from tools.diagnose import main as diagnose_main
from training.config import load_config


def small(corpus_cache: str, *extra: str) -> list[str]:
    return ["--config", "configs/tiny.yaml", "--steps", "2", "--warmup", "1", "--model.n_layer=2",
            "--model.d_model=64", "--model.max_seq_len=64", "--train.micro_batch_size=4",
            f"--data.cache_dir={corpus_cache}", "--data.default_corpus_max_mb=2.0", *extra]


def run(capsys, args: list[str]) -> list[str]:
    assert diagnose_main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("verdict: ")
    return lines


def test_spans_split_into_exposed_and_overlapped_communication_and_host_time():
    spans = [
        Span("aten::mm", 1, 0, 400_000), Span("c10d::allreduce_", 1, 100_000, 300_000, top_level=False),
        Span("Optimizer.step#AdamW.step", 1, 500_000, 600_000), Span("gloo:all_reduce", 2, 0, 250_000),
    ]
    b = attribute(spans, main_thread=1, wall_s=1.0, data_wait_s=0.1)
    assert (b.comm_exposed_s, b.comm_overlapped_s, b.optimizer_s) == pytest.approx((0.2, 0.25, 0.1))
    assert b.host_s == pytest.approx(1.0 - 0.1 - 0.5)  # wall minus data wait minus the main thread's ranges
    assert b.compute_s == pytest.approx(1.0 - 0.1 - 0.1 - 0.2 - 0.4)


def test_pipeline_sends_and_waits_are_communication_and_broadcast_tensors_is_not():
    spans = [Span("aten::broadcast_tensors", 1, 0, 100_000), Span("c10d::recv_", 1, 200_000, 300_000),
             Span("_c10d_functional::wait_tensor", 1, 400_000, 450_000), Span("gloo:send", 2, 0, 80_000)]
    b = attribute(spans, main_thread=1, wall_s=1.0, data_wait_s=0.0)
    assert (b.comm_exposed_s, b.comm_overlapped_s) == pytest.approx((0.15, 0.08))


def test_no_finding_means_compute_bound():
    b = Breakdown(wall_s=1.0, data_wait_s=0.0, optimizer_s=0.05, comm_exposed_s=0.0, comm_overlapped_s=0.0,
                  host_s=0.05)
    job = Job(num_workers=2, world_size=1, strategy="none", recompute="none", attention="sdpa", compile=True,
              fused_optimizer=True, peak_memory_gib=1.0, memory_budget_gib=10.0, device="cuda")
    assert verdicts(b, job)[0].text.startswith("compute-bound: 90%")
    assert "kernels.backend=triton" in verdicts(b, job)[0].text


def test_on_a_cpu_the_doctor_never_proposes_triton_or_compile():
    # Triton runs only in its interpreter on a CPU, and compile fuses nothing worth a launch there.
    job = Job(num_workers=2, world_size=1, strategy="none", recompute="none", attention="sdpa", compile=False,
              fused_optimizer=True, peak_memory_gib=1.0, memory_budget_gib=10.0, device="cpu")
    compute_bound = Breakdown(wall_s=1.0, data_wait_s=0.0, optimizer_s=0.05, comm_exposed_s=0.0,
                              comm_overlapped_s=0.0, host_s=0.05)
    host_bound = Breakdown(wall_s=1.0, data_wait_s=0.0, optimizer_s=0.05, comm_exposed_s=0.0,
                           comm_overlapped_s=0.0, host_s=0.6)
    for breakdown in (compute_bound, host_bound):
        found = verdicts(breakdown, job)
        assert found
        for verdict in found:
            assert "triton" not in verdict.text and "train.compile=true" not in verdict.text, verdict.text
            assert "--train.compile=true" not in verdict.overrides and not any("triton" in o for o in verdict.overrides)
    assert "GPU" in verdicts(compute_bound, job)[0].text
    assert "train.micro_batch_size" in verdicts(host_bound, job)[0].text
    # on a GPU the same host overhead is what compile removes
    on_gpu = verdicts(host_bound, Job(**{**job.__dict__, "device": "cuda"}))[0]
    assert on_gpu.overrides == ["--train.compile=true"]


def test_every_switch_the_doctor_proposes_under_tp_or_zero_bubble_is_one_the_trainer_accepts():
    # The doctor reads only the job; training/config.py refuses compile under tp and with zero_bubble.
    # Every verdict (each bottleneck alone), for every job the trainer
    # accepts, must propose overrides the trainer accepts too.
    bottlenecks = [Breakdown(wall_s=1.0, data_wait_s=d, optimizer_s=o, comm_exposed_s=c, comm_overlapped_s=0.0,
                             host_s=h) for d, o, c, h in [(0.5, 0, 0, 0), (0, 0.5, 0, 0), (0, 0, 0.5, 0), (0, 0, 0, 0.6),
                                                          (0, 0.05, 0, 0.05)]]
    layouts = {"fsdp": ["--parallel.strategy=fsdp"], "tp": ["--parallel.tp=2", "--parallel.strategy=fsdp", "--parallel.dp_shard=2"],
               "zero_bubble": ["--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--train.grad_accum_steps=2",
                               "--parallel.strategy=fsdp"]}
    policies = typing.get_args(typing.get_type_hints(ModelConfig)["recompute"])
    proposed, accepted = set(), {}

    def accepts(keys: list[str]) -> bool:
        if tuple(keys) not in accepted:
            try:
                accepted[tuple(keys)] = load_config(None, keys) is not None
            except ConfigError:
                accepted[tuple(keys)] = False
        return accepted[tuple(keys)]

    for (layout, base), recompute, compile_, fused, attention in itertools.product(
            layouts.items(), policies, (False, True), (False, True), ("sdpa", "reference")):
        job_keys = base + [f"--model.recompute={recompute}", f"--train.compile={str(compile_).lower()}"]
        if not accepts(job_keys):
            continue  # a job the trainer refuses never reaches the doctor
        job = Job(num_workers=0, world_size=4, strategy="fsdp", recompute=recompute, attention=attention,
                  compile=compile_, fused_optimizer=fused, peak_memory_gib=9.5, memory_budget_gib=10.0, device="cuda",
                  tp=2 if layout == "tp" else 1, zero_bubble=layout == "zero_bubble")
        for b in bottlenecks:
            for verdict in verdicts(b, job):
                assert accepts(job_keys + verdict.overrides), (layout, recompute, compile_, verdict.text)
                proposed.add((layout, tuple(verdict.overrides)))
    # compile is proposed where it runs: never under tp or zero_bubble
    assert any("--train.compile=true" in o for layout, o in proposed if layout not in ("tp", "zero_bubble"))
    assert not any("--train.compile=true" in o for layout, o in proposed if layout in ("tp", "zero_bubble"))


def test_a_slowed_loader_is_named_with_its_switch(capsys, monkeypatch, corpus_cache):
    original = DevicePrefetcher.__next__

    def slow(self):  # long enough to stay the largest share when a loaded machine slows the compute too
        time.sleep(1.0)
        return original(self)

    monkeypatch.setattr(DevicePrefetcher, "__next__", slow)
    lines = run(capsys, small(corpus_cache))
    assert lines[-1].startswith("verdict: data wait") and "raise data.num_workers (now 0)" in lines[-1]


def test_selective_recompute_over_sdpa_is_named(capsys, corpus_cache):
    lines = run(capsys, small(corpus_cache, "--model.recompute=selective"))
    assert any("selective recompute with sdpa attention saves nothing" in line for line in lines), lines


def test_a_memory_budget_is_named_and_try_measures_the_switch(capsys, corpus_cache):
    lines = run(capsys, small(corpus_cache, "--memory-budget-gib", "0.05", "--try", "--rounds", "2"))
    assert lines[-1].startswith("verdict: memory: peak") and "model.recompute=full" in lines[-1]
    tried = next(line for line in lines if line.startswith("try --model.recompute=full: "))
    assert "over 2 interleaved rounds of 2 steps" in tried and "median" in tried


def test_bad_flags_are_one_line(capsys):
    assert diagnose_main(["--config", "configs/tiny.yaml", "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --steps and --rounds must be >= 1, --warmup >= 0"
