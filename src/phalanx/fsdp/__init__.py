"""Fully sharded data parallel: ``fully_shard``, torch's FSDP2 API.

``collectives.py``
    The unit's all-gather and reduce-scatter, issued through the ledger; the flat layout.
"""
