"""ResNet v1.5 image classifier (the MLPerf ResNet-50 benchmark) from tf-models-official.

The backbone is Model Garden's `official.vision.modeling.backbones.ResNet`: its
bottleneck block strides on the 3x3 convolution, which is ResNet v1.5 (MLPerf's
ResNet-50); `resnetd_shortcut` and `replace_stem_max_pool` stay off (those are
ResNet-D/RS). The head is global average pooling and a Dense layer over the classes.

Batch normalization: under DTensor a batch-sharded activation's moments are reduced
over the whole mesh, so the plain Keras layer is synchronized batch norm over the
global batch (the same statistics on any mesh); its moving averages are non-trainable
DVariables laid out by AXIS_RULES like the other weights.

Sharding: the `data` preset (the default) replicates every weight and splits the batch.
DTensor's convolution expander requires fully replicated filters, so convolutions
cannot be channel-parallel; `tensor` keeps them replicated and splits the output layer
over classes (`vocab` -> `model`). `spatial` splits each image's rows over `model`
(the MLPerf TPU-pod technique for large images): every convolution and pooling runs on
row blocks with tfpod's own halo exchange (tfpod.partitioning.spatial), batch norm
stays synchronized over the whole global batch, and the last stages, whose height no
longer divides into the row blocks, run with whole rows.

Batch contract (tfpod.input.images produces it):
  images   float32 [batch, image_size, image_size, 3]  normalized RGB
  labels   int32 [batch]  class in [0, num_classes)
  weights  float32 [batch]  1 for real images, 0 for padding
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
import tf_keras
from tfpod import UserError, evaluation, fused
from tfpod.input import images as images_lib
from tfpod.partitioning import AxisRule, shard, spatial
from tfpod.models import plan_profiles
from tfpod.task import LossTerms, Task


def _mg_resnet():
    """Model Garden's ResNet module, imported on first use: `official.vision` costs most of a
    second in every process that imports this module (the registry imports every model)."""
    from official.vision.modeling.backbones import resnet

    return resnet


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Shape of the classifier. Attributes map 1:1 to gin `resnet.<name>`.

    Attributes:
      depth: Model Garden ResNet model_id (10, 18, 26, 34, 50, 101, 152, 200, ...).
      depth_multiplier: scales every layer's filters (1.0: the paper's widths).
      image_size: side of the square input images.
      num_classes: classes of the output layer.
      label_smoothing: weight of the uniform distribution in the training targets.
      norm_momentum, norm_epsilon: batch normalization.
      init_stddev: stddev of the output layer's initializer (MLPerf: 0.01).
    """

    depth: int = 50
    depth_multiplier: float = 1.0
    image_size: int = 224
    num_classes: int = 1000
    label_smoothing: float = 0.1
    norm_momentum: float = 0.9
    norm_epsilon: float = 1e-5
    init_stddev: float = 0.01

    def __post_init__(self):
        mg_resnet = _mg_resnet()
        if self.depth not in mg_resnet.RESNET_SPECS:
            raise UserError(f"resnet.depth={self.depth} is not a Model Garden ResNet: use one of "
                            f"{', '.join(str(d) for d in sorted(mg_resnet.RESNET_SPECS))}")
        if self.depth_multiplier <= 0:
            raise UserError(f"resnet.depth_multiplier={self.depth_multiplier} must be positive")
        if self.image_size < 32:
            raise UserError(f"resnet.image_size={self.image_size} is below 32: the backbone downsamples 32x")
        if self.num_classes < 2:
            raise UserError(f"resnet.num_classes={self.num_classes} must be at least 2")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"resnet.label_smoothing={self.label_smoothing} must be in [0, 1)")


# Variable names are "<model>/<layer>/<weight>"; Model Garden names its layers
# conv2d_N and batch_normalization_N (Keras auto-names), so rules go by weight kind.
# DTensor's convolution expander requires a fully replicated filter ("Filter for
# convolution must have fully replicated layout"), so convolutions cannot be
# channel-parallel: their kernels and batch norms stay replicated under every preset,
# and `tensor` splits the output layer over classes (`vocab` -> `model`).
AXIS_RULES = (
    AxisRule(r".*conv2d(_\d+)?/kernel", (None, None, None, None)),  # [kh, kw, in, out]
    AxisRule(r".*batch_normalization(_\d+)?/(gamma|beta|moving_mean|moving_variance)", (None,)),
    AxisRule(r".*/logits/kernel", ("embed", "vocab")),  # [features, classes]
    AxisRule(r".*/logits/bias", ("vocab",)),
)


class ResNetClassifier(tf_keras.Model):
    """images [batch, H, W, 3] -> logits [batch, classes] (float32)."""

    def __init__(self, config: ResNetConfig, name: str = "resnet"):
        super().__init__(name=name)
        self.config = config
        self.backbone = _mg_resnet().ResNet(
            model_id=config.depth,
            input_specs=tf_keras.layers.InputSpec(shape=[None, config.image_size, config.image_size, 3]),
            depth_multiplier=config.depth_multiplier,
            resnetd_shortcut=False,
            replace_stem_max_pool=False,
            norm_momentum=config.norm_momentum,
            norm_epsilon=config.norm_epsilon,
            name="backbone",
        )
        # The backbone is a functional model, whose layers Keras tracks only under
        # `_self_tracked_trackables`, a path tf_keras's DTensor layout mapping skips;
        # listing them here gives each weight a path the mapping follows.
        self.backbone_layers = list(self.backbone.layers)
        # DTensor has no layout propagation for FusedBatchNormV3: batch norm trains
        # through fused.batch_norm (reductions DTensor all-reduces over the batch-sharded
        # mesh axis, and a hand-written gradient).
        fused.use_batch_norm(self.backbone)
        spatial.use_spatial_layers(self.backbone)  # convolutions and pooling split image rows (`spatial` preset)
        self.pool = tf_keras.layers.GlobalAveragePooling2D(name="pool")
        self.logits = tf_keras.layers.Dense(
            config.num_classes, kernel_initializer=tf_keras.initializers.RandomNormal(stddev=config.init_stddev),
            name="logits",
        )

    def call(self, inputs, training=None):
        images = inputs["images"] if isinstance(inputs, dict) else inputs
        x = spatial.split_rows(images)  # [batch, H, W, 3]: rows over `height` under the spatial preset
        levels = self.backbone(x, training=training)  # {"2".."5": [batch, H / 2^l, W / 2^l, channels]}
        x = levels[max(levels, key=int)]  # the last stage, [batch, H / 32, W / 32, channels]
        x = self.pool(x)  # [batch, channels]
        x = shard(x, ("batch", "embed"))
        logits = shard(self.logits(x), ("batch", "vocab"))  # [batch, classes], class-parallel under `tensor`
        return tf.cast(logits, tf.float32)


def input_signature(config: ResNetConfig) -> dict:
    return {"images": tf.TensorSpec([None, config.image_size, config.image_size, 3], tf.float32, name="images")}


MODEL_FEATURES = ("images",)


def model_inputs(batch: dict) -> dict:
    """The features the model reads."""
    return {k: batch[k] for k in MODEL_FEATURES}


def batch_axes() -> dict:
    """Logical axes of each batch feature (the input feed shards `batch`)."""
    return {
        "images": ("batch", None, None, None),
        "labels": ("batch",),
        "weights": ("batch",),
        # The trainer finds the batch's mesh axis from the feature named "inputs".
        "inputs": ("batch", None, None, None),
    }


def synthetic_batch(config: ResNetConfig, batch_size: int, rng: np.random.Generator) -> dict:
    """Random images of the experiment's shapes (train.synthetic_data=True).

    Each class has a fixed random mean image (seeded by the class) and the batch adds
    noise to it, so the loss has something to learn.
    """
    size = config.image_size
    labels = rng.integers(0, config.num_classes, size=batch_size).astype(np.int32)
    # the class's mean image: a 4x4 pattern upsampled, so it survives pooling
    patterns = np.stack([np.random.default_rng(int(c)).standard_normal((4, 4, 3)) for c in labels])
    reps = -(-size // 4)
    means = np.repeat(np.repeat(patterns, reps, axis=1), reps, axis=2)[:, :size, :size]
    noise = rng.standard_normal((batch_size, size, size, 3))
    return {
        "images": (means + noise).astype(np.float32),
        "labels": labels,
        "weights": np.ones(batch_size, np.float32),
    }


def loss_terms(model: ResNetClassifier, batch: dict, training: bool) -> LossTerms:
    """Label-smoothed softmax cross entropy: [its sum over weighted images], averaged over
    `loss_counts`. Weight decay is the optimizer's (LARS applies it), not part of the loss.

    Returns:
      LossTerms with metrics {"loss_sum", "weight_sum"} (float32 scalars).
    """
    logits = model(model_inputs(batch), training=training)  # [batch, classes]
    classes = logits.shape[-1]
    smoothing = model.config.label_smoothing if training else 0.0
    targets = tf.one_hot(batch["labels"], classes, dtype=logits.dtype)
    targets = targets * (1.0 - smoothing) + smoothing / classes  # [batch, classes]
    log_z = tf.reduce_logsumexp(logits, axis=-1)  # [batch]
    image_loss = log_z - tf.reduce_sum(targets * logits, axis=-1)  # [batch]
    weights = batch["weights"]
    loss_sum = tf.reduce_sum(image_loss * weights)
    return LossTerms([loss_sum], metrics={"loss_sum": loss_sum, "weight_sum": tf.reduce_sum(weights)})


def loss_counts(batch: dict) -> list:
    """The weighted images: what the image losses' sum is averaged over."""
    return [tf.reduce_sum(tf.cast(batch["weights"], tf.float32))]


def forward_macs(config: ResNetConfig) -> float:
    """Multiply-adds of one image's forward pass: convolutions and the output layer.

    Walks Model Garden's RESNET_SPECS as its ResNet builds them (stem 7x7/2 conv and
    3x3/2 max pool; every stage's first block has a projection shortcut; stages 3-5
    stride 2 on the first block, on the 3x3 conv of a bottleneck). Batch norm, ReLU,
    pooling and additions are left out (under 1% for ResNet-50).
    """
    dm = config.depth_multiplier
    size = config.image_size // 2  # after the stem conv
    stem = int(64 * dm)
    macs = 7 * 7 * 3 * stem * size * size
    size //= 2  # max pool
    channels = stem
    for i, (block, filters, repeats) in enumerate(_mg_resnet().RESNET_SPECS[config.depth]):
        f = int(filters * dm)
        for r in range(repeats):
            stride = 2 if (i > 0 and r == 0) else 1
            out_size = size // stride
            if block == "bottleneck":
                out = 4 * f
                macs += channels * f * size * size  # 1x1 reduce
                macs += 9 * f * f * out_size * out_size  # 3x3, strided (v1.5)
                macs += f * out * out_size * out_size  # 1x1 expand
            else:
                out = f
                macs += 9 * channels * f * out_size * out_size + 9 * f * f * out_size * out_size
            if r == 0:
                macs += channels * out * out_size * out_size  # projection shortcut
            channels, size = out, out_size
    return float(macs + channels * config.num_classes)


def flops_per_token(config: ResNetConfig) -> float:
    """Training FLOPs per image ("token" = image): 3 x forward (backward = 2 x forward),
    counting a multiply-add as 2 FLOPs. ResNet-50 at 224: 4.1 GMACs, 8.2 GFLOPs forward,
    24.6 GFLOPs trained per image."""
    return 3.0 * 2.0 * forward_macs(config)


def serving(model: ResNetClassifier, config: ResNetConfig, data_config) -> tuple[tf.Module, dict]:
    """The classifier's SavedModel signature (tfpod.export), on JPEG bytes.

    Each image is decoded and center-cropped as in evaluation (image_data.eval_crop_fraction
    of the shorter side, resized to image_size, normalized).

      serving_default(image_bytes string [batch]) ->
        classes int32 [batch, k], scores float32 [batch, k]  the k = min(5, num_classes)
          best classes (0-based, as trained: the file label minus image_data.label_offset)
          and their softmax probabilities, best first
        logits float32 [batch, num_classes]
    """
    k = min(5, config.num_classes)
    module = tf.Module()
    module.model = model

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")])
    def serving_default(jpegs):
        images = tf.map_fn(lambda jpeg: images_lib.eval_image(jpeg, data_config, config.image_size), jpegs,
                           fn_output_signature=tf.TensorSpec([config.image_size, config.image_size, 3], tf.float32))
        logits = model({"images": images}, training=False)  # [batch, classes]
        scores, classes = tf.math.top_k(tf.nn.softmax(logits), k=k)
        return {"classes": classes, "scores": scores, "logits": logits}

    return module, {"serving_default": serving_default.get_concrete_function()}


class ResNetTask(Task):
    """Image classification with ResNet (MLPerf ResNet-50 v1.5): gin `resnet.*`, data `image_data.*`."""

    name = "resnet"
    config_class = ResNetConfig
    data_name = "image_data"
    data_config_class = images_lib.ImageDataConfig
    default_preset = "data"
    axis_rules = AXIS_RULES
    eval_metric = evaluation.CLASSIFICATION
    splits_image_rows = True

    build = staticmethod(ResNetClassifier)
    input_signature = staticmethod(input_signature)
    flops_per_token = staticmethod(flops_per_token)
    batch_axes = staticmethod(batch_axes)
    model_inputs = staticmethod(model_inputs)
    synthetic_batch = staticmethod(synthetic_batch)
    make_input = staticmethod(images_lib.image_input)
    loss_terms = staticmethod(loss_terms)
    loss_counts = staticmethod(loss_counts)
    serving = staticmethod(serving)
    serves = True
    plan_profile = staticmethod(plan_profiles.conv)


TASK = ResNetTask()
