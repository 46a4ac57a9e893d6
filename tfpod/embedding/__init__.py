"""Sharded embedding tables: lookups and sparse updates whose cost follows the ids, not the rows.

  layer     the Embedding layer (a table, looked up plainly or through the shards)
  sparse    a table's gradient as rows, de-duplication, the sparse optimizer kernels
  tables    a placed model's tables: each device's lookups and updates on its own shards
  whole     table-wise placement (sharding.tables='whole'): each table whole on the devices
            of one position of its axis, balanced by bytes
  homes     the one update's answers with tables (the norm over rows; rows handed out of the step)
  executor  the Trainer's executor for a model with tables (lookups, the step, the rows'
            update, run by the host); in the trainer's layer (it is an Executor), not imported here

docs/recommenders.md has the design, the traffic per step and what DTensor refused.
"""

from tfpod.embedding.layer import Embedding, TableLayer, lookup, padded_ids, pool
from tfpod.embedding.sparse import Rows, SparseRule, dedupe, rule_for, sparse_apply
from tfpod.embedding.tables import Tables, find_layers

__all__ = ["Embedding", "TableLayer", "lookup", "padded_ids", "pool", "Rows", "SparseRule", "dedupe", "rule_for", "sparse_apply",
           "Tables", "find_layers"]
