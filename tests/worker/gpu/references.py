"""What the GPU's numbers are compared with: the same model on the CPU in fp32 (the package's docstring says why
only prompts with safe margins), and the helpers that drive an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.engine.executor import StepRows
from worker.model.llama import Llama

if TYPE_CHECKING:
    from worker.engine import Engine

MODEL = "random:smollm2-135m"
CONTEXT = 1024
TOKENS = 8  # greedy tokens per reference
SAFE_MARGIN = 0.06
CANDIDATES = 48  # random prompts tried, 8 at a time, until 8 have safe margins


@dataclass(frozen=True)
class Reference:
    prompt: list[int]
    tokens: list[int]  # CPU fp32 greedy continuation
    margins: list[float]  # CPU top-1 minus top-2 logit at each generated token


def cpu_greedy(engine: object, prompts: list[list[int]], n: int) -> list[Reference]:
    """Greedy continuations of all prompts at once through the CPU engine's executor, with margins."""
    from worker.engine import Engine

    assert isinstance(engine, Engine)
    table, executor = engine.table, engine.executor
    slots = [table.create(len(p) + n) for p in prompts]  # backed for every position the rows reach
    try:
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        last: list[int] = []
        for slot, prompt in zip(slots, prompts, strict=True):
            tokens += prompt
            positions += range(len(prompt))
            rows += [slot] * len(prompt)
            last.append(len(tokens) - 1)
        logits = executor.execute(StepRows(tokens, positions, rows, last))
        out: list[list[int]] = [[] for _ in prompts]
        margins: list[list[float]] = [[] for _ in prompts]
        for step in range(n):
            top = logits.topk(2, dim=-1)
            for i in range(len(prompts)):
                out[i].append(int(top.indices[i, 0]))
                margins[i].append(float(top.values[i, 0] - top.values[i, 1]))
            if step < n - 1:
                steps = [len(p) + step for p in prompts]
                logits = executor.execute(StepRows([o[-1] for o in out], steps, slots, list(range(len(prompts)))))
    finally:
        for slot in slots:
            table.free(slot)
    return [Reference(p, o, m) for p, o, m in zip(prompts, out, margins, strict=True)]


def tiny_llama(max_context: int) -> Llama:
    from worker.model.loader import load_model

    loaded = load_model("random:tiny")
    return Llama(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, max_context)


def open_with(engine: object, prompt: list[int]) -> str:
    from worker.engine import Engine

    assert isinstance(engine, Engine)
    sid = engine.create_session()
    engine.append(sid, token_ids=prompt)
    return sid


def greedy(n: int) -> dict[str, object]:
    return {"max_tokens": n, "ignore_eos": True}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


def teacher_forced(cpu: Engine, gpu: Engine, prompt: list[int], tokens: list[int],
                   chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPU's and the CPU's logits (on the CPU, a row for the prompt's last position and one for each token) with
    the sequence forced: on the CPU in one step, on the GPU the prompt in prefill replays of `chunk` tokens (all of
    it in one when None), then every token a decode step (a graph). Each engine's slot is freed after."""
    seq, n = prompt + tokens, len(prompt)
    cpu_slot = cpu.table.create(cpu.max_context)
    expected = cpu.executor.execute(StepRows(seq, list(range(len(seq))), [cpu_slot] * len(seq),
                                             list(range(n - 1, len(seq)))))
    cpu.table.free(cpu_slot)
    slot = gpu.table.create(gpu.max_context)
    try:
        step = chunk or n
        for start in range(0, n, step):
            part = prompt[start : start + step]
            first = gpu.executor.execute(StepRows(part, list(range(start, start + len(part))), [slot] * len(part),
                                                  [len(part) - 1]))
        rows = [first]
        for i, token in enumerate(tokens):
            rows.append(gpu.executor.execute(StepRows([token], [n + i], [slot], [0])))
        got = torch.cat(rows).cpu()
    finally:
        gpu.table.free(slot)
    return got, expected
