"""Streaming data: an iterable data set over shards, each sample once per epoch over all ranks
and DataLoader workers, resumable at any world size; and token-weighted losses.

See docs/streaming.md for the design and its guarantees.
"""

from .dataset import StreamingDataset
from .order import Layout, global_order
from .sources import (
    JsonlShard,
    NpyShard,
    ShardReader,
    TokenBinShard,
    TokenFiles,
    write_token_shards,
)
from .tokens import token_loss_scale

__all__ = [
    "JsonlShard",
    "Layout",
    "NpyShard",
    "ShardReader",
    "StreamingDataset",
    "TokenBinShard",
    "TokenFiles",
    "global_order",
    "token_loss_scale",
    "write_token_shards",
]
