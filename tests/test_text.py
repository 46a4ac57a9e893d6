"""tfpod.input.text: tokenizer loading, tokenizing, packing and BERT masking.

Packing is checked on literal examples and against plain-Python reference packers on
random documents with block sizes that put block boundaries mid-row.
"""

import io
import math

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf

from tfpod import UserError
from tfpod.input import text


EOS = 99
WORDS = "the quick brown fox jumps over lazy dog and cat runs far away into deep green forest".split()


def docs_ds(docs):
    """A dataset of 1-D int32 documents (any lengths, empty ones included)."""
    return tf.data.Dataset.from_generator(
        lambda: iter([np.asarray(d, np.int32) for d in docs]),
        output_signature=tf.TensorSpec([None], tf.int32),
    )


def rows(ds):
    return [{k: v.numpy().tolist() for k, v in x.items()} for x in ds]


def random_docs(seed, n, max_len, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=rng.integers(0, max_len + 1)).tolist() for _ in range(n)]


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 20))) for _ in range(1000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=40, model_type="unigram",
        pad_id=0, unk_id=1, bos_id=-1, eos_id=2, minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "tiny.model"
    path.write_bytes(buf.getvalue())
    return str(path), lines


@pytest.mark.unit
def test_load_tokenizer_matches_sentencepiece(sp_model):
    path, lines = sp_model
    tokenizer = text.load_tokenizer(path)
    reference = spm.SentencePieceProcessor(model_file=path)
    assert int(tokenizer.vocab_size()) == 40
    for line in lines[:20]:
        ids = tokenizer.tokenize(line)
        assert ids.dtype == tf.int32
        assert ids.numpy().tolist() == reference.encode(line)


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("missing.model", None, "does not exist"),
        ("empty.model", b"", "is empty"),
        ("random.model", bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)),
         "is not a SentencePiece model"),
        ("text.model", b"hello\tworld\nthis is a plain text vocabulary\n", "is not a SentencePiece model"),
        ("proto.model", b"\n\x00", "is not a SentencePiece model"),
        ("a_directory", "dir", "cannot be read"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "",
)
@pytest.mark.unit
def test_load_tokenizer_bad_file_is_one_line_user_error(tmp_path, name, content, needle):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError) as e:
        text.load_tokenizer(str(path))
    msg = str(e.value)
    assert needle in msg
    assert str(path) in msg
    assert "python -m tfpod.input.prepare" in msg and "lm_data.vocab_path" in msg
    assert "\n" not in msg


@pytest.mark.unit
def test_tokenize_appends_eos_and_keeps_order(sp_model):
    path, lines = sp_model
    tokenizer = text.load_tokenizer(path)
    reference = spm.SentencePieceProcessor(model_file=path)
    docs = lines[:45] + [""] + lines[45:60]
    out = text.tokenize(tf.data.Dataset.from_tensor_slices(docs), tokenizer, eos_id=2, batch_size=7)
    assert out.element_spec == tf.TensorSpec([None], tf.int32)
    got = [x.numpy().tolist() for x in out]
    assert got == [reference.encode(d) + [2] for d in docs]
    assert got[45] == [2]


# ---------------------------------------------------------------- pack_concat


def ref_concat(docs, seq_len):
    stream = [t for d in docs for t in d]
    n = len(stream) // (seq_len + 1)
    chunks = [stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)] for i in range(n)]
    return [{"inputs": c[:-1], "targets": c[1:], "weights": [1.0] * seq_len} for c in chunks]


@pytest.mark.unit
@pytest.mark.parametrize("block_docs", [1, 2, 3, 64])
def test_pack_concat_literal(block_docs):
    docs = [[1, 2, 3, EOS], [4, 5, EOS], [6, 7, 8, 9, EOS], [10, 11]]  # the last 2 tokens are dropped
    out = text.pack_concat(docs_ds(docs), seq_len=3, block_docs=block_docs)
    assert out.element_spec == {
        "inputs": tf.TensorSpec([3], tf.int32),
        "targets": tf.TensorSpec([3], tf.int32),
        "weights": tf.TensorSpec([3], tf.float32),
    }
    assert rows(out) == [
        {"inputs": [1, 2, 3], "targets": [2, 3, EOS], "weights": [1.0, 1.0, 1.0]},
        {"inputs": [4, 5, EOS], "targets": [5, EOS, 6], "weights": [1.0, 1.0, 1.0]},
        {"inputs": [7, 8, 9], "targets": [8, 9, EOS], "weights": [1.0, 1.0, 1.0]},
    ]


@pytest.mark.unit
@pytest.mark.parametrize("block_docs,seq_len", [(1, 7), (3, 16), (5, 64), (64, 33)])
def test_pack_concat_matches_reference(block_docs, seq_len):
    docs = random_docs(seed=block_docs, n=120, max_len=40)
    got = rows(text.pack_concat(docs_ds(docs), seq_len=seq_len, block_docs=block_docs))
    want = ref_concat(docs, seq_len)
    assert len(want) > 3
    assert got == want


@pytest.mark.unit
def test_pack_concat_long_document_spans_rows_and_short_input_gives_nothing():
    assert rows(text.pack_concat(docs_ds([list(range(1, 10))]), seq_len=2)) == [
        {"inputs": [1, 2], "targets": [2, 3], "weights": [1.0, 1.0]},
        {"inputs": [4, 5], "targets": [5, 6], "weights": [1.0, 1.0]},
        {"inputs": [7, 8], "targets": [8, 9], "weights": [1.0, 1.0]},
    ]
    assert rows(text.pack_concat(docs_ds([[1, 2], [3]]), seq_len=3)) == []
    assert rows(text.pack_concat(docs_ds([]), seq_len=3)) == []


# ---------------------------------------------------------------- pack_segments


def ref_segments(docs, seq_len, pad_id):
    """Next-fit packing of document pieces, written independently of the module."""
    packed, row = [], []  # row: [(input, target, segment, position)]

    def close():
        padding = [(pad_id, pad_id, 0, 0)] * (seq_len - len(row))
        cols = list(zip(*(row + padding)))
        weights = [1.0] * len(row) + [0.0] * (seq_len - len(row))
        packed.append({"inputs": list(cols[0]), "targets": list(cols[1]), "segment_ids": list(cols[2]),
                       "positions": list(cols[3]), "weights": weights})

    segment = 0
    for d in docs:
        for start in range(0, len(d) - 1, seq_len):
            piece = d[start:start + seq_len + 1]
            if len(row) + len(piece) - 1 > seq_len:
                close()
                row, segment = [], 0
            segment += 1
            row += [(piece[i], piece[i + 1], segment, i) for i in range(len(piece) - 1)]
    if row:
        close()
    return packed


@pytest.mark.unit
@pytest.mark.parametrize("block_docs", [1, 2, 64])
def test_pack_segments_literal(block_docs):
    docs = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    out = text.pack_segments(docs_ds(docs), seq_len=4, block_docs=block_docs)
    assert out.element_spec == {
        **{k: tf.TensorSpec([4], tf.int32) for k in ("inputs", "targets", "segment_ids", "positions")},
        "weights": tf.TensorSpec([4], tf.float32),
    }
    assert rows(out) == [
        {"inputs": [1, 2, 3, 5], "targets": [2, 3, 4, 6], "segment_ids": [1, 1, 1, 2],
         "positions": [0, 1, 2, 0], "weights": [1.0, 1.0, 1.0, 1.0]},
        {"inputs": [7, 8, 0, 0], "targets": [8, 9, 0, 0], "segment_ids": [1, 1, 0, 0],
         "positions": [0, 1, 0, 0], "weights": [1.0, 1.0, 0.0, 0.0]},
    ]


@pytest.mark.parametrize("block_docs", [1, 3, 64])
def test_pack_segments_splits_long_documents_and_drops_single_tokens(block_docs):
    docs = [[EOS], list(range(1, 9)), [], [9, 10], [11]]  # 8 tokens = 7 pairs -> pieces of 3, 3, 1 pairs
    got = rows(text.pack_segments(docs_ds(docs), seq_len=3, pad_id=-1, block_docs=block_docs))
    assert got == [
        {"inputs": [1, 2, 3], "targets": [2, 3, 4], "segment_ids": [1, 1, 1],
         "positions": [0, 1, 2], "weights": [1.0, 1.0, 1.0]},
        {"inputs": [4, 5, 6], "targets": [5, 6, 7], "segment_ids": [1, 1, 1],
         "positions": [0, 1, 2], "weights": [1.0, 1.0, 1.0]},
        {"inputs": [7, 9, -1], "targets": [8, 10, -1], "segment_ids": [1, 2, 0],
         "positions": [0, 0, 0], "weights": [1.0, 1.0, 0.0]},
    ]


@pytest.mark.unit
def test_pack_segments_full_last_row_and_empty_input():
    got = rows(text.pack_segments(docs_ds([[1, 2, 3], [4, 5, 6]]), seq_len=2))
    assert [r["inputs"] for r in got] == [[1, 2], [4, 5]]
    assert [r["weights"] for r in got] == [[1.0, 1.0], [1.0, 1.0]]
    assert rows(text.pack_segments(docs_ds([]), seq_len=4)) == []
    assert rows(text.pack_segments(docs_ds([[7], [], [8]]), seq_len=4)) == []


@pytest.mark.unit
@pytest.mark.parametrize("block_docs,seq_len", [(1, 8), (4, 16), (7, 32), (64, 64)])
def test_pack_segments_matches_reference(block_docs, seq_len):
    docs = random_docs(seed=100 + block_docs, n=150, max_len=50)
    got = rows(text.pack_segments(docs_ds(docs), seq_len=seq_len, pad_id=0, block_docs=block_docs))
    assert got == ref_segments(docs, seq_len, pad_id=0)
    # Every pair of every document is trained exactly once.
    assert sum(sum(r["weights"]) for r in got) == sum(max(len(d) - 1, 0) for d in docs)
    for r in got:
        seg, pos, inp, tgt = (np.array(r[k]) for k in ("segment_ids", "positions", "inputs", "targets"))
        np.testing.assert_array_equal(np.array(r["weights"]), (seg > 0).astype(np.float32))
        assert np.all(np.diff(seg[seg > 0]) >= 0)  # segments are consecutive, 1, 2, ...
        same = (seg[1:] == seg[:-1]) & (seg[1:] > 0)
        np.testing.assert_array_equal(inp[1:][same], tgt[:-1][same])  # targets stay in their segment
        np.testing.assert_array_equal(pos[1:][same], pos[:-1][same] + 1)
        np.testing.assert_array_equal(pos[1:][~same & (seg[1:] > 0)], 0)


def test_packers_accept_int64_and_ragged_slices_and_reject_other_elements():
    docs = [[1, 2, 3, EOS], [4, 5, EOS], [6, 7, 8, 9, EOS]]
    want = rows(text.pack_segments(docs_ds(docs), seq_len=4))
    int64 = docs_ds(docs).map(lambda d: tf.cast(d, tf.int64))
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant(docs, dtype=tf.int32))
    assert rows(text.pack_segments(int64, seq_len=4)) == want
    assert rows(text.pack_segments(ragged, seq_len=4)) == want
    with pytest.raises(UserError, match="documents must be 1-D integer token id tensors"):
        text.pack_concat(tf.data.Dataset.range(5), seq_len=4)
    with pytest.raises(UserError, match="documents must be 1-D integer token id tensors"):
        text.pack_segments(tf.data.Dataset.from_tensors(tf.constant(["a b"])), seq_len=4)


@pytest.mark.unit
@pytest.mark.parametrize("fn", [text.pack_concat, text.pack_segments])
def test_pack_rejects_bad_lengths(fn):
    with pytest.raises(UserError, match="seq_len=0 must be a positive integer"):
        fn(docs_ds([[1, 2]]), seq_len=0)
    with pytest.raises(UserError, match="block_docs=0 must be a positive integer"):
        fn(docs_ds([[1, 2]]), seq_len=4, block_docs=0)


# ---------------------------------------------------------------- mask_for_mlm

PAD, CLS, SEP, MASK, VOCAB = 0, 1, 2, 3, 1000
MLM_SPEC = {
    "input_ids": tf.TensorSpec([16], tf.int32),
    "input_mask": tf.TensorSpec([16], tf.int32),
    "segment_ids": tf.TensorSpec([16], tf.int32),
    "masked_lm_positions": tf.TensorSpec([5], tf.int32),
    "masked_lm_ids": tf.TensorSpec([5], tf.int32),
    "masked_lm_weights": tf.TensorSpec([5], tf.float32),
}


def mlm(docs, seq_len=16, max_predictions=5, seed=0, batch_size=64, mask_rate=0.15):
    return text.mask_for_mlm(
        docs_ds(docs), seq_len, VOCAB, MASK, CLS, SEP, pad_id=PAD,
        max_predictions=max_predictions, mask_rate=mask_rate, seed=seed, batch_size=batch_size,
    )


def check_mlm_row(r, tokens, seq_len, max_predictions, mask_rate=0.15):
    """Checks one output row against the tokens it came from; returns the prediction count."""
    body = tokens[: seq_len - 2]
    n = len(body)
    framed = [CLS] + body + [SEP]
    ids, pos = np.array(r["input_ids"]), np.array(r["masked_lm_positions"])
    count = int(sum(r["masked_lm_weights"]))
    assert count == min(max_predictions, math.ceil(np.float32(mask_rate) * np.float32(n)))  # as tf_text rounds
    assert r["masked_lm_weights"] == [1.0] * count + [0.0] * (max_predictions - count)
    assert r["input_mask"] == [1] * (n + 2) + [0] * (seq_len - n - 2)
    assert r["segment_ids"] == [0] * seq_len
    assert ids[0] == CLS and ids[n + 1] == SEP and np.all(ids[n + 2:] == PAD)
    chosen = pos[:count]
    assert np.all(np.diff(chosen) > 0) and np.all(pos[count:] == 0)
    assert np.all((chosen >= 1) & (chosen <= n))  # never [CLS], [SEP] or padding
    assert r["masked_lm_ids"] == [framed[p] for p in chosen] + [PAD] * (max_predictions - count)
    untouched = np.setdiff1d(np.arange(n + 2), chosen)
    np.testing.assert_array_equal(ids[untouched], np.array(framed)[untouched])
    return count


@pytest.mark.unit
def test_mask_for_mlm_literal():
    docs = [list(range(10, 20)), list(range(100, 140)), [42], []]
    out = mlm(docs)
    assert out.element_spec == MLM_SPEC
    got = rows(out)
    assert len(got) == 4
    counts = [check_mlm_row(r, d, 16, 5) for r, d in zip(got, docs)]
    assert counts == [2, 3, 1, 0]  # ceil(0.15 n) with n = 10, 14 (truncated), 1, 0
    assert got[1]["input_ids"][15] == SEP and got[1]["input_mask"] == [1] * 16
    assert got[3]["input_ids"][:3] == [CLS, SEP, PAD]


@pytest.mark.unit
def test_mask_for_mlm_never_selects_special_ids_in_the_text():
    docs = [[CLS, SEP, PAD, 50, 51, CLS, SEP, 52]] * 40
    for r in rows(mlm(docs, mask_rate=1.0)):
        assert sorted(r["masked_lm_positions"][:3]) == [4, 5, 8]
        assert r["masked_lm_ids"][:3] == [50, 51, 52]


@pytest.mark.unit
def test_mask_for_mlm_is_seeded():
    docs = random_docs(seed=3, n=200, max_len=30, vocab=VOCAB)
    first, again = rows(mlm(docs, seed=5, batch_size=16)), rows(mlm(docs, seed=5, batch_size=16))
    assert first == again
    other = rows(mlm(docs, seed=6, batch_size=16))
    assert other != first
    assert [r["input_mask"] for r in other] == [r["input_mask"] for r in first]
    # Batches draw different masks: identical inputs are not masked identically throughout.
    same = rows(mlm([list(range(10, 24))] * 128, batch_size=16))
    assert len({tuple(r["masked_lm_positions"]) for r in same}) > 10


@pytest.mark.unit
def test_mask_for_mlm_statistics():
    seq_len, max_predictions = 128, 20
    rng = np.random.default_rng(11)
    docs = [rng.integers(4, VOCAB, size=rng.integers(20, 300)).tolist() for _ in range(1500)]
    got = rows(mlm(docs, seq_len=seq_len, max_predictions=max_predictions))
    selected = masked = kept = 0
    for r, d in zip(got, docs):
        count = check_mlm_row(r, d, seq_len, max_predictions)
        assert count <= max_predictions
        chosen = r["masked_lm_positions"][:count]
        new = np.array(r["input_ids"])[chosen]
        old = np.array(r["masked_lm_ids"][:count])
        selected += count
        masked += int(np.sum(new == MASK))
        kept += int(np.sum(new == old))
    real = sum(min(len(d), seq_len - 2) for d in docs)
    assert 0.13 < selected / real < 0.16  # 15%, fewer where max_predictions caps long rows
    assert abs(masked / selected - 0.8) < 0.02
    assert abs(kept / selected - 0.1) < 0.015  # random ids rarely equal the original (1/VOCAB)
    assert abs((selected - masked - kept) / selected - 0.1) < 0.015


@pytest.mark.unit
def test_mask_for_mlm_rejects_bad_arguments():
    with pytest.raises(UserError, match="seq_len=2 leaves no room"):
        mlm([[5]], seq_len=2)
    with pytest.raises(UserError, match="mask_rate=0.0 must be in"):
        mlm([[5]], mask_rate=0.0)
    with pytest.raises(UserError, match="max_predictions=0 must be a positive integer"):
        mlm([[5]], max_predictions=0)


@pytest.mark.unit
def test_gpt_attends_only_within_segments_and_restarts_positions():
    """The LM honours segment packing: a segment's logits ignore other segments' tokens."""
    import tf_keras

    from tfpod.models import gpt

    tf_keras.utils.set_random_seed(0)
    cfg = gpt.GPTConfig(vocab_size=32, seq_len=8, num_layers=2, embed_dim=16, num_heads=4, mlp_dim=32)
    model = gpt.TASK.build(cfg)
    seg = tf.constant([[1, 1, 1, 2, 2, 2, 0, 0]])
    pos = tf.constant([[0, 1, 2, 0, 1, 2, 0, 0]])
    a = tf.constant([[5, 6, 7, 9, 10, 11, 0, 0]])
    b = tf.constant([[20, 21, 22, 9, 10, 11, 0, 0]])  # segment 1 changed
    la = model({"inputs": a, "segment_ids": seg, "positions": pos}).numpy()
    lb = model({"inputs": b, "segment_ids": seg, "positions": pos}).numpy()
    np.testing.assert_allclose(la[0, 3:6], lb[0, 3:6], rtol=1e-5, atol=1e-6)  # segment 2 unaffected
    assert np.abs(la[0, :3] - lb[0, :3]).max() > 1e-3
    alone = model({"inputs": tf.constant([[9, 10, 11, 0, 0, 0, 0, 0]]), "segment_ids": tf.constant([[1, 1, 1, 0, 0, 0, 0, 0]]),
                   "positions": tf.constant([[0, 1, 2, 0, 0, 0, 0, 0]])}).numpy()
    np.testing.assert_allclose(la[0, 3:6], alone[0, 0:3], rtol=1e-5, atol=1e-6)  # positions restart per segment
    plain = model(a).numpy()  # without segments the second document sees the first
    assert np.abs(plain[0, 3:6] - la[0, 3:6]).max() > 1e-3


@pytest.mark.unit
def test_pack_documents_literal():
    """Each document alone; rows share a boundary token; the last row is padded with weight 0."""
    docs = [[1, 2, 3, 4, 5, 9], [6, 7, 9], [8]]
    ds = tf.data.Dataset.from_generator(lambda: iter(docs), output_signature=tf.TensorSpec([None], tf.int32))
    rows = [{k: v.numpy().tolist() for k, v in r.items()} for r in text.pack_documents(ds, 3)]
    assert [r["inputs"] for r in rows] == [[1, 2, 3], [4, 5, 9], [6, 7, 9]]  # 9 = EOS, weight 0 after it
    assert [r["targets"] for r in rows] == [[2, 3, 4], [5, 9, 0], [7, 9, 0]]
    assert [r["weights"] for r in rows] == [[1, 1, 1], [1, 1, 0], [1, 1, 0]]
