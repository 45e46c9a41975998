"""A DeepSeek-shaped model against its dense twin, with and without multi-token prediction: the
library behind ``tools/bench_deepseek.py``.

The variants share everything but the MLP and the extra prediction modules: the same attention
(latent attention in configs/tiny-mla.yaml), data, seeds, steps and schedule.

- ``moe``: the job's model as configured (routed and shared experts), without MTP;
- ``moe-mtp``: the same with ``model.mtp_depth`` modules whose loss is added with
  ``model.mtp_loss_weight``;
- ``dense-twin``: ``analysis.moe_bench.dense_twin``, one dense MLP in every layer as wide as a
  token's experts together, so the same active parameters but the routers';
- ``dense-twin-mtp``: the twin with the same MTP modules.

Loss: each variant trains through train.py at every seed (``analysis/training_runs.py``); the
number compared is the final validation loss, which is the next-token loss alone in every
variant (the MTP modules run in training only), so the MTP variants are judged by what they
predict, not by their training objective. Each variant's loss is also paired by seed with the
dense twin's (same data order, same seed): the difference's median and min-max.

Time: a whole training step of each variant in one process, interleaved rounds; tokens/s at the
median step, and the speed relative to the dense twin round by round (median, min-max).
"""

from __future__ import annotations

import dataclasses
import json

from analysis.moe_bench import dense_twin
from analysis.training_runs import Curve, Run, final_summary
from common.measure import speedup, summarize
from model.config import ModelConfig
from model.flops import count_parameters

BASELINE = "dense-twin"


def variant_models(cfg: ModelConfig, mtp_depth: int, mtp_weight: float) -> dict[str, ModelConfig]:
    """The four models compared, by name (``cfg`` must be a MoE model; dense_twin says which)."""
    moe = dataclasses.replace(cfg, mtp_depth=0)
    twin = dense_twin(moe)
    mtp = {"mtp_depth": mtp_depth, "mtp_loss_weight": mtp_weight}
    return {"moe": moe, "moe-mtp": dataclasses.replace(moe, **mtp), BASELINE: twin,
            f"{BASELINE}-mtp": dataclasses.replace(twin, **mtp)}


def config_overrides(base, variant, prefix: str = "model") -> tuple[str, ...]:
    """The --section.key=value arguments that turn config ``base`` into ``variant`` (same dataclass):
    one per differing leaf, its value written as JSON (which YAML reads back as the same value)."""
    out: list[str] = []
    for f in dataclasses.fields(base):
        a, b = getattr(base, f.name), getattr(variant, f.name)
        if dataclasses.is_dataclass(a):
            out += config_overrides(a, b, f"{prefix}.{f.name}")
        elif a != b:
            out.append(f"--{prefix}.{f.name}={json.dumps(b)}")
    return tuple(out)


def variant_runs(base: ModelConfig, models: dict[str, ModelConfig], seeds: list[int], steps: int) -> list[Run]:
    """Every variant at every seed, seed by seed (a stopped measurement has whole seeds done)."""
    return [Run(name, seed, steps, config_overrides(base, model)) for seed in seeds for name, model in models.items()]


def paired_difference(curves: list[Curve], baseline: list[Curve]) -> dict:
    """Final validation loss minus the baseline's at the same seed: median, min, max over the seeds."""
    base = {c.run.seed: c.final_val for c in baseline}
    s = summarize([c.final_val - base[c.run.seed] for c in curves])
    return {"median": s.median, "min": s.min, "max": s.max, "n": s.n}


def summary_rows(models: dict[str, ModelConfig], curves: dict[Run, Curve], step_s: dict[str, list[float]],
                 tokens_per_step: int) -> list[dict]:
    """One row per variant: parameters, final validation loss over seeds and paired against the dense
    twin, the last logged MTP loss, and the step time, tokens/s and speed against the twin."""
    by_variant = {name: sorted((c for r, c in curves.items() if r.variant == name), key=lambda c: c.run.seed)
                  for name in models}
    rows = []
    for name, model in models.items():
        runs, time = by_variant[name], summarize(step_s[name])
        mtp = [c.mtp[max(c.mtp)] for c in runs if c.mtp]
        vs = speedup(step_s[name], step_s[BASELINE])
        rows.append({"variant": name, "total_params": count_parameters(model),
                     "active_params": count_parameters(model, active=True), "mtp_depth": model.mtp_depth,
                     "final_val_loss": final_summary(runs),
                     "val_loss_vs_dense_twin": paired_difference(runs, by_variant[BASELINE]),
                     "last_mtp_loss": summarize(mtp).median if mtp else None,
                     "step_ms": {"median": time.median * 1e3, "min": time.min * 1e3, "max": time.max * 1e3},
                     "tokens_per_s": tokens_per_step / time.median,
                     "speed_vs_dense_twin": {"median": vs.median, "min": vs.min, "max": vs.max, "n": vs.n}})
    return rows


TABLE_HEADERS = ["variant", "params", "active", "final val loss median (min-max)", "vs dense twin, paired by seed",
                 "last mtp loss", "ms/step median (min-max)", "tokens/s", "speed vs dense twin"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    def spread(s: dict, digits: int = 4, sign: str = "") -> str:
        return f"{s['median']:{sign}.{digits}f} ({s['min']:{sign}.{digits}f} to {s['max']:{sign}.{digits}f})"

    return [[r["variant"], f"{r['total_params'] / 1e6:.2f}M", f"{r['active_params'] / 1e6:.3f}M",
             spread(r["final_val_loss"]) + f" n={r['final_val_loss']['n']}",
             "-" if r["variant"] == BASELINE else spread(r["val_loss_vs_dense_twin"], sign="+"),
             "-" if r["last_mtp_loss"] is None else f"{r['last_mtp_loss']:.4f}",
             f"{r['step_ms']['median']:.0f} ({r['step_ms']['min']:.0f}-{r['step_ms']['max']:.0f})",
             f"{r['tokens_per_s']:,.0f}",
             "1" if r["variant"] == BASELINE else (f"{r['speed_vs_dense_twin']['median']:.2f}x "
                                                    f"({r['speed_vs_dense_twin']['min']:.2f}-"
                                                    f"{r['speed_vs_dense_twin']['max']:.2f})")]
            for r in rows]
