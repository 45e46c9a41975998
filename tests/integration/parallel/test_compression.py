"""Compression hooks on 2 gloo processes: error feedback, bytes on the wire, the exchanged mean,
and a tiny MLP trained under DDP with each hook against uncompressed DDP."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from parallel.compression import OneBitCompressor, TopKCompressor
from tests.gloo import run_workers

SEGMENTS = [(0, 500), (1, 1), (2, 500)]  # 1001 entries in three "parameters" of uneven size
NUMEL = sum(n for _, n in SEGMENTS)
STEPS = 12
RATIO = 0.01


# ----------------------------------------------------------------------------- 2-process worker


def _grad(rank: int, step: int) -> torch.Tensor:
    # heavy-tailed so that top-k has a clear winner set; scaled per segment like real layers
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(NUMEL, generator=g) ** 3
    x[500:] *= 0.1
    return x


def _expected_topk(acc: torch.Tensor, k: int) -> torch.Tensor:
    kept = torch.zeros_like(acc)
    order = acc.abs().argsort(descending=True)[:k]
    kept[order] = acc[order]
    return kept


def _expected_onebit(acc: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(acc)
    start = 0
    for _, n in SEGMENTS:
        part = acc[start : start + n]
        scale = part.abs().mean()
        out[start : start + n] = torch.where(part >= 0, scale, -scale)
        start += n
    return out


class _CountingCollectives:
    """Wraps the all-gather entry points to count the bytes handed to them (independent of CommStats)."""

    def __init__(self) -> None:
        self.input_bytes: list[int] = []
        self._originals = {}

    def __enter__(self):
        for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce", "reduce_scatter_single"):
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original

            def counted(*args, _original=original, _name=name, **kwargs):
                tensor = args[1] if _name != "all_reduce" else args[0]
                self.input_bytes.append(tensor.numel() * tensor.element_size())
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _exchange_worker(rank: int, world: int, kind: str) -> dict[str, Any]:
    from parallel.comm import CommStats

    stats = CommStats()
    comp = TopKCompressor(RATIO, None, stats) if kind == "topk" else OneBitCompressor(None, stats)
    sum_true = torch.zeros(NUMEL)
    sum_received = torch.zeros(NUMEL)
    worst_mean_error, per_step, nonzeros = 0.0, [], []
    for step in range(STEPS):
        g = _grad(rank, step)
        previous = comp.feedback.residual_of(SEGMENTS)
        acc = g + (previous if previous is not None else 0)
        # reference: gather every rank's corrected gradient uncompressed and compress it here
        everyone = [torch.empty(NUMEL) for _ in range(world)]
        dist.all_gather(everyone, acc)
        if kind == "topk":
            expected = sum(_expected_topk(a, comp.k_for(NUMEL)) for a in everyone) / world
        else:
            expected = sum(_expected_onebit(a) for a in everyone) / world
        with _CountingCollectives() as counter:
            received = comp.all_reduce_mean(g.clone(), SEGMENTS)
        per_step.append((stats.pop_step(), counter.input_bytes))
        relative = (received - expected).abs().max() / expected.abs().max()
        worst_mean_error = max(worst_mean_error, relative.item())
        nonzeros.append(int((received != 0).sum()))
        sum_true += g
        sum_received += received
    return {
        "sum_true": sum_true,
        "sum_received": sum_received,
        "residual": comp.feedback.residual_of(SEGMENTS),
        "worst_mean_error": worst_mean_error,
        "per_step": per_step,
        "nonzeros": nonzeros,
    }


@pytest.fixture(params=["topk", "onebit"])
def exchange(request, two_rank_results) -> tuple[str, list[dict[str, Any]]]:
    return request.param, [r["exchange"][request.param] for r in two_rank_results]


@pytest.mark.timeout(180)
def test_error_feedback_conserves_the_gradient_sum(exchange):
    kind, results = exchange
    world = len(results)
    # what arrived (the mean of what was sent) times world, plus what is still held back,
    # equals every gradient every rank produced
    sent_total = results[0]["sum_received"] * world
    held_back = sum(r["residual"] for r in results)
    true_total = sum(r["sum_true"] for r in results)
    assert torch.allclose(sent_total + held_back, true_total, atol=1e-4, rtol=1e-5), kind
    assert torch.equal(results[0]["sum_received"], results[1]["sum_received"])  # all ranks agree


@pytest.mark.timeout(180)
def test_exchange_is_the_mean_of_the_compressed_gradients(exchange):
    kind, results = exchange
    for r in results:
        assert r["worst_mean_error"] < 1e-6, kind  # relative to the largest entry


@pytest.mark.timeout(180)
def test_bytes_on_the_wire(exchange):
    kind, results = exchange
    world = len(results)
    for r in results:
        for stats, handed in r["per_step"]:
            payload = sum(handed)  # bytes this rank gave to the collectives, counted independently
            assert stats["comm_bytes_sent"] == (world - 1) * payload  # ring all-gather
            dense = stats["comm_bytes_uncompressed"]
            assert dense == 2 * (world - 1) * NUMEL * 4 // world
            if kind == "topk":
                k = math.ceil(RATIO * NUMEL)
                assert payload == k * (8 + 4)  # int64 index + fp32 value
                assert stats["comm_bytes_sent"] <= 2 * k * (8 + 4)
            else:
                assert payload == math.ceil(NUMEL / 8) + 4 * len(SEGMENTS)  # packed signs + scales
                assert stats["comm_saving"] > 25
    if kind == "topk":
        k = math.ceil(RATIO * NUMEL)
        assert all(nz <= world * k for nz in results[0]["nonzeros"])


# ----------------------------------------------------------------------------- training under DDP
# (below the training worker: the single 2-process launch all tests here share; process start-up
# and first imports cost more than the work itself)


def _teacher_and_student() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    with torch.no_grad():
        teacher[0].weight.mul_(4)  # a function the student needs the whole run to fit
    torch.manual_seed(1)
    student = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    )
    return teacher, student


def _train_worker(rank: int, world: int, hooks: list[str], steps: int, bucket_cap_mb: float) -> dict[str, Any]:
    from parallel.compression import register_comm_hook
    from parallel.config import ParallelConfig

    results = {}
    for hook in hooks:
        teacher, student = _teacher_and_student()
        model = torch.nn.parallel.DistributedDataParallel(student, bucket_cap_mb=bucket_cap_mb)
        cfg = ParallelConfig(
            strategy="ddp", ddp_comm_hook=hook, topk_ratio=RATIO, powersgd_start_iter=2, powersgd_rank=2
        )
        stats = register_comm_hook(model, cfg, None)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = torch.Generator().manual_seed(100 + rank)
        x_eval = torch.randn(512, 16, generator=torch.Generator().manual_seed(7))
        y_eval = teacher(x_eval).detach()
        evals, step_stats = [], []
        for step in range(steps):
            x = torch.randn(32, 16, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
            step_stats.append(stats.pop_step() if stats else {})
            if step in (0, steps - 1):
                with torch.no_grad():
                    evals.append(torch.nn.functional.mse_loss(student(x_eval), y_eval).item())
        replicas = [torch.empty(1) for _ in range(world)]
        dist.all_gather(replicas, sum(p.sum() for p in student.parameters()).detach().reshape(1))
        results[hook] = {"evals": evals, "stats": step_stats, "replicas_agree": len({r.item() for r in replicas}) == 1}
    return results


def _all_worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "exchange": {kind: _exchange_worker(rank, world, kind) for kind in ("topk", "onebit")},
        "train": _train_worker(rank, world, ["none", "topk", "onebit", "bf16"], 200, 25.0),
        # several buckets on gloo is what deadlocked PyTorch's hook; ours finishes bucket i first
        "powersgd": _train_worker(rank, world, ["powersgd"], 40, 0.005)["powersgd"],
    }


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    return run_workers(_all_worker, 2)


@pytest.mark.timeout(180)
def test_topk_and_onebit_training_stays_close_to_uncompressed(two_rank_results):
    results = two_rank_results[0]["train"]
    first, final = results["none"]["evals"]
    assert final < 0.3 * first  # the run learns something to compare against
    for hook in ("topk", "onebit", "bf16"):
        r = results[hook]
        assert r["replicas_agree"], hook
        # stated margin: within 15% of uncompressed DDP's eval loss after 200 steps
        assert r["evals"][1] <= 1.15 * final, (hook, r["evals"][1], final)
    assert results["topk"]["stats"][-1]["comm_saving"] > 20
    assert results["bf16"]["stats"][-1]["comm_saving"] == 2.0


@pytest.mark.timeout(180)
def test_powersgd_from_config_with_several_buckets(two_rank_results):
    results = two_rank_results[0]["powersgd"]
    first, final = results["evals"]
    assert results["replicas_agree"]
    assert final < 0.5 * first
    dense_steps, compressed_steps = results["stats"][:2], results["stats"][2:]
    assert all(s["comm_saving"] == 1.0 for s in dense_steps)  # plain all-reduce before start_iter
    assert all(s["comm_saving"] > 1.5 for s in compressed_steps)
