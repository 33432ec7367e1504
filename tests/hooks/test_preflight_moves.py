"""`Moves.rounded_gains` batches the candidate steps on an accelerator (a chunk of steps per launch) and loops
over them on the CPU: both ways give the same predicted changes bit for bit, whatever the chunk."""

from __future__ import annotations

import pytest
import torch
from preflight_wild import grade

from maingrad.hooks.preflight import moves
from maingrad.hooks.preflight.measure import SUBSET

CASES = [
    ("megatron-gpt-bf16", 53),
    ("megatron-gpt-untied", 53),
    ("mixed-bf16-fp32", 30),
    ("grouped-moe-bf16", 54),
    ("llama-gqa-bf16", 31),
    ("lstm", 30),
]


@pytest.mark.parametrize(("name", "seed"), CASES)
def test_batched_steps_give_the_loop_s_gains(name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    looped = moves.Moves.rounded_gains
    seen: list[int] = []

    def both(self: moves.Moves, groups: list[list[int]]) -> tuple[list[list[float]], dict[int, list[float]]]:
        monkeypatch.setattr(moves, "BATCH_STEPS_ON_CPU", False)
        one = looped(self, groups)
        monkeypatch.setattr(moves, "BATCH_STEPS_ON_CPU", True)
        for chunk in (moves.STEPS_CHUNK, 5 * SUBSET * 64):  # all steps in one chunk; chunks of 5 and a rest
            monkeypatch.setattr(moves, "STEPS_CHUNK", chunk)
            assert looped(self, groups) == one
        seen.append(len(one[1]))
        return one

    monkeypatch.setattr(moves.Moves, "rounded_gains", both)
    grade(name, seed, None)
    assert seen and all(n > 0 for n in seen)
