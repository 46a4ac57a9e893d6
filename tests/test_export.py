"""SavedModel export for TF Serving: each task's checkpoint (LM, BERT, ResNet, Transformer),
trained with its weights split over `model` (2 of the 8 logical devices: MESH), exported
as a plain single-device SavedModel; `saved_model_cli` lists its signatures; a fresh
process with only tensorflow and tensorflow_text loads it and gives the outputs of the
sharded training-time model (relative 1e-5), on raw inputs and (LM, BERT) on token ids;
a TF Serving PredictRequest for each signature has exactly the inputs it declares. Without
a vocabulary the LM and BERT export `ids` alone as serving_default; MoE serves whole
sequences."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, export, optimizers
from tfpod.input import bert_data, images, lm_data, prepare, text
from tfpod.api import run
from tfpod.models import bert, gpt, moe, resnet, transformer
from tfpod.controller import TrainConfig
from conftest import device_mesh, make_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "data:1,model:2"  # weights split over `model` as tensor parallelism lays them out

# The fresh process: loads every export with only tensorflow and tensorflow_text, runs each
# signature on the given inputs, and saves the outputs.
LOADER = r"""
import json, sys
import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the tokenizer's ops)
jobs = json.load(open(sys.argv[1]))
out = {}
for name, job in jobs.items():
    model = tf.saved_model.load(job["dir"])
    for sig, inputs in job["calls"].items():
        args = {k: tf.constant(v if not isinstance(v, list) or not v or not isinstance(v[0], str) else
                               [s.encode("latin-1") for s in v]) for k, v in inputs.items()}
        for k, v in model.signatures[sig](**args).items():
            value = v.numpy()
            out[f"{name}/{sig}/{k}"] = value.astype(bytes) if value.dtype == object else value
np.savez(sys.argv[2], **out)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("tfpod", "tf_keras", "official"))))
"""


def on_host(x) -> np.ndarray:
    """A (sharded) DTensor as one host array."""
    layout = dtensor.fetch_layout(x)
    return dtensor.unpack(dtensor.relayout(x, dtensor.Layout.replicated(layout.mesh, layout.rank)))[0].numpy()


def restored_trainer(task, model_config, model_dir, save=False):
    """The training-time model: sharded over MESH as in training, from model_dir's newest checkpoint
    (with `save`: initialized, and saved as step 0)."""
    run_ = make_run(task, model_config, TrainConfig(steps=1, global_batch_size=8), optimizers.OptimizerConfig(),
                    device_mesh(MESH), model_dir)
    if save:
        run_.checkpoints.save()
    else:
        assert run_.checkpoints.restore_latest() is not None
    return run_.trainer


def sharded_forward(t, fn, batch):
    """fn(model, global batch) on the mesh, compiled as in training, under the run's activation sharding."""
    with t.placement.activations():
        return tf.function(lambda b: fn(t.model, b))(t.placement.to_global(batch, t.task.batch_axes()))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Trains (or initializes) each task sharded, exports it, and computes the sharded model's outputs."""
    base = tmp_path_factory.mktemp("export")
    jobs, expected = {}, {}

    # LM: trained 2 steps by main.run (writes config.gin), exported twice: main's --mode=export
    # and tfpod.export.saved_model from config.gin alone.
    lm_dir = base / "lm"
    params = ["gpt.num_layers=1", "train.steps=2", "train.steps_per_loop=2", "train.log_every=2",
              "train.synthetic_data=True", "train.global_batch_size=8"]
    run(["gin/lm_tiny.gin"], params, str(lm_dir), mesh=device_mesh(MESH))
    first = run(["gin/lm_tiny.gin"], params, str(lm_dir), mode="export")
    second = export.saved_model(str(lm_dir))
    # A tokenizer made before an export in this process lost its resource when the export's
    # own tokenizer was freed ("Resource ... SentencepieceOp does not exist"): one per use.
    sp = lambda: text.load_tokenizer(prepare.vocab_path(prepare.ensure(), 2048))
    prompts = ["def __init__(self", "import os\n", "", "x = [1, 2, 3]\nprint(len("]
    tokenizer = sp()
    rows = [[prepare.EOS_ID] + tokenizer.tokenize(tf.constant(p)).numpy().tolist() for p in prompts]
    ids = np.zeros([4, max(map(len, rows))], np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    t = restored_trainer(gpt.TASK, gpt.GPTConfig(vocab_size=2048, seq_len=64, num_layers=1, embed_dim=128, num_heads=8,
                                            mlp_dim=512), lm_dir)
    logits = on_host(sharded_forward(t, lambda m, b: m(gpt.model_inputs(b)), {"inputs": ids}))
    expected["lm/serving_default/logits"] = logits[np.arange(4), [len(r) - 1 for r in rows]]
    expected["lm/ids/logits"] = logits  # every position, of ids shorter than seq_len
    jobs["lm"] = {"dir": second["export_dir"], "calls": {"serving_default": {"text": prompts},
                                                         "generate": {"text": prompts[:2], "max_new_tokens": 5},
                                                         "ids": {"input_ids": ids.tolist()}}}

    # BERT and ResNet: initialized sharded, checkpointed at step 0, exported from the checkpoint.
    bert_cfg = bert.BertConfig(vocab_size=2048, seq_len=32, max_predictions=4, num_layers=1, hidden_size=64,
                               num_heads=8, intermediate_size=128, dropout=0.0, attention_dropout=0.0)
    t = restored_trainer(bert.TASK, bert_cfg, base / "bert", save=True)
    bert_export = export.export(bert.TASK, bert_cfg, bert.TASK.data_config_class(), str(base / "bert"))
    texts = ["return [MASK] + 1", "def f(x):\n    [MASK] x[MASK]", "no mask here", "[MASK]"]
    tokenizer = sp()
    pieces = [tokenizer.tokenize(tf.constant(s)).numpy().tolist() for s in texts]
    batch = {k: np.zeros([4, 32], np.int32) for k in ("input_ids", "input_mask", "segment_ids")}
    batch["masked_lm_positions"] = np.zeros([4, 4], np.int32)
    for i, p in enumerate(pieces):
        row = [prepare.CLS_ID] + p + [prepare.SEP_ID]
        batch["input_ids"][i, : len(row)], batch["input_mask"][i, : len(row)] = row, 1
        masks = [j for j, x in enumerate(row) if x == prepare.MASK_ID]
        batch["masked_lm_positions"][i, : len(masks)] = masks
    mlm, pooled = sharded_forward(t, lambda m, b: m.outputs_and_pooled(bert.model_inputs(b)), batch)
    expected["bert/serving_default/masked_lm_logits"] = on_host(mlm)
    expected["bert/serving_default/pooled_output"] = on_host(pooled)
    expected["bert/masks"] = [sum(x == prepare.MASK_ID for x in p) for p in pieces]
    expected["bert/masked_lm_positions"] = batch["masked_lm_positions"]
    # The ids signature on the same rows cut to the longest (shorter than seq_len).
    longest = int(batch["input_mask"].sum(1).max())
    cut = {k: batch[k][:, :longest] for k in ("input_ids", "segment_ids", "input_mask")}
    expected["bert/ids/logits"] = on_host(sharded_forward(t, lambda m, b: m.sequence_logits(b), cut))
    jobs["bert"] = {"dir": bert_export["export_dir"], "calls": {"serving_default": {"text": texts},
                                                                "ids": {k: v.tolist() for k, v in cut.items()}}}

    res_cfg = resnet.ResNetConfig(depth=10, depth_multiplier=0.25, image_size=32, num_classes=10)
    t = restored_trainer(resnet.TASK, res_cfg, base / "resnet", save=True)
    res_export = export.export(resnet.TASK, res_cfg, images.ImageDataConfig(), str(base / "resnet"))
    eval_files = sorted(tf.io.gfile.glob(images.split_paths(images.ensure(), "eval")))
    records = [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(eval_files[0]).take(8)]
    jpegs = [r.features.feature["image/encoded"].bytes_list.value[0] for r in records]
    pixels = np.stack([images.eval_image(tf.constant(j), images.ImageDataConfig(), 32).numpy() for j in jpegs])
    expected["resnet/serving_default/logits"] = on_host(sharded_forward(t, lambda m, b: m(resnet.model_inputs(b)),
                                                                        {"images": pixels}))
    jobs["resnet"] = {"dir": res_export["export_dir"],
                      "calls": {"serving_default": {"image_bytes": [j.decode("latin-1") for j in jpegs]}}}

    tr_cfg = transformer.TransformerConfig(vocab_size=2048, src_len=16, tgt_len=8, encoder_layers=1, decoder_layers=1,
                                           hidden_size=64, num_heads=8, intermediate_size=128, dropout=0.0,
                                           attention_dropout=0.0, intermediate_dropout=0.0, decode_max_length=6)
    t = restored_trainer(transformer.TASK, tr_cfg, base / "transformer", save=True)
    tr_export = export.export(transformer.TASK, tr_cfg, transformer.TASK.data_config_class(), str(base / "transformer"))
    sources = ["def close(self):\n    self._file.close()\n", "return x + 1", "", "class A:\n    pass"]
    tokenizer = sp()
    source_ids = np.zeros([4, 16], np.int32)
    for i, src in enumerate(sources):
        row = tokenizer.tokenize(tf.constant(src)).numpy().tolist()[:15] + [prepare.EOS_ID]
        source_ids[i, : len(row)] = row
    decoded = on_host(sharded_forward(t, lambda m, b: transformer.greedy_decode(m, b["inputs"], 6),
                                      {"inputs": source_ids}))
    before_eos = np.cumsum(decoded == prepare.EOS_ID, axis=1) == 0
    expected["transformer/serving_default/ids"] = np.where(before_eos, decoded, 0)
    jobs["transformer"] = {"dir": tr_export["export_dir"], "calls": {"serving_default": {"text": sources}}}

    (base / "jobs.json").write_text(json.dumps(jobs))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TF_USE_LEGACY_KERAS", "TFPOD", "PYTHONPATH"))}
    proc = subprocess.run([sys.executable, "-c", LOADER, str(base / "jobs.json"), str(base / "out.npz")],
                          capture_output=True, text=True, timeout=600, cwd=str(base), env=clean)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"first": first, "second": second, "bert": bert_export, "resnet": res_export, "transformer": tr_export,
            "expected": expected,
            "served": dict(np.load(base / "out.npz")), "imported": json.loads(proc.stdout.strip().splitlines()[-1]),
            "lm_dir": lm_dir}


def test_versions_follow_tf_serving_layout(exports):
    base = exports["lm_dir"] / "export" / "gpt"
    assert exports["first"]["export_dir"] == str(base / "1") and exports["second"]["export_dir"] == str(base / "2")
    assert exports["first"]["step"] == 2 and sorted(os.listdir(base)) == ["1", "2"]  # no partial folder left
    for d in ("1", "2"):
        assert os.path.exists(base / d / "saved_model.pb") and os.path.isdir(base / d / "variables")


def test_fresh_process_gives_the_sharded_models_outputs(exports):
    assert exports["imported"] == []  # neither tfpod, tf_keras nor Model Garden was needed
    served, expected = exports["served"], exports["expected"]
    np.testing.assert_allclose(served["lm/serving_default/logits"], expected["lm/serving_default/logits"],
                               rtol=1e-5, atol=1e-5)
    assert (served["lm/serving_default/next_token_id"] == expected["lm/serving_default/logits"].argmax(-1)).all()
    assert served["lm/generate/ids"].shape == (2, 5) and served["lm/generate/text"].shape == (2,)
    for key in ("masked_lm_logits", "pooled_output"):
        got, want = served[f"bert/serving_default/{key}"], expected[f"bert/serving_default/{key}"]
        if key == "masked_lm_logits":  # only the predicted [MASK] slots are defined
            for i, n in enumerate(expected["bert/masks"]):
                np.testing.assert_allclose(got[i, :n], want[i, :n], rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert served["bert/serving_default/num_masks"].tolist() == expected["bert/masks"] == [1, 2, 0, 1]
    assert served["bert/serving_default/predicted_tokens"][2].tolist() == [b""] * 4
    np.testing.assert_allclose(served["resnet/serving_default/logits"], expected["resnet/serving_default/logits"],
                               rtol=1e-5, atol=1e-5)
    top = np.argsort(-expected["resnet/serving_default/logits"], axis=1)[:, :5]
    assert (served["resnet/serving_default/classes"] == top).all()
    np.testing.assert_allclose(served["resnet/serving_default/scores"].sum(1) <= 1.0 + 1e-6, True)
    # The translator: the served greedy decode is the sharded model's, token for token.
    np.testing.assert_array_equal(served["transformer/serving_default/ids"], expected["transformer/serving_default/ids"])
    assert served["transformer/serving_default/translation"].shape == (4,)


def test_ids_signature_gives_the_models_logits_at_every_position(exports):
    served, expected = exports["served"], exports["expected"]
    lm = served["lm/ids/logits"]
    assert lm.shape == expected["lm/ids/logits"].shape and lm.shape[1] < 64  # a length below seq_len
    np.testing.assert_allclose(lm, expected["lm/ids/logits"], rtol=1e-5, atol=1e-5)
    got = served["bert/ids/logits"]
    np.testing.assert_allclose(got, expected["bert/ids/logits"], rtol=1e-5, atol=1e-5)
    # The head at every position, gathered at the [MASK]s, is the raw-string signature's masked-LM head.
    at_masks = np.take_along_axis(got, expected["bert/masked_lm_positions"][:, :, None], axis=1)
    for i, n in enumerate(expected["bert/masks"]):
        np.testing.assert_allclose(at_masks[i, :n], served["bert/serving_default/masked_lm_logits"][i, :n],
                                   rtol=1e-5, atol=1e-5)
    for job, names in (("second", ["input_ids"]), ("bert", ["input_ids", "segment_ids", "input_mask"])):
        assert exports[job]["signatures"]["ids"] == {"inputs": {k: "int32(None, None)" for k in names},
                                                     "outputs": {"logits": "float32(None, None, 2048)"}}
        ids = tf.saved_model.load(exports[job]["export_dir"]).signatures["ids"]
        args, kwargs = ids.structured_input_signature
        assert args == () and {k: (s.dtype, s.shape.as_list()) for k, s in kwargs.items()} == {
            k: (tf.int32, [None, None]) for k in names}
        assert {k: (s.dtype, s.shape.as_list()) for k, s in ids.structured_outputs.items()} == {
            "logits": (tf.float32, [None, None, 2048])}


def test_saved_model_cli_lists_string_signatures(exports):
    """TensorFlow's saved_model_cli (its console script's own entry point, `main`, run in one
    process for the four exports: one TensorFlow start instead of four)."""
    dirs = [exports[k]["export_dir"] for k in ("second", "bert", "resnet", "transformer")]
    script = ("import sys\nfrom tensorflow.python.tools import saved_model_cli\n"
              f"for d in {dirs!r}:\n    sys.argv = ['saved_model_cli', 'show', '--all', '--dir', d]\n"
              "    try:\n        saved_model_cli.main()\n    except SystemExit as e:\n"
              "        if e.code:\n            raise\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for sig in ("signature_def['serving_default']", "signature_def['generate']"):
        assert sig in out
    for name in ("inputs['text']", "inputs['max_new_tokens']", "inputs['image_bytes']"):
        assert name in out
    assert out.count("dtype: DT_STRING\n        shape: (-1)") >= 5  # every string input has a dynamic batch
    ids = re.findall(r"signature_def\['ids'\]:\n.*?Method name", out, re.S)  # the LM's, then BERT's
    tensor = r"s\['(\w+)'\] tensor_info:\n\s+dtype: DT_{}\n\s+shape: \({}\)"
    assert [re.findall("input" + tensor.format("INT32", "-1, -1"), i) for i in ids] == [
        ["input_ids"], ["input_ids", "input_mask", "segment_ids"]]
    assert [re.findall("output" + tensor.format("FLOAT", "-1, -1, 2048"), i) for i in ids] == [["logits"]] * 2


def test_predict_request_has_exactly_the_signature_inputs(exports):
    from tensorflow_serving.apis import predict_pb2

    for job in ("second", "bert", "resnet", "transformer"):
        described = exports[job]["signatures"]
        loaded = tf.saved_model.load(exports[job]["export_dir"])
        for name, sig in described.items():
            spec = loaded.signatures[name].structured_input_signature[1]
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "tfpod"
            request.model_spec.signature_name = name
            for key, s in spec.items():  # what a client sends: one example per input
                value = np.array([b"x"] if s.dtype == tf.string else ([3] if s.shape.rank else 3),
                                 dtype=object if s.dtype == tf.string else s.dtype.as_numpy_dtype)
                request.inputs[key].CopyFrom(tf.make_tensor_proto(value, dtype=s.dtype))
            assert set(request.inputs) == set(spec) == set(sig["inputs"])
            for key, s in spec.items():
                assert request.inputs[key].dtype == s.dtype.as_datatype_enum


@pytest.mark.unit
def test_export_without_a_run_is_one_line(tmp_path):
    with pytest.raises(UserError, match="config.gin does not exist"):
        export.saved_model(str(tmp_path))


def initialized(task, config):
    """The task's single-device model with fresh weights (as export builds it, without a checkpoint)."""
    model = task.build(config)
    example = {k: tf.zeros([1] + list(s.shape[1:]), s.dtype) for k, s in task.input_signature(config).items()}
    model(task.model_inputs(example), training=False)
    return model


def test_without_a_vocabulary_ids_is_the_default_signature(tmp_path):
    """LM data of token ids, BERT's create_pretraining_data.py records: no tokenizer; `ids` (and the LM's
    `generate_ids`) alone, `ids` also as serving_default; bad ids fail with one line saying what to send."""
    rng = np.random.default_rng(0)
    lm_cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32)
    bert_cfg = bert.BertConfig(vocab_size=64, seq_len=16, max_predictions=4, num_layers=1, hidden_size=16,
                               num_heads=2, intermediate_size=32, dropout=0.0, attention_dropout=0.0)
    ids = rng.integers(0, 64, [3, 7]).astype(np.int32)
    bert_inputs = {"input_ids": ids, "segment_ids": (np.arange(7) >= 3).astype(np.int32)[None].repeat(3, 0),
                   "input_mask": (np.arange(7) < 6).astype(np.int32)[None].repeat(3, 0)}
    cases = ((gpt.TASK, lm_cfg, lm_data.LMDataConfig(format="ids", eos_id=63), {"input_ids": ids}, lambda m, x: m({"inputs": x["input_ids"]})),
             (bert.TASK, bert_cfg, bert_data.BertDataConfig(format="records"), bert_inputs,
              lambda m, x: m.sequence_logits(x)))
    served = {}
    for task, cfg, data_cfg, inputs, forward in cases:
        model = initialized(task, cfg)
        module, signatures = task.serving(model, cfg, data_cfg)
        names = {"serving_default", "ids"} | ({"generate_ids"} if task is gpt.TASK else set())  # (the LM generates)
        assert set(signatures) == names and signatures["serving_default"] is signatures["ids"]
        sig = tf.saved_model.load(export.write(module, signatures, str(tmp_path / task.name))).signatures
        assert set(sig) == names
        got = sig["serving_default"](**{k: tf.constant(v) for k, v in inputs.items()})["logits"].numpy()
        np.testing.assert_allclose(got, forward(model, inputs).numpy(), rtol=1e-5, atol=1e-5)
        served[task.name] = sig["ids"]
    for bad, message in (({"input_ids": np.zeros([1, 17], np.int32)},
                          r"input_ids has 17 positions, more than seq_len=16, the size of the model position table"),
                         ({"input_ids": ids * 0 + 64}, r"input_ids holds values from 64 to 64, outside \[0, 64\)")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            served["gpt"](**{k: tf.constant(v) for k, v in bad.items()})
    for bad, message in (({**bert_inputs, "segment_ids": ids[:, :3]}, r"segment_ids has shape \[3 3\] but input_ids "
                                                                      r"\[3 7\]: send every input"),
                         ({**bert_inputs, "input_mask": ids * 0 + 2}, r"input_mask holds values from 2 to 2, "
                                                                      r"outside \[0, 2\) \(1 for a token")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            served["bert"](**{k: tf.constant(v) for k, v in bad.items()})


def test_moe_serves_ids_padded_to_whole_sequences(tmp_path):
    """MoE's routing groups are slices of seq_len tokens: its logits signatures run the model on ids
    padded to seq_len (its generation decodes with a cache: tests/test_generation.py)."""
    cfg = moe.MoEConfig(vocab_size=2048, seq_len=16, num_layers=2, embed_dim=16, num_heads=2, mlp_dim=32,
                        num_experts=2, expert_mlp_dim=16, moe_every=2, group_size=8)
    model = initialized(moe.TASK, cfg)
    module, signatures = moe.TASK.serving(model, cfg, lm_data.LMDataConfig())
    assert set(signatures) == {"serving_default", "generate", "sample", "generate_ids", "ids"}
    sig = tf.saved_model.load(export.write(module, signatures, str(tmp_path))).signatures
    ids = np.random.default_rng(0).integers(0, 2048, [2, 5]).astype(np.int32)
    got = sig["ids"](input_ids=tf.constant(ids))["logits"].numpy()
    want = model({"inputs": np.pad(ids, [[0, 0], [0, 11]])}, training=False).numpy()[:, :5]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert sig["serving_default"](text=tf.constant(["import os"]))["logits"].shape == (1, 2048)
    assert sig["generate"](text=tf.constant(["import os"]), max_new_tokens=tf.constant(3))["ids"].shape == (1, 3)
