"""Reasoning token budgets (vLLM's thinking_token_budget, llama.cpp's --reasoning-budget): after
N tokens inside the block its end is forced token by token, counted from the output's start
marker or from the first token; a block that ends by itself is left alone; the count survives a
preemption; and through the engine, on a tiny model, the output is the free output up to the
budget, then the end tokens."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.outputs import NewRequestData, SchedulerOutput
from tandem.core.sampling_params import ThinkingBudget
from tandem.executor.thinking_budget import ThinkingBudgets

START, END = (7,), (8, 9)


def budgets_for(budget: ThinkingBudget, output: list[int] = ()) -> ThinkingBudgets:
    params = SamplingParams(thinking_budget=budget)
    new = NewRequestData("r", [1, 2], list(output), params, [], 0)
    budgets = ThinkingBudgets()
    budgets.update(SchedulerOutput(scheduled_new_reqs=[new]))
    return budgets


def run(budgets: ThinkingBudgets, tokens: list[int]) -> list[int | None]:
    """Each step's forced token (None: free), feeding `tokens` where nothing is forced."""
    forced, free = [], iter(tokens)
    for _ in range(len(tokens)):
        logits = torch.zeros(1, 16)
        budgets.apply(logits, ["r"])
        allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
        token = allowed[0] if len(allowed) == 1 else next(free)
        forced.append(token if len(allowed) == 1 else None)
        budgets.accept("r", token)
    return forced


def test_the_end_is_forced_after_the_budget_from_the_start_marker():
    forced = run(budgets_for(ThinkingBudget(2, START, END)), [1, 7, 3, 4, 5, 6, 7, 3])
    assert forced == [None, None, None, None, 8, 9, None, None]  # once: the block ended


def test_an_opened_block_counts_from_the_first_token_and_0_forces_at_once():
    assert run(budgets_for(ThinkingBudget(1, (), END)), [3, 4, 5, 6]) == [None, 8, 9, None]
    assert run(budgets_for(ThinkingBudget(0, (), END)), [3, 4, 5]) == [8, 9, None]


def test_a_block_that_ends_by_itself_is_left_alone():
    forced = run(budgets_for(ThinkingBudget(3, START, END)), [7, 3, 8, 9, 4, 5, 6, 2])
    assert forced == [None] * 8


def test_the_count_survives_a_preemption():
    budgets = budgets_for(ThinkingBudget(2, START, END), output=[7, 3, 4, 8])
    assert run(budgets, [5, 6]) == [9, None]


def test_a_budgeted_request_has_no_drafts():
    assert not SamplingParams(thinking_budget=ThinkingBudget(2, START, END)).drafts
    with pytest.raises(ValueError):
        ThinkingBudget(-1, START, END)
    with pytest.raises(ValueError):
        ThinkingBudget(1, START, ())


def test_the_engine_forces_the_end_on_a_tiny_model(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 22)
    prompt = [5, 9, 301, 44, 17]

    def greedy(budget: ThinkingBudget | None) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        params.thinking_budget = budget
        return llm.generate([prompt], params)[0].outputs[0].token_ids

    free = greedy(None)
    end = tuple(t for t in range(2, 40) if t not in free)[:2]
    assert greedy(ThinkingBudget(3, (), end))[:5] == [*free[:3], *end]
    assert greedy(ThinkingBudget(2, (free[1],), end))[:6] == [*free[:4], *end]
