"""Transformer translation: WMT-format records read and tokenized, one-line input errors,
the docstring demo set, corpus BLEU summed over hosts, and the tiny config in
train_and_eval on 8 devices under `data` and `tensor` (the same losses and metrics).

The two real runs share one module fixture (each compiles a train loop, an eval step and
a greedy decoder), shortened with gin params: 1 + 1 layers, short sequences, 2 steps.
"""

import ast
import collections
import json

import numpy as np
import pytest
import sacrebleu
import tensorflow as tf

from conftest import assert_golden_layouts
from tfpod import UserError, evaluation
from tfpod.input import prepare, translation
from tfpod.input.common import ShardInfo
from tfpod.api import run
from tfpod.mesh import make_mesh
from tfpod.models import transformer

# Sentences for the WMT-format records (the loader's feature names: src_lang / tgt_lang).
PAIRS = [
    ("Return the sum of two numbers.", "def add(a, b): return a + b"),
    ("Open the file and read it.", "with open(path) as f: data = f.read()"),
    ("x" * 400, "a very long source line"),  # longer than SRC_LEN tokens
    ("Print hello.", "print('hello')"),
    ("Sort the list in place.", "items.sort()"),
]
SRC_LEN, TGT_LEN = 24, 16


def write_wmt_records(path, pairs, src="en", tgt="de"):
    with tf.io.TFRecordWriter(str(path)) as w:
        for s, t in pairs:
            feature = {src: tf.train.Feature(bytes_list=tf.train.BytesList(value=[s.encode()])),
                       tgt: tf.train.Feature(bytes_list=tf.train.BytesList(value=[t.encode()]))}
            w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return str(path)


@pytest.fixture(scope="module")
def vocab():
    return prepare.vocab_path(prepare.ensure(), 2048)


def expected_row(sp, text, length):
    """SentencePiece ids + EOS, cut to length (EOS kept last) and 0-padded: the WMT loader's eval rows."""
    ids = sp.encode(text) + [sp.eos_id()]
    if len(ids) > length:
        ids = ids[:length - 1] + [sp.eos_id()]
    return ids + [0] * (length - len(ids))


@pytest.mark.unit
def test_pipeline_reads_wmt_records_and_tokenizes_like_sentencepiece(tmp_path, vocab):
    path = write_wmt_records(tmp_path / "newstest.tfrecord", PAIRS)
    sp = translation.sentencepiece(vocab)
    for long_pairs in ("filter", "truncate"):
        cfg = translation.TranslationDataConfig(train_files=path, eval_files=path, src_lang="en", tgt_lang="de",
                                                vocab_path=vocab, long_pairs=long_pairs, shuffle_buffer=0)
        evals = [{k: v.numpy() for k, v in b.items()} for b in
                 translation.translation_dataset(cfg, path, vocab, SRC_LEN, TGT_LEN, 2, ShardInfo(0, 1), 0, training=False)]
        assert [len(b["inputs"]) for b in evals] == [2, 2, 1]  # one pass, short last batch kept
        got = {k: np.concatenate([b[k] for b in evals]) for k in evals[0]}
        assert got["inputs"].dtype == np.int32 and got["weights"].dtype == np.float32
        assert got["inputs"].shape == (5, SRC_LEN) and got["targets"].shape == (5, TGT_LEN)
        np.testing.assert_array_equal(got["inputs"], [expected_row(sp, s, SRC_LEN) for s, _ in PAIRS])
        np.testing.assert_array_equal(got["targets"], [expected_row(sp, t, TGT_LEN) for _, t in PAIRS])
        np.testing.assert_array_equal(got["weights"], got["targets"] > 0)
        train = translation.translation_dataset(cfg, path, vocab, SRC_LEN, TGT_LEN, 2, ShardInfo(0, 1), 0, training=True)
        seen = np.concatenate([b["inputs"].numpy() for b in train.take(8)])  # 16 rows: 4 or 5 pairs repeated
        long_row = expected_row(sp, PAIRS[2][0], SRC_LEN)
        assert any((r == long_row).all() for r in seen) == (long_pairs == "truncate")  # filtered, or cut
        assert len({tuple(r) for r in seen}) == (4 if long_pairs == "filter" else 5)
    model = transformer.TransformerConfig(vocab_size=2048, src_len=SRC_LEN, tgt_len=TGT_LEN)
    task_input = transformer.TASK.make_input(cfg, model, ShardInfo(0, 1), 0)
    assert model.vocab_path is None  # the input reads the model's config, never writes it
    assert translation.vocabulary(cfg, model.vocab_path) == vocab  # what BLEU and serving detokenize with
    assert translation.vocabulary(cfg, "model.spm") == vocab  # the data's wins over transformer.vocab_path
    assert translation.vocabulary(translation.TranslationDataConfig(), "model.spm") == "model.spm"
    assert next(iter(task_input.train(4)))["targets"].shape == (4, TGT_LEN)


@pytest.mark.unit
def test_missing_feature_and_small_vocabulary_are_one_line_errors(tmp_path, vocab):
    path = write_wmt_records(tmp_path / "train.tfrecord", PAIRS[:2], src="en", tgt="fr")
    model = transformer.TransformerConfig(vocab_size=2048, src_len=SRC_LEN, tgt_len=TGT_LEN)
    cfg = translation.TranslationDataConfig(train_files=path, src_lang="en", tgt_lang="de", vocab_path=vocab)
    with pytest.raises(UserError) as e:
        transformer.TASK.make_input(cfg, model, ShardInfo(0, 1), 0)
    message = str(e.value)
    assert f"records in {path} lack feature 'de' (translation_data.tgt_lang; found: en, fr)" in message
    assert "set translation_data.src_lang and translation_data.tgt_lang" in message and "\n" not in message
    small = transformer.TransformerConfig(vocab_size=1024, src_len=SRC_LEN, tgt_len=TGT_LEN)
    with pytest.raises(UserError, match="has 2048 pieces but the model has transformer.vocab_size=1024"):
        transformer.TASK.make_input(translation.TranslationDataConfig(train_files=path, src_lang="en", tgt_lang="fr",
                                                                      vocab_path=vocab), small, ShardInfo(0, 1), 0)
    with pytest.raises(UserError, match=r"translation_data.long_pairs='drop': use one of filter, truncate"):
        translation.TranslationDataConfig(long_pairs="drop")


@pytest.mark.unit
def test_function_pairs_take_code_without_docstring_and_first_line():
    source = '''
@decorator
def area(width, height):
    """Return the area.

    Longer text.
    """
    return width * height


def only_doc():
    """Nothing else."""


class C:
    async def fetch(self):
        """  Fetch it.  """
        await self.go()
        return 1
'''
    pairs = translation.function_pairs(source)
    assert [(doc, line) for _, doc, line in pairs] == [("Return the area.", 3), ("Fetch it.", 16)]
    assert pairs[0][0] == "def area(width, height):\n    return width * height\n"
    assert pairs[1][0] == "async def fetch(self):\n    await self.go()\n    return 1\n"


@pytest.mark.unit
def test_demo_set_is_prepared_with_disjoint_splits():
    data_dir = translation.ensure()
    manifest = json.load(open(f"{data_dir}/manifest.json"))
    splits = {}
    for split in ("train", "eval"):
        pairs = []
        for record in tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(translation.split_paths(data_dir, split)))):
            feature = tf.train.Example.FromString(record.numpy()).features.feature
            pairs.append((feature["code"].bytes_list.value[0], feature["doc"].bytes_list.value[0],
                          feature["path"].bytes_list.value[0].decode()))
        splits[split] = pairs
    assert len(splits["train"]) == manifest["train_pairs"] > 5000
    assert len(splits["eval"]) == manifest["eval_pairs"] > 100
    assert not {code for code, _, _ in splits["eval"]} & {code for code, _, _ in splits["train"]}
    files = {split: {where.rsplit(":", 1)[0] for _, _, where in pairs} for split, pairs in splits.items()}
    assert not files["train"] & files["eval"] and all(prepare.is_eval(f) for f in files["eval"])
    for code, doc, _ in splits["eval"]:  # a whole function without its docstring; a stripped first line
        function = ast.parse(code.decode()).body[0]
        assert ast.get_docstring(function) is None and doc.strip() == doc and len(doc) >= 3


@pytest.mark.unit
def test_bleu_statistics_summed_over_hosts_equal_sacrebleu_corpus_bleu():
    references = ["Return the sum of two numbers.", "Open the file and read it.", "Print a greeting.",
                  "Sort the list in place.", "Close the connection to the server."]
    hypotheses = ["Return the sum of numbers.", "open the file and read it", "Print hello.", "",
                  "Close the server connection."]
    mesh = make_mesh("data:8")
    for lowercase in (False, True):
        # Two hosts' shares of the corpus, each summed over the mesh (one host here).
        halves = [transformer.bleu_statistics(hypotheses[a:b], references[a:b], lowercase) for a, b in ((0, 2), (2, 5))]
        totals = sum(evaluation.host_sum(h, mesh) for h in halves)
        np.testing.assert_array_equal(totals, halves[0] + halves[1])
        expected = sacrebleu.corpus_bleu(hypotheses, [references], lowercase=lowercase).score
        assert transformer.bleu_from_statistics(totals) == pytest.approx(expected, rel=1e-9) and expected > 10
    assert transformer.bleu_from_statistics(transformer.bleu_statistics([], [], True)) == 0.0


@pytest.mark.unit
def test_decode_rows_skip_padding_and_split_the_examples_over_hosts():
    def batch(weights):
        n = len(weights)
        return {"inputs": np.arange(n * 2).reshape(n, 2), "targets": np.ones((n, 3), np.int32),
                "weights": np.array(weights, np.float32)[:, None] * np.ones((n, 3), np.float32)}

    host_batches = [batch([1, 1, 1]), batch([1, 0, 0])]  # 4 real rows, then 2 padding rows
    assert len(transformer.decode_rows(host_batches, None, 1, 0)["inputs"]) == 4
    assert [len(transformer.decode_rows(host_batches, 5, 2, h)["inputs"]) for h in (0, 1)] == [3, 2]
    np.testing.assert_array_equal(transformer.decode_rows(host_batches, 2, 1, 0)["inputs"], [[0, 1], [2, 3]])


# The tiny config, shortened: dropout off so `data` and `tensor` see identical steps.
SHORT = ["transformer.encoder_layers=1", "transformer.decoder_layers=1", "transformer.src_len=32",
         "transformer.tgt_len=16", "transformer.decode_max_length=8", "transformer.dropout=0.0",
         "transformer.attention_dropout=0.0", "transformer.intermediate_dropout=0.0", "train.steps=2",
         "train.steps_per_loop=2", "train.log_every=2", "train.eval_every=2", "train.checkpoint_every=2",
         "train.global_batch_size=16", "translation_data.max_eval_examples=20", "translation_data.eval_max_length=40",
         "optimizer.clip_norm=0"]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """gin/transformer_tiny.gin on the demo set: data:8 with `data`, data:4,model:2 with `tensor`."""
    out = {}
    # (the data-parallel run skips BLEU: one greedy decoder compiled is enough)
    data = ["sharding.preset='data'", "transformer.decode_examples=0", "train.target_metric=None"]
    for name, mesh, params in (("data", "data:8", data),
                               ("tensor", "data:4,model:2", ["sharding.preset='tensor'"])):
        model_dir = tmp_path_factory.mktemp(name)
        result = run(["gin/transformer_tiny.gin"], SHORT + params, str(model_dir), mode="train_and_eval",
                     mesh_spec=mesh)
        records = [json.loads(line) for line in open(model_dir / "metrics.jsonl")]
        out[name] = (result, records, (model_dir / "layouts.txt").read_text(), model_dir)
        assert_golden_layouts(out[name][2], f"transformer_{name}_{mesh.replace(':', '').replace(',', '_')}")
    return out


def test_tiny_config_trains_and_evaluates_bleu_on_8_devices(tiny_runs):
    result, records, report, _ = tiny_runs["tensor"]
    assert result["step"] == 2 and all(np.isfinite(result["losses"]))
    kinds = collections.Counter(r["kind"] for r in records)
    assert kinds["train"] == 1 and kinds["eval"] == 1 and kinds["goodput"] >= 1 and len(kinds) == 3
    evaluated = [r for r in records if r["kind"] == "eval"][0]
    assert evaluated["step"] == 2 and evaluated["num_examples"] == 20
    assert evaluated["decoded_examples"] == 20  # the short last batch's padding rows are not decoded
    assert 0.0 <= evaluated["bleu"] <= 100.0 and 0.0 <= evaluated["token_accuracy"] <= 1.0
    assert evaluated["loss"] > 0 and evaluated["smoothed_loss"] < evaluated["loss"]
    rows = {line.split()[0]: line for line in report.splitlines() if line.strip() and not line.startswith("#")}
    assert "[model, unsharded]" in rows["transformer/on_device_embedding/embeddings"]  # vocab-parallel, tied
    assert "[unsharded, model, unsharded]" in rows["transformer/decoder/layer_0/attention/encdec/query/kernel"]
    assert "[model, unsharded]" in rows["transformer/encoder/layer_0/output/kernel"]  # row-parallel


def test_tensor_preset_trains_and_evaluates_like_data_parallel(tiny_runs):
    (data, data_records, _, _), (tensor, tensor_records, _, _) = tiny_runs["data"], tiny_runs["tensor"]
    np.testing.assert_allclose(tensor["losses"], data["losses"], rtol=1e-4)
    assert len(set(data["losses"])) == 2 and 4.0 < data["losses"][0] < np.log(2048)  # smoothed, minus its minimum
    data_eval, tensor_eval = ([r for r in records if r["kind"] == "eval"][0] for records in (data_records,
                                                                                           tensor_records))
    for key in ("loss", "smoothed_loss", "token_accuracy"):
        assert tensor_eval[key] == pytest.approx(data_eval[key], rel=1e-4), key


def test_export_translates_raw_strings(tiny_runs):
    """--mode=export of the tensor run: a single-device SavedModel decoding raw source text."""
    from tfpod import export

    model_dir = tiny_runs["tensor"][3]
    out = export.saved_model(str(model_dir))
    assert out["step"] == 2 and set(out["signatures"]) == {"serving_default"}
    serving = tf.saved_model.load(out["export_dir"]).signatures["serving_default"]
    got = serving(text=tf.constant(["def close(self):\n    self._file.close()\n", ""]))
    assert got["translation"].dtype == tf.string and got["translation"].shape == (2,)
    assert got["ids"].shape == (2, 8)  # transformer.decode_max_length
