"""perfgpt models inside EleutherAI's lm-evaluation-harness: the ``perfgpt`` backend and task runs.

``PerfGPTLM`` answers the harness's three requests with a perfgpt ``GPT`` and the run's own
tokenizer (data/tokenizer.py, the byte tokenizer included):

- ``loglikelihood``: (context, continuation) pairs, in batches of similar length, right-padded
  (the model is causal, so padding after a sequence never changes its logits); the log
  probability of the continuation's tokens and whether each is the argmax. A pair longer than
  the model's context keeps its last ``max_seq_len + 1`` tokens, as the harness's ``hf``
  backend does.
- ``loglikelihood_rolling``: a whole text in disjoint windows of ``max_seq_len`` predicted tokens,
  each window with as much preceding context as fits, the first one after end-of-text
  (lm_eval.utils.get_rolling_token_windows): every token is predicted once.
- ``generate_until``: batched generation with the KV cache (model/generate.py), greedy unless a
  task asks for sampling (then seeded, never from the global RNG), cut at the first stop string.

Under ``torch.distributed`` each rank holds a whole model and the harness gives it a share of the
requests (its ``rank``/``world_size``), gathering the answers on rank 0.

``PerfGPTLM`` is registered in the harness as ``perfgpt`` when this module is imported, so
``lm_eval.simple_evaluate(model="perfgpt", model_args="checkpoint=runs/tiny")`` works in a process
that imported it. The harness's own command line resolves models from its source tree only (no
plugin or entry-point discovery in lm-eval 0.4.x): from a shell, ``python -m tools.evaluate
CHECKPOINT --tasks ...`` is the command.

This module imports the harness at its top: import it only when tasks are asked for
(``training.task_eval.import_lm_eval_backend`` says in one line how to install it when it is missing).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.evaluator import evaluate as harness_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table

from common.errors import ConfigError
from data.tokenizer import Tokenizer, build_model_tokenizer
from model.generate import Sampling, generate
from model.gpt import GPT
from training.model_io import load_source

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for tasks that do not set max_gen_toks
SAMPLING_SEED = 1234  # tasks that sample draw from a generator of their own, never the global RNG
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@register_model("perfgpt")
class PerfGPTLM(TemplateLM):
    """A perfgpt model as a harness ``LM``. Built from a checkpoint (``checkpoint=``, anything
    training/model_io.load_source reads) or, in-process, from a model and tokenizer."""

    def __init__(self, checkpoint: str | None = None, *, model: GPT | None = None, tokenizer: str | None = None,
                 eot_id: int | None = None, batch_size: int | str = 8, device: str | None = None,
                 dtype: str = "float32", max_gen_toks: int | str | None = None,
                 forward_context: Callable[[], contextlib.AbstractContextManager] | None = None, **ignored: Any):
        super().__init__()
        self._batch_size = _positive_int(batch_size, "batch_size")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not valid; choose one of: {', '.join(DTYPES)}")
        if model is None:
            if not checkpoint:
                raise ConfigError("the perfgpt harness model needs checkpoint=<run, checkpoint or export directory>")
            source = load_source(checkpoint)
            for line in source.warnings:  # e.g. a damaged newest checkpoint passed over
                logging.getLogger("perfgpt").warning(line)
            tokenizer = tokenizer or source.tokenizer
            if not tokenizer:
                raise ConfigError(f"{checkpoint} does not record its tokenizer; pass tokenizer=byte, "
                                  "tiktoken:<encoding> or hf:<tokenizer.json>")
            eot_id = source.eot_id if eot_id is None else eot_id
        elif not tokenizer:
            raise ConfigError("the perfgpt harness model needs the tokenizer its model was trained with")
        # Before the model is built: ids past its vocabulary would index outside the embedding table.
        self.tokenizer: Tokenizer = build_model_tokenizer(
            tokenizer, (source.cfg if model is None else model.cfg).vocab_size,
            "pass the run's own (--tokenizer, or tokenizer= in model_args)")
        if model is None:
            model = source.build(device or "cpu", DTYPES[dtype] if dtype != "float32" else None)
        self.model = model.eval()
        self.tokenizer_spec = tokenizer
        self._eot = int(self.tokenizer.eot_id if eot_id is None else eot_id)
        self._device = self.model.tok_emb.weight.device
        self._max_gen_toks = (_positive_int(max_gen_toks, "max_gen_toks") if max_gen_toks is not None
                              else min(DEFAULT_MAX_GEN_TOKS, self.max_length // 2))
        self._forward_context = forward_context or contextlib.nullcontext
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    # ----------------------------------------------------------------- what the harness reads

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_spec

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string).tolist()

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t != self._eot])

    def get_model_info(self) -> dict:
        return {"model_num_parameters": self.model.num_parameters(), "tokenizer": self.tokenizer_spec,
                "model_dtype": str(next(self.model.parameters()).dtype)}

    # Each rank holds a whole model; these are the collectives the harness gathers answers with.

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self._world_size)]
        dist.all_gather(parts, flat)
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()

    # ----------------------------------------------------------------- scoring

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(log P(continuation | context), continuation is the greedy choice) per request."""
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs context and continuation tokens")
            # The hf backend's rule: keep the last max_length + 1 tokens; the last is only predicted.
            rows.append(((context + continuation)[-(self.max_length + 1):][:-1], continuation))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths batch together
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self._batch_size):
            batch = [order[i] for i in range(start, min(start + self._batch_size, len(order)))]
            width = len(rows[batch[0]][0])
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
            with self._forward_context():
                logits = self.model(ids.to(self._device))
            logprobs = F.log_softmax(logits.float(), dim=-1)
            for r, i in enumerate(batch):
                inp, cont = rows[i]
                scored = logprobs[r, len(inp) - len(cont): len(inp)]  # the positions that predict cont
                target = torch.tensor(cont, device=scored.device)
                greedy = bool((scored.argmax(dim=-1) == target).all())
                out[i] = (float(scored.gather(1, target[:, None]).sum()), greedy)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, predicted))
                owners.append(n)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ----------------------------------------------------------------- generation

    @torch.no_grad()
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}  # requests with the same generation settings batch together
        for n, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(n)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until, max_new, sampling = self._generation_settings(kwargs)
            limit = self.max_length - max_new
            if limit < 1:
                raise ConfigError(f"a task asks for max_gen_toks={max_new}, which leaves no room for its prompt in "
                                  f"model.max_seq_len={self.max_length}")
            prompts = {n: (self.tok_encode(requests[n].args[0]) or [self.prefix_token_id])[-limit:] for n in members}
            ordered = sorted(members, key=lambda n: -len(prompts[n]))
            for start in range(0, len(ordered), self._batch_size):
                batch = ordered[start:start + self._batch_size]
                with self._forward_context():
                    tokens = generate(self.model, [prompts[n] for n in batch], max_new, sampling, eos_id=self._eot,
                                      stop_when=self._stop_check(until))
                for n, row in zip(batch, tokens):
                    out[n] = cut_at_stop(self.tok_decode(row), until)
                    self.cache_hook.add_partial("generate_until", requests[n].args, out[n])
        return out  # type: ignore[return-value]

    def _stop_check(self, until: list[str]) -> Callable[[list[int]], bool] | None:
        """Whether a row's text so far holds a stop string: generating further would only be cut."""
        stops = [stop for stop in until if stop]
        if not stops:
            return None
        return lambda tokens: any(stop in self.tok_decode(tokens) for stop in stops)

    def _generation_settings(self, kwargs: dict) -> tuple[list[str], int, Sampling]:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = _positive_int(kwargs.pop("max_gen_toks", self._max_gen_toks), "max_gen_toks")
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        if not do_sample or temperature == 0.0:
            return until, max_new, Sampling(temperature=0.0)
        return until, max_new, Sampling(temperature=temperature, top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"),
                                        seed=SAMPLING_SEED)


def cut_at_stop(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string (the harness's rule)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def _positive_int(value: Any, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return number


# --------------------------------------------------------------------------- tasks


def load_tasks(names: list[str], task_dir: str | Path | None = None) -> dict:
    """The harness's task dictionary for ``names`` (task or group names, or task YAML paths),
    looked up in ``task_dir`` first. Unknown names and task files that do not parse are one
    ``ConfigError`` line. The harness's own ~12,000 task files are indexed only when a name is
    not among ``task_dir``'s (which takes seconds)."""
    if not names:
        raise ConfigError("no harness tasks given")
    include = None
    if task_dir:
        include = str(task_dir)
        if not Path(include).is_dir():
            raise ConfigError(f"task directory {include} does not exist")
    broken = _unparsable_task_files([Path(n) for n in names if n.endswith((".yaml", ".yml"))])
    if broken:
        raise ConfigError(f"harness task file {broken[0]}")
    manager = TaskManager(include_path=include, include_defaults=False) if include else None
    if manager is None or not all(_known(manager, name) for name in names):
        manager = TaskManager(include_path=include)
    unknown = [name for name in names if not _known(manager, name)]
    if unknown:
        broken = _unparsable_task_files(sorted(Path(include).rglob("*.yaml"))) if include else []
        hint = (f"; {broken[0]}" if broken else
                "; list the harness's tasks with: lm_eval ls tasks" + (f" --include_path {include}" if include else ""))
        raise ConfigError(f"unknown harness task {unknown[0]!r}{hint}")
    try:
        return manager.load(list(names))
    except Exception as exc:  # noqa: BLE001 -- the harness and `datasets` raise many kinds for a task they cannot load
        first = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"harness tasks {', '.join(names)} cannot be loaded: {first}") from None


def _known(manager: TaskManager, name: str) -> bool:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return not _unparsable_task_files([path])
    return name in manager.task_index


def _unparsable_task_files(paths: list[Path]) -> list[str]:
    """'<file> does not parse: <why>' for each of ``paths`` the harness's YAML reader rejects."""
    from lm_eval.tasks._yaml_loader import load_yaml

    broken = []
    for path in paths:
        try:
            load_yaml(path, resolve_func=False)
        except FileNotFoundError:
            broken.append(f"{path} does not exist")
        except Exception as exc:  # noqa: BLE001 -- yaml's error types, and the harness's own
            why = " ".join(str(exc).split())[:200]
            broken.append(f"{path} does not parse: {why}")
    return broken


def run_tasks(lm: PerfGPTLM, tasks: dict, *, limit: int | None = None, num_fewshot: int | None = None,
              bootstrap_iters: int = 100_000, log_samples: bool = False, fewshot_seed: int = 1234) -> dict | None:
    """Evaluate ``lm`` on ``tasks`` (from ``load_tasks``); the harness's results dict on rank 0,
    None on the other ranks. Seeds nothing global: few-shot examples come from the tasks' own
    seeded samplers."""
    for task in tasks["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=fewshot_seed)
    with _quiet_harness():
        return harness_evaluate(lm=lm, task_dict=tasks, limit=limit, bootstrap_iters=bootstrap_iters,
                                log_samples=log_samples, verbosity="WARNING")


@contextlib.contextmanager
def _quiet_harness():
    """The harness logs every request phase at INFO; a training log wants only its warnings."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def scores(results: dict) -> dict[str, float]:
    """``{'<task>/<metric>': value}`` for every task's metrics (stderr left out; a filter other
    than the default ``none`` is kept in the name)."""
    flat = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            flat[f"{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(value)
    return flat


def results_table(results: dict) -> str:
    """The harness's own Markdown table of the results."""
    return make_table(results)
