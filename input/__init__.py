"""tfpod.input: each host's tf.data pipeline, and the feed of its batches to the mesh.

  prepare   the default corpus (Python stdlib source) -> TFRecord shards + SentencePiece
  files     host_files: this host's balanced part of the files
  text      tokenization (tensorflow-text), packing, MLM masking: the data contract
  pipeline  files -> tokens -> packed host batches, for the LM
  feed      host batch -> batch-sharded DTensor over the global mesh
"""

from tfpod.input.files import host_files

__all__ = ["host_files"]
