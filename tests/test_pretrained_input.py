"""Input for pretrained checkpoints: pre-tokenized id records (lm_data.format='ids') and
WordPiece vocab.txt vocabularies (BERT's) driving the online-masking pipeline."""

import numpy as np
import pytest
import tensorflow as tf

from tfpod import UserError
from tfpod.input import bert_data, lm_data, text
from tfpod.input.common import ShardInfo

EOS = 2
DOCS = [[11, 12, 13], [14, 15], [16, 17, 18, 19, 20, 21], []]  # the last one is empty: [EOS] alone


def write(path, docs, **kwargs):
    assert lm_data.write_ids_records(str(path), docs, **kwargs) == len(docs)
    return str(path)


def ids_config(pattern, **kwargs):
    return lm_data.LMDataConfig(**{"train_files": pattern, "format": "ids", "eos_id": EOS, "shuffle_buffer": 0,
                                   "cycle_length": 1, **kwargs})


def rows(ds, n=None):
    ds = ds.take(n) if n else ds
    return [{k: v.numpy().tolist() for k, v in r.items()} for r in ds.unbatch()]


# ---------------------------------------------------------------- lm_data.format='ids'


@pytest.mark.unit
def test_ids_records_pack_into_the_written_ids(tmp_path):
    """One file read in order: the stream is the written documents, each followed by eos_id."""
    cfg = ids_config(write(tmp_path / "ids.tfrecord", DOCS))
    concat = rows(lm_data.lm_dataset(cfg, cfg.train_files, None, 4, 3, ShardInfo(0, 1), 0, 32), 2)
    # The stream 11 12 13 E 14 15 E 16 17 18 19 20 21 E E (15 tokens, 3 rows of 5), then again.
    want = [([11, 12, 13, EOS], [12, 13, EOS, 14]), ([15, EOS, 16, 17], [EOS, 16, 17, 18]),
            ([19, 20, 21, EOS], [20, 21, EOS, EOS])] * 2
    assert [(r["inputs"], r["targets"]) for r in concat] == want
    assert all(r["weights"] == [1.0] * 4 for r in concat)

    cfg = ids_config(cfg.train_files, packing="segments")
    segments = rows(lm_data.lm_dataset(cfg, cfg.train_files, None, 4, 4, ShardInfo(0, 1), 0, 32), 1)
    # Documents of 3, 2 and 6 pairs (the last cut into 4 + 2); [E] alone has no pair.
    assert segments == [
        {"inputs": [11, 12, 13, 0], "targets": [12, 13, EOS, 0], "segment_ids": [1, 1, 1, 0],
         "positions": [0, 1, 2, 0], "weights": [1.0, 1.0, 1.0, 0.0]},
        {"inputs": [14, 15, 0, 0], "targets": [15, EOS, 0, 0], "segment_ids": [1, 1, 0, 0],
         "positions": [0, 1, 0, 0], "weights": [1.0, 1.0, 0.0, 0.0]},
        {"inputs": [16, 17, 18, 19], "targets": [17, 18, 19, 20], "segment_ids": [1, 1, 1, 1],
         "positions": [0, 1, 2, 3], "weights": [1.0, 1.0, 1.0, 1.0]},
        {"inputs": [20, 21, 0, 0], "targets": [21, EOS, 0, 0], "segment_ids": [1, 1, 0, 0],
         "positions": [0, 1, 0, 0], "weights": [1.0, 1.0, 0.0, 0.0]},
    ]


def test_bos_before_and_no_eos_after_documents_as_set(tmp_path):
    """lm_data.bos_id puts the model's BOS before every document; append_eos=False joins
    documents with nothing between them (Megatron data without --append-eod); ids that
    already start with the BOS are refused in one line."""
    cfg = ids_config(write(tmp_path / "ids.tfrecord", DOCS), bos_id=1)
    stream = [t for r in rows(lm_data.lm_dataset(cfg, cfg.train_files, None, 4, 1, ShardInfo(0, 1), 0, 32), 3)
              for t in r["inputs"] + r["targets"][-1:]]  # rows are the stream cut every seq_len + 1 tokens
    assert stream == [1, 11, 12, 13, EOS, 1, 14, 15, EOS, 1, 16, 17, 18, 19, 20]
    cfg = ids_config(cfg.train_files, append_eos=False)
    stream = [t for r in rows(lm_data.lm_dataset(cfg, cfg.train_files, None, 4, 1, ShardInfo(0, 1), 0, 32), 3)
              for t in r["inputs"] + r["targets"][-1:]]
    assert stream == [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 11, 12, 13, 14]
    with pytest.raises(UserError, match=r"records in .* already start with lm_data.bos_id=11, which the reader puts "
                                        r"before every document: write the ids without it .* or set lm_data.bos_id"):
        lm_data.lm_dataset(ids_config(cfg.train_files, bos_id=11), cfg.train_files, None, 4, 1, ShardInfo(0, 1), 0, 32)
    with pytest.raises(UserError, match=r"lm_data.bos_id=99 is not below gpt.vocab_size=32"):
        lm_data.lm_dataset(ids_config(cfg.train_files, bos_id=99), cfg.train_files, None, 4, 1, ShardInfo(0, 1), 0, 32)


@pytest.mark.unit
def test_megatron_datasets_written_by_megatron_core_convert_to_the_same_documents(tmp_path):
    """tests/fixtures/megatron: .bin/.idx pairs written by megatron-core's IndexedDatasetBuilder
    (int32 tokens as MLPerf's Llama 3.1 C4, uint16 ones; a two-sequence document, an empty one)
    convert with `python -m tfpod.input.megatron` into id records holding the
    same documents in order, which lm_data reads as the reference's token stream."""
    import json
    import os

    from tfpod.input import megatron

    here = os.path.join(os.path.dirname(__file__), "fixtures", "megatron")
    written = json.load(open(os.path.join(here, "documents.json")))
    prefixes = [os.path.join(here, name) for name in sorted(written)]
    assert megatron.main([f"--from={','.join(prefixes)}", f"--ids_out={tmp_path / 'ids'}", "--shards=2"]) == 0
    for name, docs in written.items():
        assert [d.tolist() for d in megatron.documents(os.path.join(here, name))] == docs
        files = sorted(str(p) for p in (tmp_path / "ids").glob(f"{name}-*"))
        assert len(files) == 2
        read = [tf.train.Example.FromString(r.numpy()).features.feature["ids"].int64_list.value
                for f in files for r in tf.data.TFRecordDataset(f)]
        assert [list(d) for d in read] == docs
    c4 = sorted(str(p) for p in (tmp_path / "ids").glob("c4_int32*"))
    cfg = ids_config(",".join(c4), append_eos=False, eos_id=128001)
    stream = [t for r in rows(lm_data.lm_dataset(cfg, cfg.train_files, None, 4, 1, ShardInfo(0, 1), 0, 128256,
                                                 repeat=False)) for t in r["inputs"][:1]]
    assert stream[0] == written["c4_int32_text_document"][0][0] == 128255
    assert megatron.main([f"--from={prefixes[0]}", f"--ids_out={tmp_path / 'ids'}", "--shards=2"]) == 1  # exists
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"bad.idx is not a Megatron mmap index .*: pass the path prefix"):
        megatron.Index(str(tmp_path / "bad"))
    with pytest.raises(UserError, match=r"missing.idx does not exist"):
        megatron.Index(str(tmp_path / "missing"))


def test_ids_input_needs_no_vocabulary_and_splits_files_over_hosts(tmp_path):
    """lm_input as the GPT task calls it: no corpus prepared, hosts read disjoint files, the
    eval split packs each document alone, and the training iterator is checkpointable."""
    from tfpod.models import gpt

    for f in range(4):  # file f: documents 100 f + 10 (d + 1) + [0, d + 3) for d = 0, 1, 2
        write(tmp_path / f"train-{f}.tfrecord", [[100 * f + 10 * (d + 1) + i for i in range(d + 3)] for d in range(3)])
    never = tmp_path / "no-corpus"
    cfg = lm_data.LMDataConfig(train_files=str(tmp_path / "train-*.tfrecord"), eval_files=str(tmp_path / "train-*"),
                               format="ids", eos_id=EOS, vocab_path=str(tmp_path / "ignored.model"),
                               data_dir=str(never))
    model = gpt.GPTConfig(vocab_size=400, seq_len=4)
    seen = []
    for host in range(2):
        task_input = lm_data.lm_input(cfg, model, ShardInfo(host, 2), seed=0)
        assert task_input.source["lm_data.eos_id"] == EOS and "vocab" not in task_input.source
        evals = rows(task_input.eval(2))
        tokens = {t for r in evals for t, w in zip(r["inputs"], r["weights"]) if w and t != EOS}
        assert {t // 100 for t in tokens} == {int(f.split("-")[-1][0]) for f, _ in task_input.source["files"]}
        seen.append(tokens)
        # Each document alone: 2 files of 3 documents, each document's first row starting with it.
        assert sum(r["inputs"][0] % 10 == 0 for r in evals) == 6
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 4 * (3 + 4 + 5)
    assert not never.exists()

    train = task_input.train(2)
    iterator = iter(train)
    next(iterator)
    ckpt = tf.train.Checkpoint(iterator=iterator)
    path = ckpt.write(str(tmp_path / "input"))
    want = [next(iterator)["inputs"].numpy() for _ in range(3)]
    ckpt.read(path)
    np.testing.assert_array_equal([next(iterator)["inputs"].numpy() for _ in range(3)], want)


@pytest.mark.unit
def test_ids_out_of_range_or_misconfigured_are_one_line_errors(tmp_path):
    good = write(tmp_path / "a.tfrecord", [[1, 2, 3], [4, 5]] * 40 + [[6, 50256]])  # the bad id past the first batch
    with pytest.raises(UserError) as e:  # the first record is checked before anything is built
        lm_data.lm_dataset(ids_config(good), good, None, 4, 2, ShardInfo(0, 1), 0, 3)
    assert str(e.value) == (f"records in {good} hold token id 3, outside [0, gpt.vocab_size=3): set gpt.vocab_size "
                            "to the vocabulary the ids were written with (GPT-2: 50257)")
    cfg = ids_config(good)
    ds = lm_data.lm_dataset(cfg, good, None, 4, 2, ShardInfo(0, 1), 0, 1000, repeat=False)
    with pytest.raises(tf.errors.InvalidArgumentError) as e:  # every record is checked as it is read
        rows(ds)
    assert (f"records in {good} hold token id 50256, outside [0, gpt.vocab_size=1000): set gpt.vocab_size to the "
            "vocabulary the ids were written with (GPT-2: 50257)") in e.value.message

    named = write(tmp_path / "b.tfrecord", [[1, 2]], feature="input_ids")
    with pytest.raises(UserError, match=r"no int64 list feature 'ids' \(found: input_ids \(int64_list\)\): set "
                                        r"lm_data.ids_feature"):
        lm_data.lm_dataset(ids_config(named), named, None, 4, 2, ShardInfo(0, 1), 0, 32)
    assert rows(lm_data.lm_dataset(ids_config(named, ids_feature="input_ids"), named, None, 2, 1, ShardInfo(0, 1), 0,
                                   32, repeat=False)) == [{"inputs": [1, 2], "targets": [2, EOS], "weights": [1, 1]}]
    with pytest.raises(UserError, match=r"lm_data.eos_id=50256 is not below gpt.vocab_size=32"):
        lm_data.lm_dataset(ids_config(named, eos_id=50256), named, None, 4, 2, ShardInfo(0, 1), 0, 32)
    with pytest.raises(UserError, match=r"lm_data.format='ids' needs lm_data.eos_id, .*: set it "
                                        r"\(GPT-2: 50256, Llama 2: 2\)"):
        lm_data.LMDataConfig(train_files=named, format="ids")
    with pytest.raises(UserError, match=r"has no default corpus: set lm_data.train_files \(write them with "
                                        r"tfpod.input.lm_data.write_ids_records, or tfpod.input.rows from parquet\)"):
        lm_data.resolve(lm_data.LMDataConfig(format="ids", eos_id=EOS))
    with pytest.raises(UserError, match=r"document 1 for .* holds token id -1: token ids are >= 0"):
        lm_data.write_ids_records(str(tmp_path / "c.tfrecord"), [[1], [-1]])


# ---------------------------------------------------------------- WordPiece vocab.txt

# A BERT-style vocabulary: [PAD] first, [unused] slots, the specials at ids of their own.
VOCAB = ("[PAD] [unused0] [unused1] [UNK] [CLS] [SEP] [MASK] ! , . ? ' a the quick brown fox jump ##s ##ed over "
         "lazy dog cat is run ##ning hello world un ##aff ##able na ##ive cafe tokyo 東 京 and").split()
PAD, UNK, CLS, SEP, MASK = 0, 3, 4, 5, 6
ID = {p: i for i, p in enumerate(VOCAB)}


@pytest.fixture(scope="module")
def vocab_txt(tmp_path_factory):
    path = tmp_path_factory.mktemp("wordpiece") / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    return str(path)


SENTENCES = {
    "The quick brown fox jumps over the lazy dog.": "the quick brown fox jump ##s over the lazy dog .",
    "Unaffable cats? Naïve CAFÉ, 東京!": "un ##aff ##able cat ##s ? na ##ive cafe , 東 京 !",
    "hello [MASK] world[MASK]": "hello [MASK] world [MASK]",
    "running zebras": "run ##ning [UNK]",
    "": "",
}


@pytest.mark.unit
def test_wordpiece_tokenizer_has_the_sentencepiece_interface(vocab_txt):
    tokenizer = text.load_tokenizer(vocab_txt)
    assert isinstance(tokenizer, text.WordPieceTokenizer) and int(tokenizer.vocab_size()) == len(VOCAB)
    want = [[ID[p] for p in pieces.split()] for pieces in SENTENCES.values()]
    batch = tokenizer.tokenize(tf.constant(list(SENTENCES)))  # strings -> ragged [batch, (pieces)] int32
    assert isinstance(batch, tf.RaggedTensor) and batch.dtype == tf.int32 and batch.to_list() == want
    one = tokenizer.tokenize("The quick brown fox jumps over the lazy dog.")  # a string -> [pieces]
    assert isinstance(one, tf.Tensor) and one.dtype == tf.int32 and one.numpy().tolist() == want[0]
    pieces = tokenizer.id_to_string(tf.constant([want[1], want[1]]))  # [2, pieces] -> their strings
    assert [p.decode() for p in pieces.numpy()[1]] == SENTENCES["Unaffable cats? Naïve CAFÉ, 東京!"].split()
    np.testing.assert_array_equal(tokenizer.string_to_id(pieces).numpy(), [want[1], want[1]])
    assert tokenizer.id_to_string(tf.constant([len(VOCAB), -1])).numpy().tolist() == [b"", b""]  # no such id
    assert int(tokenizer.string_to_id("not-a-piece")) == UNK
    assert tokenizer.detokenize(tf.ragged.constant([want[0]])).numpy().tolist() == [
        b"the quick brown fox jumps over the lazy dog ."]
    cased = text.load_tokenizer(vocab_txt, lower_case=False)
    assert cased.tokenize("The fox").numpy().tolist() == [UNK, ID["fox"]]

    tokenizers = pytest.importorskip("tokenizers")  # Hugging Face's own WordPiece, on the same file
    reference = tokenizers.BertWordPieceTokenizer.from_file(vocab_txt, lowercase=True)
    for sentence, ids in zip(SENTENCES, want):
        assert reference.encode(sentence, add_special_tokens=False).ids == ids, sentence


@pytest.mark.unit
def test_wordpiece_vocab_errors_are_one_line(tmp_path, vocab_txt):
    no_unk = tmp_path / "no_unk.txt"
    no_unk.write_text("[PAD]\nthe\n")
    no_words = tmp_path / "no_words.txt"
    no_words.write_text("[PAD]\n[UNK]\n")
    binary = tmp_path / "spm.txt"  # a SentencePiece model named .txt
    binary.write_bytes(b"\n\x07\n\x03the\x15\x00\x00\x00\x00")
    for path, needle in [(tmp_path / "missing.txt", "does not exist"), (no_unk, "has no [UNK] line"),
                         (no_words, "cannot make a tokenizer (No valid vocab tokens were found to build the trie.)"),
                         (binary, "is binary (NUL bytes; a SentencePiece model is named *.model)")]:
        with pytest.raises(UserError) as e:
            text.load_tokenizer(str(path))
        assert needle in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)

    no_mask = tmp_path / "no_mask.txt"
    no_mask.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n")
    with pytest.raises(UserError, match=r"no_mask.txt has no line\(s\) \[MASK\]: BERT needs"):
        bert_data.special_ids(text.load_tokenizer(str(no_mask)), str(no_mask))
    pad_last = tmp_path / "pad_last.txt"
    pad_last.write_text("[UNK]\n[CLS]\n[SEP]\n[MASK]\n[PAD]\nthe\n")
    with pytest.raises(UserError, match=r"has \[PAD\] as id 4, but BERT pads with id 0: put \[PAD\] on the first"):
        bert_data.special_ids(text.load_tokenizer(str(pad_last)), str(pad_last))
    assert bert_data.special_ids(text.load_tokenizer(vocab_txt), vocab_txt) == {"mask": MASK, "cls": CLS, "sep": SEP}


def test_wordpiece_vocab_drives_bert_online_masking(tmp_path, vocab_txt):
    from tfpod.models import bert

    doc = "The quick brown fox jumps over the lazy dog. Hello world, the cat is running!"
    (tmp_path / "doc.txt").write_text(doc)
    tokens = [ID[p] for p in "the quick brown fox jump ##s over the lazy dog . hello world , the cat is run ##ning !"
              .split()] + [SEP]  # the document boundary of a WordPiece vocabulary: [SEP]
    model = bert.BertConfig(vocab_size=64, seq_len=16, max_predictions=8, num_layers=1, hidden_size=32, num_heads=2,
                            intermediate_size=64)
    cfg = bert_data.BertDataConfig(train_files=str(tmp_path / "*.txt"), format="text", vocab_path=vocab_txt,
                                   mask_rate=0.5, shuffle_buffer=0)
    got = rows(bert_data.text_dataset(cfg, cfg.train_files, vocab_txt, model, 4, ShardInfo(0, 1), 0, repeat=False))
    segments = [tokens[:14], tokens[14:]]  # the eval split: the document cut into seq_len - 2 tokens
    assert len(got) == 2
    masks = 0
    for r, segment in zip(got, segments):
        original = np.array(r["input_ids"])
        count = int(sum(r["masked_lm_weights"]))
        positions = r["masked_lm_positions"][:count]
        original[positions] = r["masked_lm_ids"][:count]  # undo the masking
        framed = [CLS] + segment + [SEP]
        assert original.tolist() == framed + [PAD] * (16 - len(framed))
        assert r["input_mask"] == [1] * len(framed) + [0] * (16 - len(framed))
        is_mask = np.array(r["input_ids"]) == MASK
        assert set(np.flatnonzero(is_mask)) <= set(positions)  # [MASK] (the file's id) only where predicted
        masks += int(is_mask.sum())
    assert masks >= 3  # 80% of the 8 + 4 predictions

    train = next(iter(bert_data.text_dataset(cfg, cfg.train_files, vocab_txt, model, 4, ShardInfo(0, 1), 0, True)))
    ids = train["input_ids"].numpy()
    assert ids.shape == (4, 16) and (ids[:, 0] == CLS).all() and (ids[:, -1] == SEP).all() and ids.max() < len(VOCAB)


def test_bert_serving_takes_raw_strings_through_a_wordpiece_vocab(tmp_path, vocab_txt):
    """models/bert.py's raw-string signature, unchanged, on a vocab.txt: saved and loaded."""
    from tfpod.models import bert

    cfg = bert.BertConfig(vocab_size=64, seq_len=16, max_predictions=4, num_layers=1, hidden_size=32, num_heads=2,
                          intermediate_size=64)
    model = bert.TASK.build(cfg)
    example = {k: tf.zeros([1] + list(s.shape[1:]), s.dtype) for k, s in bert.TASK.input_signature(cfg).items()}
    model(bert.TASK.model_inputs(example), training=False)
    module, signatures = bert.serving(model, cfg, bert_data.BertDataConfig(format="text", vocab_path=vocab_txt))
    texts = tf.constant(["the quick [MASK] fox", "hello [MASK] [MASK] world", "no masks"])
    out = signatures["serving_default"](text=texts)
    assert out["num_masks"].numpy().tolist() == [1, 2, 0]
    best = out["predicted_ids"].numpy()
    pieces = [[VOCAB[i] if i < len(VOCAB) and j < n else "" for j, i in enumerate(row)]
              for row, n in zip(best, [1, 2, 0])]  # the model's padded ids past vocab.txt have no piece
    assert out["predicted_tokens"].numpy().astype(str).tolist() == pieces
    tf.saved_model.save(module, str(tmp_path / "export"), signatures=signatures)
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    again = loaded.signatures["serving_default"](text=texts)
    np.testing.assert_allclose(again["masked_lm_logits"].numpy(), out["masked_lm_logits"].numpy(), rtol=1e-5, atol=1e-6)
