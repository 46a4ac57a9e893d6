"""Sharded embedding tables: lookups and sparse updates whose cost follows the ids, not the rows.

  layer     the Embedding layer (a table, looked up plainly or through the shards)
  sparse    a table's gradient as rows, de-duplication, the sparse optimizer kernels
  tables    a placed model's tables: each device's lookups and updates on its own shards
  training  the step with tables: the sparse update's norm, clipping and guard; the host loop

docs/recommenders.md has the design, the traffic per step and what DTensor refused.
"""

from tfpod.embedding.layer import Embedding, TableLayer, lookup, padded_ids, pool
from tfpod.embedding.sparse import Rows, SparseRule, dedupe, rule_for, sparse_apply
from tfpod.embedding.tables import Tables, dense_weights, find_layers
from tfpod.embedding.training import make_train_loop, sparse_step, with_rows

__all__ = ["Embedding", "TableLayer", "lookup", "padded_ids", "pool", "Rows", "SparseRule", "dedupe", "rule_for", "sparse_apply",
           "Tables", "dense_weights", "find_layers", "make_train_loop", "sparse_step", "with_rows"]
