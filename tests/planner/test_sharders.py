"""lightning_rec._planner.sharders: a sharder per table module, each with the fused optimizer."""

from __future__ import annotations

import pytest
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from lightning_rec._planner.sharders import EBCSharder, make_sharders, qcomms_registry
from lightning_rec.config import EmbeddingOptimizer


def test_every_table_module_gets_a_sharder_with_the_fused_optimizer() -> None:
    fused = EmbeddingOptimizer("adagrad", lr=0.1).to_fused_params()
    sharders = {s.module_type: s for s in make_sharders(fused)}
    assert len(sharders) == 5
    assert isinstance(sharders[EmbeddingBagCollection], EBCSharder)
    assert sharders[EmbeddingCollection].fused_params["optimizer"] == EmbOptimType.EXACT_ADAGRAD
    assert "row_wise" in EBCSharder().sharding_types("cpu"), "row-wise on CPU too"
    assert qcomms_registry(None) is None


def test_an_extra_sharder_replaces_the_built_in_one_and_a_conflicting_optimizer_is_refused() -> None:
    fused = EmbeddingOptimizer("sgd", lr=0.1).to_fused_params()
    mine = EmbeddingBagCollectionSharder(fused_params={"stochastic_rounding": False})
    ebc = next(s for s in make_sharders(fused, [mine]) if s.module_type is EmbeddingBagCollection)
    assert (
        isinstance(ebc, EBCSharder)
        and ebc.fused_params["stochastic_rounding"] is False
        and ebc.fused_params["learning_rate"] == 0.1
    )
    assert mine.fused_params == {"stochastic_rounding": False}, "the user's sharder is left as it was"
    clash = EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.5})
    with pytest.raises(ValueError, match=r"learning_rate=0.5 in its fused_params.*learning_rate=0.1"):
        make_sharders(fused, [clash], owner="Me")
