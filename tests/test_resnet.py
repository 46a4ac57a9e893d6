"""ResNet-50 v1.5 task: the ImageNet-format pipeline, the demo set, FLOPs, rules, and
sharded training on the 8 logical CPU devices of the pytest process.

Sharded runs use a ResNet-10 at a quarter of the widths on 32x32 images so that each
compile takes well under a minute on 2 cores.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from conftest import assert_golden_layouts, device_mesh, make_run
from tfpod import UserError, optimizers, partitioning
from tfpod.input import images
from tfpod.input.common import ShardInfo
from tfpod.api import run
from tfpod.mesh import make_mesh
from tfpod.models import resnet
from tfpod.controller import TrainConfig

TINY = dict(depth=10, depth_multiplier=0.25, image_size=32, num_classes=10)


def write_imagenet_tfrecord(path, labels, sizes):
    """Records with the standard ImageNet keys; each image a real JPEG of the given size."""
    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(path) as w:
        for label, (h, w_) in zip(labels, sizes):
            pixels = rng.integers(0, 256, size=(h, w_, 3), dtype=np.uint8)
            jpeg = tf.io.encode_jpeg(pixels).numpy()
            w.write(images.image_example(jpeg, label, h, w_).SerializeToString())


@pytest.mark.unit
def test_pipeline_reads_standard_imagenet_tfrecord(tmp_path):
    path = str(tmp_path / "train-00000-of-00001")
    labels = [1, 5, 10, 3, 7]  # 1-based, as Model Garden's ImageNet conversion writes them
    write_imagenet_tfrecord(path, labels, [(40, 60), (64, 48), (33, 33), (80, 50), (50, 70)])
    cfg = images.ImageDataConfig(train_files=path, eval_files=path, label_offset=1)
    train = images.image_dataset(cfg, path, 32, 10, host_rows=4, shard=ShardInfo(0, 1), seed=3, training=True)
    batches = [{k: v.numpy() for k, v in b.items()} for b in train.take(3)]
    first = batches[0]
    assert first["images"].shape == (4, 32, 32, 3) and first["images"].dtype == np.float32
    assert first["labels"].dtype == np.int32 and first["weights"].dtype == np.float32
    assert np.all(first["weights"] == 1.0)
    seen = np.concatenate([b["labels"] for b in batches])
    assert set(seen) <= {l - 1 for l in labels} and len(set(seen)) > 1
    assert abs(float(first["images"].mean())) < 3.0  # normalized by the ImageNet mean and stddev
    again = next(iter(images.image_dataset(cfg, path, 32, 10, 4, ShardInfo(0, 1), seed=3, training=True)))
    np.testing.assert_array_equal(again["images"].numpy(), first["images"])  # seeded: deterministic

    evals = list(images.image_dataset(cfg, path, 32, 10, host_rows=4, shard=ShardInfo(0, 1), seed=3, training=False))
    assert [int(b["labels"].shape[0]) for b in evals] == [4, 1]  # one pass, short last batch kept
    np.testing.assert_array_equal(np.concatenate([b["labels"].numpy() for b in evals]), np.array(labels) - 1)


@pytest.mark.unit
def test_label_out_of_range_names_label_offset(tmp_path):
    path = str(tmp_path / "bad.tfrecord")
    write_imagenet_tfrecord(path, [10], [(40, 40)])  # 10 classes, label 10 with no offset
    cfg = images.ImageDataConfig()
    ds = images.image_dataset(cfg, path, 32, 10, host_rows=1, shard=ShardInfo(0, 1), seed=0, training=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="label_offset"):
        next(iter(ds))


@pytest.mark.unit
def test_demo_set_is_prepared_in_imagenet_format():
    data_dir = images.ensure()
    manifest = json.load(open(os.path.join(data_dir, images.MANIFEST)))
    assert manifest["train_images"] + manifest["eval_images"] == 1797
    assert len(tf.io.gfile.glob(images.split_paths(data_dir, "train"))) == images.TRAIN_SHARDS
    assert len(tf.io.gfile.glob(images.split_paths(data_dir, "eval"))) == images.EVAL_SHARDS
    record = next(iter(tf.data.TFRecordDataset(tf.io.gfile.glob(images.split_paths(data_dir, "eval")))))
    ex = tf.train.Example.FromString(record.numpy()).features.feature
    assert ex["image/format"].bytes_list.value[0] == b"jpeg"
    image = tf.io.decode_jpeg(ex["image/encoded"].bytes_list.value[0])
    assert image.shape == (32, 32, 3) and 0 <= ex["image/class/label"].int64_list.value[0] < 10


@pytest.mark.unit
def test_resnet50_flops_and_rules_cover_every_variable():
    r50 = resnet.ResNetConfig()
    assert 4.0e9 < resnet.forward_macs(r50) < 4.2e9  # the published 4.1 GMACs at 224x224
    assert resnet.flops_per_token(r50) == 6 * resnet.forward_macs(r50)
    cfg = resnet.ResNetConfig(**TINY)
    specs = partitioning.variable_specs(lambda: resnet.TASK.build(cfg), resnet.input_signature(cfg))
    assert any(s.name.endswith("moving_mean") for s in specs)  # batch-norm statistics have rules too
    mesh = make_mesh("data:4,model:2")
    layouts = partitioning.resolve(specs, resnet.AXIS_RULES, partitioning.rules_table("tensor"), mesh)
    assert layouts["resnet/logits/kernel"].sharding_specs == ["unsharded", "model"]  # class-parallel
    assert all(l.is_fully_replicated() for n, l in layouts.items() if "logits" not in n)


@pytest.mark.unit
def test_config_errors_are_one_line(tmp_path):
    for param, needle in [("resnet.depth=7", "resnet.depth=7"), ("image_data.area_range=(0.5, 2.0)", "area_range")]:
        with pytest.raises(UserError, match=needle) as e:
            run(["gin/resnet50_tiny.gin"], [param], str(tmp_path / "bad"), mode="train_and_eval")
        assert "\n" not in str(e.value)


@pytest.mark.unit
def test_reference_config_is_the_mlperf_recipe():
    import gin

    from tfpod.config import parse_config

    parse_config(["gin/resnet50.gin"], [])
    q = gin.query_parameter
    assert (q("resnet.depth"), q("resnet.image_size"), q("resnet.label_smoothing")) == (50, 224, 0.1)
    assert (q("optimizer.name"), q("optimizer.decay"), q("optimizer.power")) == ("lars", "polynomial", 2.0)
    assert (q("train.precision"), q("train.target_metric"), q("train.target_value")) == \
        ("mixed_bfloat16", "top1_accuracy", 0.759)


def make(model_dir, spec, preset):
    cfg = resnet.ResNetConfig(**TINY)
    train = TrainConfig(steps=3, global_batch_size=16, steps_per_loop=3, log_every=3, checkpoint_every=3,
                        synthetic_data=True, seed=1)
    opt = optimizers.OptimizerConfig(name="lars", learning_rate=1.0, warmup_steps=0, decay_steps=8, clip_norm=0,
                                     weight_decay=5e-5, exclude_from_weight_decay=["batch_normalization", "bias"])
    return make_run(resnet.TASK, cfg, train, opt, spec, model_dir, preset=preset)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The losses of a run on one of the 8 devices, the reference of the sharded runs below."""
    return np.array(make(tmp_path_factory.mktemp("one"), device_mesh(), "data").train()["losses"])


def test_data4_model2_tensor_equals_one_device(tmp_path, one_device):
    """Batch norm reduces its moments over the whole batch-sharded tensor (sync batch
    norm), so the per-device batch (4 of 16 here) does not change the statistics: the
    losses match."""
    ref = one_device
    tensor = np.array(make(tmp_path / "tensor", "data:4,model:2", "tensor").train()["losses"])
    assert ref.shape == (3,) and ref[-1] < ref[0]
    assert np.max(np.abs(tensor - ref) / np.abs(ref)) < 1e-4, (tensor, ref)


def test_spatial_equals_one_device(tmp_path, one_device):
    """The `spatial` preset splits every image's rows over `model` (tfpod's halo exchange
    in every convolution and pooling; the 4x4 and smaller maps run with whole rows): the
    same losses as one device's run."""
    ref = one_device
    rows = np.array(make(tmp_path / "spatial", "data:2,model:4", "spatial").train()["losses"])
    assert np.max(np.abs(rows - ref) / np.abs(ref)) < 1e-4, (rows, ref)


def test_tiny_config_trains_and_evaluates(tmp_path):
    tf_keras.backend.clear_session()  # Keras's auto-names (conv2d_N, in the golden layouts) count layers made before
    model_dir = str(tmp_path / "run")
    overrides = ["resnet.depth=10", "train.steps=10", "train.steps_per_loop=5", "train.eval_every=10",
                 "train.log_every=5", "train.checkpoint_every=10", "optimizer.warmup_steps=2"]
    run(["gin/resnet50_tiny.gin"], overrides, model_dir, mode="train_and_eval", mesh_spec="data:8")
    records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and evals[-1]["step"] == 10 and evals[-1]["num_examples"] == 360
    assert 0.0 <= evals[-1]["top1_accuracy"] <= evals[-1]["top5_accuracy"] <= 1.0
    train = [r for r in records if r["kind"] == "train"]
    assert train and train[-1]["examples_per_sec"] > 0 and np.isfinite(train[-1]["loss"])
    assert_golden_layouts(open(os.path.join(model_dir, "layouts.txt")).read(), "resnet_data_data8")
