"""One table of facts per fused embedding optimizer (``lightning_rec.config._OPTIMIZER_FACTS``, issue 37), checked
against what it describes: every name the config accepts has one; the torch equivalent a table on a non-fused
kernel gets is that class, and its state after a step carries the names checkpoint conversion maps the fused state
to; the CPU list is FBGEMM's."""

from __future__ import annotations

import typing

import pytest
import torch

from lightning_rec.config import _OPTIMIZER_FACTS, EmbeddingOptimizer, OptimizerName, supported_optimizers


def test_every_optimizer_name_has_its_facts_and_the_cpu_list_follows_them():
    assert set(typing.get_args(OptimizerName)) == set(_OPTIMIZER_FACTS)
    assert supported_optimizers("cpu") == tuple(n for n, f in _OPTIMIZER_FACTS.items() if f.cpu)
    assert supported_optimizers("cuda") == tuple(_OPTIMIZER_FACTS)


@pytest.mark.parametrize("name", sorted(_OPTIMIZER_FACTS))
def test_the_torch_equivalent_and_its_state_names_are_what_the_facts_say(name):
    facts = _OPTIMIZER_FACTS[name]
    weight = torch.nn.Parameter(torch.randn(4, 3))
    if facts.torch_equivalent is None:
        with pytest.raises(ValueError, match="exists only as a fused kernel"):
            EmbeddingOptimizer(name).torch_optimizer([weight])
        return
    optimizer = EmbeddingOptimizer(name).torch_optimizer([weight])
    assert type(optimizer).__name__ == facts.torch_equivalent
    weight.sum().backward()
    optimizer.step()
    assert {torch_name for _, torch_name in facts.state_names} <= set(optimizer.state[weight]), optimizer.state[weight]
