from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]
