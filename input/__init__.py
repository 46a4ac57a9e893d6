"""tfpod.input: each host's tf.data pipeline, and the feed of its batches to the mesh.

  prepare   the default corpus (Python stdlib source) -> TFRecord shards + SentencePiece
  files     host_files: this host's balanced part of the files
  text      tokenization (tensorflow-text), packing, MLM masking: the data contract
  pipeline  files -> tokens -> packed host batches, for the LM
  feed      host batch -> batch-sharded DTensor over the global mesh
  mesh_dataset  to_mesh: a tf.data.Dataset of global batches -> batch-sharded DTensors
            for Keras fit (imported on first use: it loads TensorFlow)
"""

from tfpod.input.files import host_files

__all__ = ["host_files", "to_mesh"]


def __getattr__(name):
    if name == "to_mesh":
        from tfpod.input.mesh_dataset import to_mesh

        return to_mesh
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
