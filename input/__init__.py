"""tfpod.input: each host's tf.data pipeline, and the feed of its batches to the mesh.

  common    what every task's input shares: ShardInfo, TaskInput, host_shard, checks
  records   one host's record pipeline: the skeleton every task's input plugs into
  files     host_files: this host's balanced part of the files
  demo      demo data sets, prepared on first use and cached
  prepare   the default corpus (Python stdlib source) -> TFRecord shards + SentencePiece
  text      tokenization (tensorflow-text), packing, MLM masking: the data contract
  lm_data, bert_data, translation, images, detection
            each task's input: its data config and its TaskInput
  coco      COCO images + instances JSON -> Model Garden detection TFRecords (a command line)
  boxes     SSD default boxes, IoU, box encoding and decoding (the input and the model share them)
  detection_demo  the demo detection set (shapes in 3 categories, written as COCO data)
  mesh_dataset  to_mesh: a tf.data.Dataset of global batches -> batch-sharded DTensors
            for Keras fit (imported on first use: it loads TensorFlow)

Host batches reach the mesh through tfpod.feeding and tfpod.partitioning.Placement.
"""

from tfpod.input.files import host_files

__all__ = ["host_files", "to_mesh"]


def __getattr__(name):
    if name == "to_mesh":
        from tfpod.input.mesh_dataset import to_mesh

        return to_mesh
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
