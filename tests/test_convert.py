"""Hugging Face checkpoints in and out, against transformers' own TF models.

transformers 4.44 (the test extra) still has TF classes. Each test makes a randomly
initialized TFGPT2LMHeadModel or TFBertForPreTraining, writes it as a Hub folder with
transformers' own name converter (PyTorch names, transposed where PyTorch stores
[out, in]), imports it with `python -m tfpod.convert import`, and compares tfpod's
outputs with transformers' on the same ids (fp32, max abs 1e-4): single-device logits,
and the loss of the sharded model on 8 devices. tfpod's export is read back by
transformers' from_pretrained with the same logits.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from conftest import device_mesh, main_py, make_run, run_module

transformers = pytest.importorskip("transformers")
from transformers.modeling_tf_pytorch_utils import convert_tf_weight_name_to_pt_weight_name  # noqa: E402

from tfpod import UserError, config as tfpod_config, optimizers  # noqa: E402
from tfpod.convert import model_garden, run as convert  # noqa: E402
from tfpod.controller import TrainConfig  # noqa: E402
from tfpod.convert import hub as hublib  # noqa: E402


def write_hub_folder(model, path, architecture):
    """A transformers TF model as a Hub folder: config.json and PyTorch-named safetensors."""
    tensors = {}
    for w in model.weights:
        name, transpose = convert_tf_weight_name_to_pt_weight_name(w.name, tf_weight_shape=w.shape)
        value = w.numpy()
        if transpose.name == "SIMPLE":
            value = value.T
        if value.ndim == 2 and value.shape[0] == 1 and name.endswith(".bias"):
            value = value[0]  # TFConv1D keeps its bias [1, n]; PyTorch's is [n]
        tensors[name] = value
    model.config.architectures = [architecture]
    cfg = json.loads(model.config.to_json_string())
    hublib.write_folder(str(path), cfg, sorted(tensors.items()), max_shard_bytes=64 * 1024)  # sharded, with an index
    return tensors


def single_device(model_dir):
    """The imported run's newest checkpoint in a single-device tfpod model."""
    from tfpod import api, export

    tfpod_config.parse_config([os.path.join(model_dir, "config.gin")], [])
    c = api.build_run_configs()
    return c, export.single_device_model(c.task, c.model, export.checkpoint_path(str(model_dir)))


GPT2 = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A random TFGPT2LMHeadModel, its Hub folder, and its logits on fixed ids."""
    d = tmp_path_factory.mktemp("gpt2")
    tf.keras.utils.set_random_seed(0)
    model = transformers.TFGPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    ids = np.random.default_rng(0).integers(0, GPT2["vocab_size"], size=(2, 32)).astype(np.int32)
    logits = model(ids).logits.numpy()
    write_hub_folder(model, d / "hub", "GPT2LMHeadModel")
    return d, ids, logits


def test_gpt2_imports_on_a_tensor_mesh_with_transformers_logits(gpt2, tmp_path):
    d, ids, logits = gpt2
    assert os.path.exists(d / "hub" / hublib.INDEX)
    convert.import_hub(str(d / "hub"), str(tmp_path / "run"), mesh_spec="data:2,model:4")
    c, model = single_device(tmp_path / "run")
    assert c.model.activation == "gelu_approximate" and c.model.seq_len == 32
    ours = model({"inputs": tf.constant(ids)}, training=False).numpy()
    assert np.max(np.abs(ours - logits)) <= 1e-4
    # The same weights on 8 devices under `tensor` give transformers' loss on these ids.
    targets = np.roll(ids, -1, axis=1)
    run = make_run(c.task, c.model, TrainConfig(steps=1, global_batch_size=2, synthetic_data=True),
                   optimizers.OptimizerConfig(), "data:2,model:4", tmp_path / "run", preset="tensor")
    assert run.restore() == 0
    result = run.trainer.evaluate([{"inputs": ids, "targets": targets, "weights": np.ones(ids.shape, np.float32)}], 2)
    expected = np.mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits).numpy())
    np.testing.assert_allclose(result["loss"], expected, rtol=1e-5)


def test_gpt2_fine_tunes_from_its_config_and_exports_back_to_transformers(gpt2, tmp_path):
    d, ids, logits = gpt2
    run, out = tmp_path / "run", tmp_path / "out"
    convert.import_hub(str(d / "hub"), str(run))  # (the command line's own run: the bad-folder test)
    # Weights split over model:2 (the 8-device tensor mesh: test_gpt2_imports_on_a_tensor_mesh...).
    short = ["--cpu_devices=2", "--mesh=data:1,model:2", "--gin_param=train.synthetic_data=True",
             "--gin_param=train.log_every=1", "--gin_param=train.steps_per_loop=1",
             "--gin_param=optimizer.learning_rate=1e-3", "--gin_param=optimizer.warmup_steps=0"]
    tuned = main_py(f"--model_dir={run}", "--gin_param=train.steps=2", *short)  # no --gin_file: run/config.gin
    assert tuned.returncode == 0, tuned.stderr
    # train.init_from: the imported weights in a fresh folder (step 0, no checkpoint of its own): on the
    # first batch of a run from them, the loss the fine-tuning run logged at its first step.
    c, _ = single_device(run)
    fresh = make_run(c.task, c.model, TrainConfig(steps=1, global_batch_size=8, synthetic_data=True,
                                                  init_from=f"{run}/checkpoints/ckpt-0"), optimizers.OptimizerConfig(),
                     device_mesh("data:1,model:2"), tmp_path / "fresh", preset="tensor")
    with pytest.raises(UserError, match="not of this model"):  # a checkpoint of another model is one line
        make_run(c.task, dataclasses.replace(c.model, mlp_dim=64), TrainConfig(init_from=str(run)),
                 optimizers.OptimizerConfig(), device_mesh(), tmp_path / "other").restore()
    first = next(json.loads(line)["loss"] for line in open(run / "metrics.jsonl") if '"train"' in line)
    assert fresh.restore() is None and int(fresh.trainer.step.numpy()) == 0
    batch = next(fresh.synthetic_feed().start(0, None))
    np.testing.assert_allclose(fresh.trainer.evaluate([batch], fresh.host_rows)["loss"], first, rtol=1e-5)

    convert.export_hub(str(run), str(out))
    hub_model = transformers.TFGPT2LMHeadModel.from_pretrained(str(out))
    _, model = single_device(run)  # step 2
    ours = model({"inputs": tf.constant(ids)}, training=False).numpy()
    assert np.max(np.abs(hub_model(ids).logits.numpy() - ours)) <= 1e-4
    assert np.max(np.abs(ours - logits)) > 1e-3  # fine-tuning moved the weights
    with pytest.raises(UserError, match="exists and is not empty"):  # nothing is overwritten
        convert.export_hub(str(run), str(out))


BERT = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert_batch(rng, rows=4, length=32, predictions=5):
    lengths = rng.integers(length // 2, length + 1, size=rows)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    ids = rng.integers(5, BERT["vocab_size"], size=(rows, length)).astype(np.int32) * mask
    segments = ((np.arange(length)[None, :] >= lengths[:, None] // 2) * mask).astype(np.int32)
    positions = np.sort(rng.permuted(np.tile(np.arange(1, length // 2), (rows, 1)), axis=1)[:, :predictions], axis=1)
    return {"input_ids": ids, "input_mask": mask, "segment_ids": segments,
            "masked_lm_positions": positions.astype(np.int32)}


def test_bert_for_pretraining_imports_and_exports_with_transformers_logits(tmp_path):
    tf.keras.utils.set_random_seed(1)
    hub_model = transformers.TFBertForPreTraining(transformers.BertConfig(**BERT))
    batch = bert_batch(np.random.default_rng(1))
    hub_out = hub_model(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                        token_type_ids=batch["segment_ids"])
    expected = np.take_along_axis(hub_out.prediction_logits.numpy(), batch["masked_lm_positions"][:, :, None], axis=1)
    write_hub_folder(hub_model, tmp_path / "hub", "BertForPreTraining")
    run, out = tmp_path / "run", tmp_path / "out"
    convert.import_hub(str(tmp_path / "hub"), str(run), mesh_spec="data:2,model:4")
    c, model = single_device(run)
    assert c.model.next_sentence and c.model.activation == "gelu"
    mlm, nsp = model({k: tf.constant(v) for k, v in batch.items()}, training=False, with_next_sentence=True)
    assert np.max(np.abs(mlm.numpy() - expected)) <= 1e-4
    assert np.max(np.abs(nsp.numpy() - hub_out.seq_relationship_logits.numpy())) <= 1e-4
    # The model as it sits on 8 devices under `tensor` gives the same logits.
    sharded = make_run(c.task, c.model, TrainConfig(steps=1, global_batch_size=4, synthetic_data=True),
                       optimizers.OptimizerConfig(), "data:2,model:4", run, preset="tensor")
    assert sharded.restore() == 0
    placement = sharded.trainer.placement
    on_mesh = sharded.trainer.model(placement.to_global(batch, c.task.batch_axes()), training=False)
    whole = dtensor.unpack(dtensor.relayout(on_mesh, dtensor.Layout.replicated(placement.mesh, 3)))[0]
    assert np.max(np.abs(whole.numpy() - expected)) <= 1e-4

    convert.export_hub(str(run), str(out))
    back = transformers.TFBertForPreTraining.from_pretrained(str(out))(
        input_ids=batch["input_ids"], attention_mask=batch["input_mask"], token_type_ids=batch["segment_ids"])
    assert np.max(np.abs(back.prediction_logits.numpy() - hub_out.prediction_logits.numpy())) <= 1e-4


def test_base_and_masked_lm_berts_import_with_fresh_heads_and_bad_folders_are_one_line(tmp_path):
    tf.keras.utils.set_random_seed(2)
    base = transformers.TFBertModel(transformers.BertConfig(**BERT))
    base(input_ids=np.ones((1, 8), np.int32))
    tensors = write_hub_folder(base, tmp_path / "base", "BertModel")
    # The Hub's BertModel files name their tensors without the "bert." prefix.
    hublib.write_folder(str(tmp_path / "bare"), json.load(open(tmp_path / "base" / "config.json")),
                        sorted((k[len("bert."):], v) for k, v in tensors.items()))
    fresh = convert.import_hub(str(tmp_path / "bare"), str(tmp_path / "a"))["fresh"]
    assert fresh and all(n.startswith(("bert/masked_lm/", "bert/next_sentence/")) for n in fresh)
    # BertForMaskedLM: the masked-LM head is read (transformers' logits), pooler and NSP are fresh.
    masked = transformers.TFBertForMaskedLM(transformers.BertConfig(**BERT))
    batch = bert_batch(np.random.default_rng(2))
    hub_logits = masked(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                        token_type_ids=batch["segment_ids"]).logits.numpy()
    write_hub_folder(masked, tmp_path / "masked", "BertForMaskedLM")
    fresh = convert.import_hub(str(tmp_path / "masked"), str(tmp_path / "m"))["fresh"]
    assert {n.rsplit("/", 1)[0] for n in fresh} == {"bert/encoder/pooler_transform", "bert/next_sentence"}
    c, model = single_device(tmp_path / "m")
    assert not c.model.next_sentence
    # No vocab.txt came with it: it reads records of its own ids and serves ids alone (not raw text
    # through the default corpus's vocabulary).
    assert c.data.format == "records" and not c.data.masked_online
    _, signatures = c.task.serving(model, c.model, c.data)
    assert set(signatures) == {"serving_default", "ids"} and signatures["serving_default"] is signatures["ids"]
    ours = model({k: tf.constant(v) for k, v in batch.items()}, training=False).numpy()
    expected = np.take_along_axis(hub_logits, batch["masked_lm_positions"][:, :, None], axis=1)
    assert np.max(np.abs(ours - expected)) <= 1e-4
    # Bad folders: a missing tensor, an extra one, a wrong shape, an existing run; nothing written over.
    cfg = json.load(open(tmp_path / "base" / "config.json"))
    bad = {"missing": {k: v for k, v in tensors.items() if k != "bert.pooler.dense.bias"},
           "extra": {**tensors, "classifier.weight": np.zeros((2, 32))},
           "shape": {**tensors, "bert.pooler.dense.bias": np.zeros(31)}}
    for name, content in bad.items():
        hublib.write_folder(str(tmp_path / name), cfg, sorted(content.items()))
    with pytest.raises(UserError, match=r"1 tensor\(s\) its config.json implies are missing \(bert.pooler.dense.bias\)"):
        convert.import_hub(str(tmp_path / "missing"), str(tmp_path / "b"))
    with pytest.raises(UserError, match=r"tfpod does not know \(classifier.weight\)"):
        convert.import_hub(str(tmp_path / "extra"), str(tmp_path / "b"))
    with pytest.raises(UserError, match=r"bert.pooler.dense.bias gives bert/encoder/pooler_transform/bias the shape "
                                        r"\[31\]"):
        convert.import_hub(str(tmp_path / "shape"), str(tmp_path / "b"))
    before = open(tmp_path / "a" / "config.gin").read()
    out = run_module("tfpod.convert", "import", f"--hf={tmp_path / 'bare'}", f"--model_dir={tmp_path / 'a'}")
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"error: --model_dir={tmp_path / 'a'} already holds config.gin: import into a new folder (nothing there is "
        "overwritten)"]
    assert open(tmp_path / "a" / "config.gin").read() == before


def test_model_garden_tf2_and_google_tf1_bert_checkpoints_import_with_model_gardens_logits(tmp_path):
    """A Model Garden BertPretrainerV2 (TF2 object checkpoint), and the same weights under the
    original Google BERT TF1 names, read through Model Garden's own converter."""
    from official.modeling import tf_utils
    from official.nlp.modeling import models, networks

    cfg = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 64, "hidden_act": "gelu", "max_position_embeddings": 32, "type_vocab_size": 2,
           "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "initializer_range": 0.02}
    tf.keras.utils.set_random_seed(3)
    encoder = networks.BertEncoder(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_sequence_length=32, type_vocab_size=2,
                                   dropout_rate=0.0, attention_dropout_rate=0.0,
                                   activation=tf_utils.get_activation("gelu"))  # as Model Garden's converter builds it
    pretrainer = models.BertPretrainerV2(encoder_network=encoder, mlm_activation=tf_utils.get_activation("gelu"))
    pretrainer(pretrainer.inputs)
    batch = bert_batch(np.random.default_rng(3))
    inputs = {"input_word_ids": batch["input_ids"], "input_mask": batch["input_mask"],
              "input_type_ids": batch["segment_ids"], "masked_lm_positions": batch["masked_lm_positions"]}
    outputs = pretrainer(inputs)
    for name in ("tf2", "tf1", "encoder"):
        os.makedirs(tmp_path / name)
        json.dump(cfg, open(tmp_path / name / "bert_config.json", "w"))
    tf.train.Checkpoint(**pretrainer.checkpoint_items).write(str(tmp_path / "tf2" / "ckpt"))
    tf.train.Checkpoint(encoder=encoder).write(str(tmp_path / "encoder" / "ckpt"))  # the converter's default

    # Google's names: Dense kernels [in, out] whole, the NSP classifier [2, hidden].
    weights = {w.name.split(":")[0]: w.numpy() for w in pretrainer.weights}
    google = {"bert/embeddings/word_embeddings": weights["word_embeddings/embeddings"],
              "bert/embeddings/position_embeddings": weights["position_embedding/embeddings"],
              "bert/embeddings/token_type_embeddings": weights["type_embeddings/embeddings"],
              "bert/pooler/dense/kernel": weights["pooler_transform/kernel"],
              "bert/pooler/dense/bias": weights["pooler_transform/bias"],
              "cls/predictions/output_bias": weights["bert/cls/predictions/output_bias/bias"],
              "cls/seq_relationship/output_weights": np.random.default_rng(4).normal(size=(2, 32)).astype(np.float32),
              "cls/seq_relationship/output_bias": np.array([0.1, -0.1], np.float32)}
    for g, b in (("gamma", "gamma"), ("beta", "beta")):
        google[f"bert/embeddings/LayerNorm/{g}"] = weights[f"embeddings/layer_norm/{b}"]
        google[f"cls/predictions/transform/LayerNorm/{g}"] = weights[f"bert/cls/predictions/transform/LayerNorm/{b}"]
    for kind in ("kernel", "bias"):
        google[f"cls/predictions/transform/dense/{kind}"] = weights[f"bert/cls/predictions/transform/dense/{kind}"]
    for i in range(2):
        mg, g = f"transformer/layer_{i}", f"bert/encoder/layer_{i}"
        for n in ("query", "key", "value"):
            google[f"{g}/attention/self/{n}/kernel"] = weights[f"{mg}/self_attention/{n}/kernel"].reshape(32, 32)
            google[f"{g}/attention/self/{n}/bias"] = weights[f"{mg}/self_attention/{n}/bias"].reshape(32)
        google[f"{g}/attention/output/dense/kernel"] = weights[f"{mg}/self_attention/attention_output/kernel"].reshape(32, 32)
        google[f"{g}/attention/output/dense/bias"] = weights[f"{mg}/self_attention/attention_output/bias"]
        for ours, theirs in (("self_attention_layer_norm", "attention/output/LayerNorm"),
                             ("output_layer_norm", "output/LayerNorm")):
            google[f"{g}/{theirs}/gamma"], google[f"{g}/{theirs}/beta"] = (weights[f"{mg}/{ours}/gamma"],
                                                                         weights[f"{mg}/{ours}/beta"])
        for ours, theirs in (("intermediate", "intermediate/dense"), ("output", "output/dense")):
            google[f"{g}/{theirs}/kernel"], google[f"{g}/{theirs}/bias"] = (weights[f"{mg}/{ours}/kernel"],
                                                                          weights[f"{mg}/{ours}/bias"])
    tf1_vars = {name: tf.Variable(value, name=name) for name, value in google.items()}
    tf.compat.v1.train.Saver(var_list=tf1_vars).save(sess=None, save_path=str(tmp_path / "tf1" / "bert_model.ckpt"))

    expected = outputs["mlm_logits"].numpy()
    for name, ckpt in (("tf2", "ckpt"), ("tf1", "bert_model.ckpt")):
        model_garden.import_model_garden(str(tmp_path / name / ckpt), str(tmp_path / (name + "_run")))
        c, model = single_device(tmp_path / (name + "_run"))
        mlm, nsp = model({k: tf.constant(v) for k, v in batch.items()}, training=False, with_next_sentence=True)
        assert np.max(np.abs(mlm.numpy() - expected)) <= 1e-4
        assert c.model.next_sentence == (name == "tf1")
    fresh = model_garden.import_model_garden(str(tmp_path / "encoder" / "ckpt"), str(tmp_path / "encoder_run"))["fresh"]
    assert "bert/masked_lm/output_bias/bias" in fresh and "bert/next_sentence/kernel" in fresh
    assert all(n.startswith(("bert/masked_lm/", "bert/next_sentence/")) for n in fresh)  # the encoder was read
    pooled = outputs["pooled_output"].numpy()
    nsp_expected = pooled @ google["cls/seq_relationship/output_weights"].T + google["cls/seq_relationship/output_bias"]
    assert np.max(np.abs(nsp.numpy() - nsp_expected)) <= 1e-4


MISTRAL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, sliding_window=None, rope_theta=500000.0,
               rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_mistral_and_llama_folders_import_with_transformers_logits_and_export_back(tmp_path):
    """A random TFMistralForCausalLM written as a MistralForCausalLM folder, and its weights as a
    LlamaForCausalLM folder (config.json from transformers' LlamaConfig), import with its logits;
    the Llama import splits its heads over model:2 (key/value heads too) and trains on; the export
    is read back by transformers with tfpod's logits."""
    tf.keras.utils.set_random_seed(0)
    model = transformers.TFMistralForCausalLM(transformers.MistralConfig(**MISTRAL))
    ids = np.random.default_rng(0).integers(0, MISTRAL["vocab_size"], size=(2, 32)).astype(np.int32)
    logits = model(ids).logits.numpy()
    tensors = write_hub_folder(model, tmp_path / "mistral", "MistralForCausalLM")
    # A SentencePiece tokenizer.model with sentencepiece's own ids (Llama 2's and Mistral's: eos 2).
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    words = [f"{a}{b}{c}" for a in "abcdefgh" for b in "aeiou" for c in "klmnpr"]
    corpus.write_text("\n".join(" ".join(words[(i * k) % len(words)] for k in range(1, 12)) for i in range(400)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "mistral" / "tokenizer"),
                                   vocab_size=MISTRAL["vocab_size"], minloglevel=2)
    llama_config = transformers.LlamaConfig(**{k: v for k, v in MISTRAL.items() if k != "sliding_window"},
                                            architectures=["LlamaForCausalLM"])
    hublib.write_folder(str(tmp_path / "llama"), json.loads(llama_config.to_json_string()), sorted(tensors.items()))
    for name, mesh in (("mistral", None), ("llama", "data:4,model:2")):
        convert.import_hub(str(tmp_path / name), str(tmp_path / f"{name}_run"), mesh_spec=mesh)
        c, ours = single_device(tmp_path / f"{name}_run")
        assert (c.task.name, c.model.num_kv_heads, c.model.tie_embeddings) == ("llama", 2, False)
        np.testing.assert_allclose(ours({"inputs": tf.constant(ids)}).numpy(), logits, atol=1e-4, rtol=0)
    # The Mistral folder's tokenizer.model came with it: copied, in the graph for text and serving,
    # documents ending with its own EOS (2); the Llama folder had none: it trains on ids.
    c, ours = single_device(tmp_path / "mistral_run")
    assert c.data.vocab_path == str(tmp_path / "mistral_run" / "tokenizer.model") and c.data.eos == 2
    _, signatures = c.task.serving(ours, c.model, c.data)
    assert {"serving_default", "generate", "sample", "generate_ids", "ids"} == set(signatures)
    # A served prompt starts with the model's BOS (1), as its tokenizer does in transformers.
    assert c.data.bos_id == 1
    served = signatures["serving_default"](tf.constant(["bak cem"]))["logits"].numpy()
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "mistral" / "tokenizer.model")).encode("bak cem")
    prompt = tf.constant([[1] + pieces])
    np.testing.assert_allclose(served[0], model(prompt).logits.numpy()[0, -1], atol=1e-4, rtol=0)
    assert np.abs(served[0] - model(prompt[:, 1:]).logits.numpy()[0, -1]).max() > 1e-3  # BOS changes the answer
    assert single_device(tmp_path / "llama_run")[0].data.format == "ids"

    run, out = tmp_path / "llama_run", tmp_path / "out"
    tuned = main_py(f"--model_dir={run}", "--gin_param=train.steps=2", "--cpu_devices=2", "--mesh=data:1,model:2",
                    "--gin_param=train.synthetic_data=True", "--gin_param=train.steps_per_loop=1",
                    "--gin_param=optimizer.learning_rate=1e-2", "--gin_param=optimizer.warmup_steps=0")
    assert tuned.returncode == 0, tuned.stderr
    convert.export_hub(str(run), str(out))
    assert json.load(open(out / "config.json"))["architectures"] == ["LlamaForCausalLM"]
    back = transformers.TFMistralForCausalLM.from_pretrained(str(out))
    _, ours = single_device(run)
    mine = ours({"inputs": tf.constant(ids)}).numpy()
    np.testing.assert_allclose(back(ids).logits.numpy(), mine, atol=1e-4, rtol=0)
    assert np.abs(mine - logits).max() > 1e-3  # the two steps moved the weights


def test_llama_configs_tfpod_cannot_run_are_one_line_naming_each_value(tmp_path):
    """Llama 3.1's rope_scaling imports as the llama.rope_* knobs; values tfpod cannot run are
    reported together in one line, and a config.json missing a field is one line too."""
    from tfpod.convert import llama as llama_family

    base = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64)
    c = llama_family.model_config({**base, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert (c.rope_scaling_factor, c.rope_original_len, c.num_kv_heads, c.rope_theta) == (8.0, 8192, 1, 500000.0)
    assert llama_family.hub_config(c)["rope_scaling"]["rope_type"] == "llama3"
    with pytest.raises(UserError) as e:
        llama_family.model_config({**base, "hidden_act": "gelu", "sliding_window": 16,
                                   "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert len(str(e.value).splitlines()) == 1
    for part in ("hidden_act='gelu'", "sliding_window=16 below max_position_embeddings=64", "'yarn'"):
        assert part in str(e.value)
    with pytest.raises(UserError, match=r"^config.json: hidden_size, num_hidden_layers missing"):
        llama_family.model_config({k: v for k, v in base.items() if k not in ("hidden_size", "num_hidden_layers")})
    from tfpod.convert import bert as bert_family, gpt2 as gpt2_family  # every family: one line, not a KeyError

    with pytest.raises(UserError, match=r"^config.json: n_embd, n_layer missing: is it a GPT2LMHeadModel config"):
        gpt2_family.model_config({"vocab_size": 96, "n_head": 4})
    with pytest.raises(UserError, match=r"^config.json: num_attention_heads missing"):
        bert_family.model_config({k: v for k, v in {**base, "model_type": "bert"}.items() if k != "num_attention_heads"})


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_a_llama31_folder_written_by_pytorch_transformers_imports_with_its_logits(tmp_path):
    """tests/fixtures/llama31_tiny: PyTorch transformers' LlamaForCausalLM with Llama 3.1's
    rope_scaling (original length 16, 64 positions: every frequency band in use) and tied
    embeddings, saved by save_pretrained, with its own logits (tests/fixtures/make_fixtures.py).
    tfpod's import computes them; the same weights without the scaling do not."""
    expected = np.load(os.path.join(FIXTURES, "llama31_tiny", "logits.npz"))
    convert.import_hub(os.path.join(FIXTURES, "llama31_tiny"), str(tmp_path / "run"))
    c, ours = single_device(tmp_path / "run")
    assert (c.model.rope_scaling_factor, c.model.rope_original_len, c.model.tie_embeddings) == (8.0, 16, True)
    assert (c.data.bos_id, c.data.eos) == (1, 2)
    got = ours({"inputs": tf.constant(expected["ids"])}).numpy()
    assert np.abs(expected["logits"]).max() > 1.0
    np.testing.assert_allclose(got, expected["logits"], atol=1e-4, rtol=0)
    from tfpod.models import llama

    unscaled = llama.Llama(dataclasses.replace(c.model, rope_scaling_factor=0.0))
    unscaled({"inputs": tf.constant(expected["ids"])})
    unscaled.set_weights(ours.get_weights())
    assert np.abs(unscaled({"inputs": tf.constant(expected["ids"])}).numpy() - expected["logits"]).max() > 1e-2
