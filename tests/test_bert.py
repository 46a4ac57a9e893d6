"""BERT pretraining: the masked-LM head, tf-models-official's own create_pretraining_data.py
records read and trained on, the tiny config in train_and_eval on 8 devices, the `tensor`
preset against one device, and one-line config errors."""

import collections
import json
import random

import numpy as np
import pytest
import tensorflow as tf

from tfpod import UserError, optimizers
from tfpod.input import bert_data
from conftest import assert_golden_layouts, device_mesh, make_run
from tfpod.api import run
from tfpod.controller import TrainConfig
from tfpod.input.common import ShardInfo
from tfpod.models import bert

# A WordPiece vocabulary for create_pretraining_data.py: BERT's special tokens, words, a suffix piece.
WORDS = ("the a cat dog bird fish tree house river hill sun moon red green blue big small old new fast slow "
         "runs sees eats finds likes jumps sleeps sings near under over with and but then").split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "##s"] + WORDS
SEQ_LEN, PREDICTIONS = 32, 5


def write_pretraining_records(out_dir, v2_names=False, shards=2):
    """Runs tf-models-official's create_pretraining_data.py (its own functions) on a small
    corpus: sentences one per line, documents separated by blank lines. Returns the glob."""
    from official.nlp.data import create_pretraining_data as cpd
    from official.nlp.tools import tokenization

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_file = out_dir / "vocab.txt"
    vocab_file.write_text("\n".join(VOCAB) + "\n")
    rng = random.Random(0)
    lines = []
    for _ in range(24):  # documents
        for _ in range(rng.randint(3, 7)):  # sentences
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
            lines.append(" ".join(words).capitalize() + ("s." if rng.random() < 0.3 else "."))
        lines.append("")
    corpus = out_dir / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")

    tokenizer = tokenization.FullTokenizer(vocab_file=str(vocab_file), do_lower_case=True)
    instances = cpd.create_training_instances(
        [str(corpus)], tokenizer, cpd.get_processor_text_fn(False, True), max_seq_length=SEQ_LEN, dupe_factor=2,
        short_seq_prob=0.1, masked_lm_prob=0.15, max_predictions_per_seq=PREDICTIONS, rng=random.Random(12345),
    )
    outputs = [str(out_dir / f"part-{i:05d}-of-{shards:05d}") for i in range(shards)]
    cpd.write_instance_to_example_files(instances, tokenizer, SEQ_LEN, PREDICTIONS, outputs, gzip_compress=False,
                                        use_v2_feature_names=v2_names)
    return str(out_dir / "part-*")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    base = tmp_path_factory.mktemp("records")
    return {"v1": write_pretraining_records(base / "v1"), "v2": write_pretraining_records(base / "v2", v2_names=True)}


def raw_examples(pattern):
    """Every record of the files, parsed without tfpod: {feature: list of values}."""
    out = []
    for path in sorted(tf.io.gfile.glob(pattern)):
        for record in tf.data.TFRecordDataset(path):
            feature = tf.train.Example.FromString(record.numpy()).features.feature
            out.append({k: list(v.int64_list.value) or list(v.float_list.value) for k, v in feature.items()})
    return out


@pytest.mark.unit
def test_masked_lm_head_gathers_like_model_garden():
    """The one-hot einsum over positions gives Model Garden MaskedLM's logits (its tf.gather)."""
    from official.nlp.modeling import layers

    rng = np.random.default_rng(0)
    table = tf.constant(rng.normal(size=(40, 16)), tf.float32)
    sequence = tf.constant(rng.normal(size=(3, 10, 16)), tf.float32)
    positions = tf.constant(rng.integers(0, 10, size=(3, 4)), tf.int32)
    ours = bert.MaskedLMHead(40, 16, "gelu", "glorot_uniform")
    theirs = layers.MaskedLM(embedding_table=table, activation="gelu")
    expected = theirs(sequence, masked_positions=positions)
    ours(sequence, positions, table)  # builds it
    ours.set_weights(theirs.get_weights())
    got = ours(sequence, positions, table)
    assert got.shape == (3, 4, 40)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_pretraining_records_are_read_with_every_feature(records):
    """Both spellings of create_pretraining_data.py's features give exactly its records."""
    cfg = bert.BertConfig(vocab_size=64, seq_len=SEQ_LEN, max_predictions=PREDICTIONS, num_layers=1,
                          hidden_size=32, num_heads=4, intermediate_size=64)
    truth = raw_examples(records["v1"])
    assert len(truth) > 50 and {e["next_sentence_labels"][0] for e in truth} == {0, 1}

    def key(e):  # every value of an example, in a fixed feature order
        return tuple(x for k in sorted(e) for x in e[k])

    for spelling in ("v1", "v2"):
        data = bert_data.BertDataConfig(train_files=records[spelling], eval_files=records[spelling])
        task_input = bert.TASK.make_input(data, cfg, ShardInfo(0, 1), seed=0)
        batches = list(task_input.eval(16))
        assert [len(b["input_ids"]) for b in batches[:-1]] == [16] * (len(batches) - 1)
        batch = batches[0]
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in batch.items()}
        assert shapes == {
            "input_ids": ((16, SEQ_LEN), tf.int32), "input_mask": ((16, SEQ_LEN), tf.int32),
            "segment_ids": ((16, SEQ_LEN), tf.int32), "masked_lm_positions": ((16, PREDICTIONS), tf.int32),
            "masked_lm_ids": ((16, PREDICTIONS), tf.int32), "masked_lm_weights": ((16, PREDICTIONS), tf.float32),
            "next_sentence_labels": ((16,), tf.int32),
        }
        read = [{k: [int(x) if k != "masked_lm_weights" else float(x) for x in np.atleast_1d(b[k][i].numpy())]
                 for k in b} for b in batches for i in range(len(b["input_ids"]))]
        assert len(read) == len(truth)
        for want, have in zip(sorted(truth, key=key), sorted(read, key=key)):
            assert have == want, spelling
        train = next(iter(task_input.train(16)))
        assert train["input_ids"].shape == (16, SEQ_LEN) and train["input_ids"][:, 0].numpy().tolist() == [2] * 16


def test_tiny_config_trains_and_evaluates_on_8_devices(tmp_path):
    """gin/bert_tiny.gin on the default corpus, masked online, data:4,model:2."""
    params = ["bert.num_layers=1", "train.steps=4", "train.steps_per_loop=2", "train.log_every=2",
              "train.eval_every=2", "train.global_batch_size=16", "bert_data.max_eval_examples=40"]
    out = run(["gin/bert_tiny.gin"], params, str(tmp_path), mode="train_and_eval", mesh_spec="data:4,model:2")
    assert out["step"] == 4 and all(np.isfinite(out["losses"]))
    records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    kinds = collections.Counter(r["kind"] for r in records)
    assert kinds["train"] == 2 and kinds["eval"] == 2 and kinds["goodput"] >= 1 and len(kinds) == 3
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["num_examples"] == 40 and 0.0 <= e["masked_lm_accuracy"] <= 1.0 for e in evals)
    assert all(r["mfu"] > 0 for r in records if r["kind"] == "train")
    report = open(tmp_path / "layouts.txt").read()
    assert "# bert variables on mesh data:4,model:2" in report
    assert_golden_layouts(report, "bert_tensor_data4_model2")
    rows = {line.split()[0]: line for line in report.splitlines() if line.strip() and not line.startswith("#")}
    assert "[model, unsharded]" in rows["bert/encoder/word_embeddings/embeddings"]  # vocab-parallel, tied
    assert "[unsharded, model]" in rows["bert/encoder/transformer/layer_0/intermediate/kernel"]
    assert "[model]" in rows["bert/masked_lm/output_bias/bias"]


@pytest.mark.unit
def test_text_segments_cover_every_token():
    ragged = tf.ragged.constant([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]])
    docs = tf.data.Dataset.from_tensor_slices(ragged).map(tf.identity)  # [None] int32 documents
    per_document = [s.numpy().tolist() for s in bert_data._document_segments(docs, 2)]
    assert per_document == [[1, 2], [3, 4], [5], [6, 7], [8, 9], [10, 11]]
    stream = [s.numpy().tolist() for s in bert_data._segments(docs, 3)]
    assert stream == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # the partial tail [10, 11] is dropped


# The model's vocabulary is padded past vocab.txt's 43 pieces to a multiple of the model axis.
SMALL = dict(vocab_size=64, seq_len=SEQ_LEN, max_predictions=PREDICTIONS, num_layers=1, hidden_size=64, num_heads=8,
             intermediate_size=128, dropout=0.0, attention_dropout=0.0, next_sentence=True)


def train_on_records(model_dir, pattern, spec, preset, steps=3):
    """LAMB with polynomial decay, masked LM + next sentence, on create_pretraining_data.py records."""
    cfg = bert.BertConfig(**SMALL)
    run_cfg = TrainConfig(steps=steps, global_batch_size=16, steps_per_loop=steps, log_every=steps,
                          checkpoint_every=100, seed=1)
    opt = optimizers.OptimizerConfig(name="lamb", learning_rate=1e-2, warmup_steps=0, decay="polynomial",
                                     decay_steps=8, end_learning_rate_ratio=0.0, epsilon=1e-6, clip_norm=1.0)
    controller = make_run(bert.TASK, cfg, run_cfg, opt, spec, model_dir, preset=preset)
    task_input = bert.TASK.make_input(bert_data.BertDataConfig(train_files=pattern), cfg, ShardInfo(0, 1), seed=1)
    return controller.trainer, np.array(controller.train(controller.dataset_feed(task_input))["losses"])


def test_records_train_and_the_tensor_preset_equals_one_device(records, tmp_path):
    """The same records and seed: Megatron tensor parallelism on data:4,model:2, with and
    without weight-update sharding, trains the losses of one device (relative 1e-4),
    next-sentence loss included (each loss a mean over its own count, across 4 data shards)."""
    _, reference = train_on_records(tmp_path / "one", records["v1"], device_mesh(), "data")
    trainer, losses = train_on_records(tmp_path / "tensor", records["v1"], "data:4,model:2", "tensor")
    assert len(set(losses)) == 3 and losses[0] > np.log(64)  # masked LM ~ln(vocab) plus next sentence ~ln(2)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    # LAMB's update sharded over `data` too (its trust ratios are norms over whole weights).
    _, sharded_update = train_on_records(tmp_path / "update", records["v1"], "data:4,model:2", "weight_update")
    np.testing.assert_allclose(sharded_update, reference, rtol=1e-4)
    from tensorflow.experimental import dtensor

    U = dtensor.UNSHARDED
    layout = lambda v: dtensor.fetch_layout(v).sharding_specs
    assert layout(trainer.model.encoder.get_embedding_table()) == ["model", U]  # vocab-parallel, tied to the head
    block = trainer.model.encoder.transformer_layers[0]
    assert type(block).__name__ == "Block"  # gpt.Block, post-norm
    assert layout(block.attention.query.kernel) == [U, "model", U]  # column-parallel
    assert layout(block.output_dense.kernel) == ["model", U]  # row-parallel
    assert layout(trainer.model.masked_lm.bias) == ["model"]


@pytest.mark.unit
def test_synthetic_batches_follow_the_batch_contract():
    cfg = bert.BertConfig(**SMALL)
    batch = bert.synthetic_batch(cfg, 8, np.random.default_rng(0))
    assert {k: v.shape for k, v in batch.items()} == {
        "input_ids": (8, SEQ_LEN), "input_mask": (8, SEQ_LEN), "segment_ids": (8, SEQ_LEN),
        "masked_lm_positions": (8, PREDICTIONS), "masked_lm_ids": (8, PREDICTIONS),
        "masked_lm_weights": (8, PREDICTIONS), "next_sentence_labels": (8,)}
    assert set(bert.batch_axes()) >= set(batch)
    for row in range(8):
        real = batch["masked_lm_weights"][row] > 0
        positions = batch["masked_lm_positions"][row][real]
        assert real.sum() >= 1 and len(set(positions)) == len(positions)
        assert (batch["input_ids"][row][positions] == bert_data.MASK_ID).all()
        assert (batch["masked_lm_ids"][row][real] >= bert_data.FIRST_PIECE).all()
        assert batch["input_ids"][row][0] == bert_data.CLS_ID and batch["input_mask"][row][positions].all()
    assert bert.flops_per_token(cfg) > 6 * (4 * 64 * 64 + 2 * 64 * 128)


@pytest.mark.parametrize(
    "params,needle",
    [
        (["bert.num_heads=7"], "bert.hidden_size=128 is not divisible by bert.num_heads=7"),
        (["bert.max_predictions=200"], "bert.max_predictions=200 exceeds bert.seq_len=128"),
        (["bert.activation='swish'"], "bert.activation='swish': use one of gelu, gelu_approximate, relu"),
        (["bert_data.format='json'"], "bert_data.format='json': use one of auto, records, text"),
        (["bert_data.mask_rate=0.0"], "bert_data.mask_rate=0.0 must be in (0, 1]"),
        (["bert.next_sentence=True"], "bert.next_sentence=True needs next_sentence_labels"),
        (["bert_data.train_files='no/such/*.tfrecord'"], "input pattern 'no/such/*.tfrecord' matches no file"),
    ],
)
@pytest.mark.unit
def test_config_errors_are_one_line(tmp_path, params, needle):
    with pytest.raises(UserError) as e:
        run(["gin/bert_tiny.gin"], params, str(tmp_path), mesh_spec="data:4,model:2")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_records_that_do_not_fit_the_model_are_one_line_errors(records, tmp_path):
    base = [f"bert_data.train_files='{records['v1']}'"]
    with pytest.raises(UserError) as e:
        run(["gin/bert_tiny.gin"], base + ["bert.vocab_size=64"], str(tmp_path))
    assert "input_ids of length 32 and masked_lm_ids of length 5, but the model has bert.seq_len=128" in str(e.value)
    assert "set bert.seq_len=32 and bert.max_predictions=5" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:
        run(["gin/bert_tiny.gin"], base + [f"bert.seq_len={SEQ_LEN}", f"bert.max_predictions={PREDICTIONS}",
                                           "bert.vocab_size=16"], str(tmp_path))
    assert "but bert.vocab_size=16: set bert.vocab_size to the size of the vocab.txt" in str(e.value)
    with pytest.raises(UserError, match="lack feature"):
        corpus = sorted(tf.io.gfile.glob(bert_data.prepare.split_paths(bert_data.prepare.ensure(), "eval")))[0]
        run(["gin/bert_tiny.gin"], [f"bert_data.train_files='{corpus}'"], str(tmp_path))
