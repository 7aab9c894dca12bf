"""lightning_rec._planner.table: a plan as rows and a text table."""

from __future__ import annotations

from torchrec.distributed.types import (
    BoundsCheckMode,
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
    ShardMetadata,
)

from lightning_rec._planner.table import format_plan, format_rows, plan_rows


def _plan() -> ShardingPlan:
    shards = [ShardMetadata([0, 0], [5, 4], "rank:0/cpu"), ShardMetadata([5, 0], [5, 4], "rank:1/cpu")]
    return ShardingPlan(
        {
            "ebc": EmbeddingModuleShardingPlan(
                {
                    "user": ParameterSharding(
                        "row_wise",
                        "fused",
                        [0, 1],
                        EnumerableShardingSpec(shards),
                        bounds_check_mode=BoundsCheckMode.WARNING,
                    ),
                    "genre": ParameterSharding("data_parallel", "dense", None),
                }
            )
        }
    )


def test_each_table_becomes_a_row_with_its_shards_shape_and_settings() -> None:
    user, genre = plan_rows(_plan(), {"user": [10, 4]})
    assert (user.module, user.table, user.ranks, user.shard_ranks) == ("ebc", "user", [0, 1], [0, 1])
    assert user.shard_sizes == [[5, 4], [5, 4]] and user.shard_offsets == [[0, 0], [5, 0]] and user.shape == [10, 4]
    assert user.extras == {"bounds_check_mode": "WARNING"} and genre.shard_sizes == [] and genre.shape is None


def test_the_text_table_counts_equal_shards_and_says_replicated() -> None:
    text = format_plan(_plan(), world_size=2)
    assert text.splitlines()[0].split() == ["module", "table", "sharding", "ranks", "kernel", "shards"]
    assert "2x[5, 4]" in text and "all 2" in text and "replicated" in text
    assert "no embedding tables" in format_rows([], 2)
