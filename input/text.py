"""Text transforms for tf.data: documents -> token ids -> fixed-shape training rows.

Everything here runs inside the TensorFlow graph (no py_function), keeps element order
(deterministic), and works on whole blocks of documents at a time rather than on single
tokens, so one CPU core packs hundreds of thousands of tokens per second.

THE DATA CONTRACT
=================

Token ids are non-negative (the packers pad document batches with -1 internally).
Stages and what they yield, per element (shapes exclude the batch dimension that the
caller adds later with `ds.batch(..., drop_remainder=True)`):

`tokenize(ds, tokenizer, eos_id)`
  in:  scalar tf.string, one document.
  out: [None] int32 token ids of that document followed by one `eos_id`. An empty
       document yields `[eos_id]`.

`pack_concat(ds, seq_len)`: causal LM, no padding, no segments.
  in:  [None] int32 documents (EOS already appended by `tokenize`).
  out: {"inputs":  [seq_len] int32,
        "targets": [seq_len] int32,
        "weights": [seq_len] float32 (all ones)}
  All documents are concatenated into one token stream that is cut into consecutive,
  non-overlapping chunks of seq_len + 1 tokens; for chunk c, inputs = c[:-1] and
  targets = c[1:]. Attention crosses document boundaries (the EOS token marks them).
  Chunk i starts at stream token i * (seq_len + 1); the last, partial chunk is dropped.
  Example, seq_len=3, E=eos: docs [1,2,3,E] [4,5,E] [6,7,8,9,E] -> chunks
  [1,2,3,E] [4,5,E,6] [7,8,9,E] -> first row inputs [1,2,3], targets [2,3,E].

`pack_segments(ds, seq_len, pad_id)`: causal LM with per-document segments.
  in:  [None] int32 documents.
  out: {"inputs":      [seq_len] int32 (pad_id in padding),
        "targets":     [seq_len] int32 (pad_id in padding),
        "weights":     [seq_len] float32 (1 real, 0 padding),
        "segment_ids": [seq_len] int32 (1, 2, ... per document piece in the row; 0 padding),
        "positions":   [seq_len] int32 (0, 1, ... restarting at every segment; 0 padding)}
  A document d of n tokens has n - 1 (input, target) pairs (d[t], d[t+1]). A document
  with more than seq_len pairs is split into pieces of seq_len pairs (the last piece
  holds the rest); consecutive pieces share one boundary token, so piece j is
  d[j*seq_len : j*seq_len + seq_len + 1] and every pair of the document is trained
  exactly once. A piece of L tokens fills L - 1 consecutive slots of a row with inputs
  piece[:-1], targets piece[1:], one segment id, positions 0..L-2. Pieces go into rows
  in input order (next-fit): a piece joins the open row if its pairs still fit in the
  seq_len slots, otherwise the open row is emitted, padded, and the piece starts a new
  row. Documents of fewer than 2 tokens have no pairs and are dropped. The last row is
  emitted padded when the input ends. Targets never cross a segment boundary: a model
  must restrict attention to equal segment_ids and may use `positions` for position
  embeddings.
  Example, seq_len=4: docs [1,2,3,4] [5,6] [7,8,9] -> rows
  inputs [1,2,3,5] targets [2,3,4,6] segment_ids [1,1,1,2] positions [0,1,2,0] weights [1,1,1,1];
  inputs [7,8,0,0] targets [8,9,0,0] segment_ids [1,1,0,0] positions [0,1,0,0] weights [1,1,0,0].

`mask_for_mlm(ds, seq_len, ...)`: BERT masked LM; names and dtypes of Google's
  create_pretraining_data.py, as read by tf-models-official's BERT pretraining loader.
  in:  [None] int32 token ids of one text segment (no special tokens).
  out: {"input_ids":           [seq_len] int32: [CLS] tokens[:seq_len-2] [SEP], then pad_id,
                                 with the selected tokens replaced (see below),
        "input_mask":          [seq_len] int32: 1 for [CLS], tokens and [SEP], 0 padding,
        "segment_ids":         [seq_len] int32: all 0 (one segment),
        "masked_lm_positions": [max_predictions] int32: selected positions, ascending, 0 padding,
        "masked_lm_ids":       [max_predictions] int32: original ids there, pad_id padding,
        "masked_lm_weights":   [max_predictions] float32: 1 per prediction, 0 padding}
  Per row, min(max_predictions, ceil(mask_rate * n)) of the n selectable tokens are
  chosen at random; [CLS], [SEP] and pad_id are never chosen. A chosen token becomes
  [MASK] with probability 0.8, a uniformly random id in [0, vocab_size) with 0.1, and
  stays unchanged with 0.1. Randomness is stateless, keyed by (seed, index of the
  internal batch): the same seed, input order and batch_size give the same masks on
  every run and with any number of parallel calls. The batch index counts from 0 each
  time the returned dataset is iterated, so `mask_for_mlm(ds.repeat(), ...)` draws fresh
  masks every epoch, while `mask_for_mlm(ds, ...).repeat()` replays the same masks.
"""

from __future__ import annotations

import dataclasses
import re

import tensorflow as tf
import tensorflow_text as tf_text

from tfpod import UserError

_AUTOTUNE = tf.data.AUTOTUNE


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name}={value!r} must be a positive integer")


def read_vocabulary(vocab_path: str, kind: str, fix: str) -> bytes:
    """A vocabulary file's bytes; one UserError line (naming `kind` and `fix`) when it is
    missing, unreadable or empty."""
    if not tf.io.gfile.exists(vocab_path):
        raise UserError(f"{kind} vocabulary {vocab_path} does not exist: {fix}")
    try:
        with tf.io.gfile.GFile(vocab_path, "rb") as f:
            raw = f.read()
    except (tf.errors.OpError, OSError) as e:
        raise UserError(f"{kind} vocabulary {vocab_path} cannot be read ({type(e).__name__}): {fix}") from None
    if not raw.strip():
        raise UserError(f"{kind} vocabulary {vocab_path} is empty: {fix}")
    return raw


def load_tokenizer(vocab_path: str, lower_case: bool = True):
    """Loads a vocabulary as an in-graph tokenizer: a SentencePiece model, or a WordPiece vocab.txt.

    A path ending in `.txt` is a WordPiece vocabulary (`WordPieceTokenizer`: Google
    BERT's and the Hugging Face Hub's vocab.txt); any other file a SentencePiece model.
    Both give the same interface: tokenize (a string -> [pieces] int32 ids, strings ->
    ragged [batch, (pieces)]), detokenize, id_to_string, string_to_id and vocab_size.

    Args:
      vocab_path: the SentencePiece `.model` file or the WordPiece `vocab.txt` (any
        tf.io.gfile filesystem).
      lower_case: WordPiece only: lower-case and strip accents first (uncased BERT
        vocabularies; False for cased ones). A SentencePiece model normalizes as it was trained.

    Returns:
      A tokenizer producing int32 ids, without BOS/EOS (`tokenize` appends EOS).

    Raises:
      UserError: the file is missing, empty, unreadable, or not a vocabulary of its kind.
    """
    if not vocab_path:
        raise UserError("no vocabulary file is given (lm_data.format='ids' reads token ids without one): "
                        "set the data config's vocab_path to a SentencePiece .model or a WordPiece vocab.txt")
    if vocab_path.endswith(".txt"):
        return WordPieceTokenizer.load(vocab_path, lower_case)
    fix = "run python -m tfpod.input.prepare or set lm_data.vocab_path to a SentencePiece .model file"
    model = read_vocabulary(vocab_path, "SentencePiece", fix)
    try:
        tokenizer = tf_text.SentencepieceTokenizer(model=model, out_type=tf.int32, add_eos=False)
        tokenizer.tokenize(tf.constant(["a"]))  # forces the model to load and parse
    except (tf.errors.OpError, ValueError, TypeError) as e:
        raise UserError(
            f"SentencePiece vocabulary {vocab_path} is not a SentencePiece model "
            f"({len(model)} bytes that SentencePiece cannot load: {type(e).__name__}): {fix}"
        ) from None
    return tokenizer


@dataclasses.dataclass(frozen=True)
class _Pieces:
    pieces: tuple[str, ...]
    ids: dict[str, int]


WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # BERT's; kept whole where a text writes them


class WordPieceTokenizer(tf.Module):
    """A WordPiece vocab.txt (BERT's) as an in-graph tokenizer with the SentencePiece one's interface.

    Line i of the file (its trailing newline removed) is the piece of id i; a piece on
    several lines takes its last line's id (as Google BERT's and Hugging Face's loaders
    do). Text is split as BERT's basic tokenizer splits it (whitespace, punctuation, CJK
    characters; lower-cased and accents stripped with `lower_case`), then into the
    longest pieces of the vocabulary (`##` marks a piece inside a word), with
    tensorflow-text's FastBertTokenizer; a word it cannot spell is one [UNK]. The special
    pieces [PAD] [UNK] [CLS] [SEP] [MASK] that the vocabulary has are kept whole where a
    text writes them (case-sensitive), so "a [MASK] b" has the [MASK] id, as a
    SentencePiece model with those user symbols does.

    A tf.Module: a serving signature that uses it saves it with the SavedModel.
    """

    def __init__(self, pieces: list[str], lower_case: bool = True, name_in_errors: str = "vocab.txt"):
        super().__init__(name="wordpiece")
        ids = {p: i for i, p in enumerate(pieces) if p}  # the last line of a repeated piece wins
        if "[UNK]" not in ids:
            raise UserError(f"WordPiece vocabulary {name_in_errors} has no [UNK] line: a BERT vocab.txt has [PAD] "
                            "[UNK] [CLS] [SEP] [MASK]; add [UNK] or give the vocabulary the model was trained with")
        self._vocab = _Pieces(tuple(pieces), ids)  # plain data: a tf.Module would track (and walk) a list
        self.lower_case = lower_case
        self.unk_id = ids["[UNK]"]
        # FastBertTokenizer takes each piece once: a blank line or an earlier copy of a piece gets a
        # stand-in with a space, which no word (split at whitespace) can match.
        unique = [p if p and ids[p] == i else f"[tfpod unused {i}]" for i, p in enumerate(pieces)]
        try:
            self._bert = tf_text.FastBertTokenizer(vocab=unique, token_out_type=tf.int64, unknown_token="[UNK]",
                                                   support_detokenization=True,
                                                   lower_case_nfd_strip_accents=lower_case)
        except RuntimeError as e:  # e.g. no piece a word can be made of
            raise UserError(f"WordPiece vocabulary {name_in_errors} cannot make a tokenizer ({str(e).strip()}): give "
                            "the vocab.txt published with the model") from None
        self._specials = "|".join(re.escape(p) for p in WORDPIECE_SPECIALS if p in ids)  # [UNK] at least
        self._table = tf.lookup.StaticHashTable(  # piece -> id
            tf.lookup.KeyValueTensorInitializer(tf.constant(list(ids)), tf.constant(list(ids.values()), tf.int32)),
            default_value=self.unk_id)

    @classmethod
    def load(cls, vocab_path: str, lower_case: bool = True) -> WordPieceTokenizer:
        """The tokenizer of a vocab.txt file (one piece per line, UTF-8).

        Raises:
          UserError: the file is missing, unreadable, empty, not UTF-8 text, or has no [UNK].
        """
        fix = "give a WordPiece vocab.txt (one piece per line, as published with BERT), or a SentencePiece .model"
        raw = read_vocabulary(vocab_path, "WordPiece", fix)
        try:
            content = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"WordPiece vocabulary {vocab_path} is not UTF-8 text (byte {e.start} of {len(raw)}; "
                            f"a SentencePiece model is named *.model): {fix}") from None
        if "\x00" in content:
            raise UserError(f"WordPiece vocabulary {vocab_path} is binary (NUL bytes; a SentencePiece model is "
                            f"named *.model): {fix}")
        pieces = content.split("\n")
        if pieces[-1] == "":
            pieces.pop()  # the last line's newline
        return cls([p.rstrip("\r") for p in pieces], lower_case, vocab_path)

    @property
    def pieces(self) -> tuple[str, ...]:
        """The piece of each id (the file's lines)."""
        return self._vocab.pieces

    @property
    def ids(self) -> dict[str, int]:
        """{piece: id} (a repeated piece: its last line's id; blank lines are no piece)."""
        return self._vocab.ids

    def vocab_size(self) -> tf.Tensor:
        """The number of ids (lines of the file): an int32 scalar."""
        return tf.constant(len(self.pieces), tf.int32)

    def tokenize(self, texts) -> tf.Tensor | tf.RaggedTensor:
        """A string -> [pieces] int32 ids; strings [batch] -> ragged [batch, (pieces)] int32."""
        texts = tf.convert_to_tensor(texts, tf.string)
        if texts.shape.rank == 0:
            return self.tokenize(texts[tf.newaxis])[0]
        parts = tf_text.regex_split(texts, self._specials, self._specials)  # [batch, (parts)]: specials alone
        flat = parts.flat_values  # [P]
        special = tf.strings.regex_full_match(flat, self._specials)  # [P]
        words = tf.cast(self._bert.tokenize(tf.where(special, "", flat)), tf.int32)  # [P, (pieces)], specials empty
        marks = tf.RaggedTensor.from_row_lengths(self._table.lookup(tf.boolean_mask(flat, special)),
                                                 tf.cast(special, tf.int64))  # [P, (0 or 1)]
        return parts.with_flat_values(tf.concat([words, marks], axis=1)).merge_dims(1, 2)  # [batch, (pieces)]

    def detokenize(self, ids) -> tf.Tensor:
        """[pieces] ids -> a string; [batch, (pieces)] -> [batch] strings: words joined by spaces
        (`##` pieces joined to their word; lower-casing and punctuation splitting are not undone)."""
        return self._bert.detokenize(ids)

    def id_to_string(self, ids) -> tf.Tensor:
        """Each id's piece, in the ids' shape; "" for an id outside [0, vocab_size)."""
        ids = tf.convert_to_tensor(ids)
        size = len(self.pieces)
        pieces = tf.gather(tf.constant(self.pieces), tf.clip_by_value(tf.cast(ids, tf.int32), 0, size - 1))
        return tf.where((ids >= 0) & (ids < size), pieces, "")

    def string_to_id(self, strings) -> tf.Tensor:
        """Each piece's id (int32, in the strings' shape); the [UNK] id for a string that is not a piece."""
        return self._table.lookup(tf.convert_to_tensor(strings, tf.string))


def frame(ids: tf.RaggedTensor, eos_id: int | None, bos_id: int | None = None) -> tf.RaggedTensor:
    """[B, (n)] int32 documents with `bos_id` put before and `eos_id` after each (None: nothing)."""
    rows = tf.fill([ids.nrows(out_type=tf.int32), 1], 0)
    edge = lambda token: tf.RaggedTensor.from_tensor(rows + token, row_splits_dtype=ids.row_splits.dtype)
    parts = ([edge(bos_id)] if bos_id is not None else []) + [ids] + ([edge(eos_id)] if eos_id is not None else [])
    return tf.concat(parts, axis=1) if len(parts) > 1 else ids


def tokenize(
    ds: tf.data.Dataset,
    tokenizer: tf_text.SentencepieceTokenizer | WordPieceTokenizer,
    eos_id: int | None,
    batch_size: int = 64,
    num_parallel_calls: int = _AUTOTUNE,
    bos_id: int | None = None,
) -> tf.data.Dataset:
    """Tokenizes documents and appends EOS to each (and puts BOS before each), in input order.

    Args:
      ds: yields scalar tf.string documents.
      tokenizer: e.g. from `load_tokenizer`.
      eos_id: id appended to every document (None: none).
      batch_size: documents tokenized per call (the last batch may be smaller).
      num_parallel_calls: parallel tokenizer calls; output order is kept regardless.
      bos_id: id put before every document (None: none).

    Returns:
      Dataset of [None] int32 token ids, one element per document.
    """
    _check_positive(batch_size=batch_size)

    def tokenize_batch(docs: tf.Tensor) -> tf.RaggedTensor:
        return frame(tf.cast(tokenizer.tokenize(docs), tf.int32), eos_id, bos_id)  # [B, ([bos] tokens [eos])]

    ds = ds.batch(batch_size).map(tokenize_batch, num_parallel_calls=num_parallel_calls, deterministic=True)
    # Unbatched rows of a ragged batch are plain tensors with a RaggedTensorSpec of ragged_rank 0;
    # the identity map restates them as TensorSpec([None], tf.int32).
    return ds.unbatch().map(tf.identity)


def _doc_batches(ds: tf.data.Dataset, size: int) -> tf.data.Dataset:
    """Documents -> [B, longest] int32 batches padded with -1 (read back by `_docs`).

    padded_batch copies documents natively; ragged_batch would run a function per document,
    which costs more than the packing itself on short documents.
    """
    spec = ds.element_spec
    if isinstance(spec, tf.RaggedTensorSpec) and spec.ragged_rank == 0:
        ds = ds.map(tf.identity)  # rows of an unbatched RaggedTensor: restate them as plain tensors
    elif not isinstance(spec, tf.TensorSpec) or spec.shape.rank != 1 or not spec.dtype.is_integer:
        raise UserError(f"documents must be 1-D integer token id tensors, got element_spec {spec}")
    docs = ds.map(lambda d: tf.cast(d, tf.int32)) if spec.dtype != tf.int32 else ds
    return docs.padded_batch(size, padded_shapes=[None], padding_values=-1)


def _docs(batch: tf.Tensor) -> tf.RaggedTensor:
    """[B, longest] batch from `_doc_batches` -> [B, (tokens)] documents (ids are >= 0)."""
    return tf.RaggedTensor.from_tensor(batch, padding=-1)


def pack_concat(ds: tf.data.Dataset, seq_len: int, block_docs: int = 64) -> tf.data.Dataset:
    """Concatenates documents into one stream and cuts it into causal-LM rows.

    Args:
      ds: yields [None] int32 documents (EOS appended).
      seq_len: tokens per row; each row consumes seq_len + 1 stream tokens.
      block_docs: documents concatenated per step (speed only; the output is the same).

    Returns:
      Dataset of {"inputs", "targets": [seq_len] int32, "weights": [seq_len] float32};
      see the module docstring. The final partial chunk is dropped.
    """
    _check_positive(seq_len=seq_len, block_docs=block_docs)
    chunk = seq_len + 1

    def cut(leftover: tf.Tensor, batch: tf.Tensor):
        stream = tf.concat([leftover, _docs(batch).flat_values], axis=0)  # [n]
        end = tf.size(stream) // chunk * chunk
        chunks = tf.reshape(stream[:end], [-1, chunk])  # [n // chunk, seq_len + 1]
        return stream[end:], chunks

    def to_features(chunks: tf.Tensor) -> dict[str, tf.Tensor]:
        return {
            "inputs": chunks[:, :-1],
            "targets": chunks[:, 1:],
            "weights": tf.ones(tf.shape(chunks[:, 1:]), tf.float32),
        }

    chunks = _doc_batches(ds, block_docs).scan(tf.zeros([0], tf.int32), cut)
    return chunks.map(to_features, num_parallel_calls=_AUTOTUNE, deterministic=True).unbatch()


def _max_or_zero(values: tf.Tensor) -> tf.Tensor:
    """Largest of the non-negative int32 `values`, 0 when there are none."""
    return tf.reduce_max(tf.concat([[0], values], axis=0))


def _next_fit(piece_pairs: tf.Tensor, used: tf.Tensor, segments: tf.Tensor, seq_len: int):
    """Assigns pieces, in order, to rows of seq_len slots; row 0 is the open row.

    Args:
      piece_pairs: [P] int32 slots each piece needs (1..seq_len).
      used: slots already taken in the open row.
      segments: segments already in the open row.
      seq_len: slots per row.

    Returns:
      (row [P] int32, segment id within its row [P] int32).
    """

    def place(state, pairs):
        row, used, segment = state
        new_row = used + pairs > seq_len
        return (
            tf.where(new_row, row + 1, row),
            tf.where(new_row, pairs, used + pairs),
            tf.where(new_row, 1, segment + 1),
        )

    rows, _, segment_ids = tf.scan(place, piece_pairs, initializer=(tf.constant(0), used, segments))
    return rows, segment_ids


def pack_segments(ds: tf.data.Dataset, seq_len: int, pad_id: int = 0, block_docs: int = 64) -> tf.data.Dataset:
    """Packs whole documents into padded rows with segment ids and positions.

    Args:
      ds: yields [None] int32 documents (EOS appended).
      seq_len: slots per row.
      pad_id: inputs and targets in padding slots.
      block_docs: documents packed per step (speed only; the output is the same).

    Returns:
      Dataset of {"inputs", "targets", "segment_ids", "positions": [seq_len] int32,
      "weights": [seq_len] float32}; see the module docstring for the packing rule.
    """
    _check_positive(seq_len=seq_len, block_docs=block_docs)
    fields = ("inputs", "targets", "segment_ids", "positions")
    end = tf.data.Dataset.from_tensors((tf.zeros([0, 0], tf.int32), True))  # flushes the open row
    blocks = _doc_batches(ds, block_docs).map(lambda batch: (batch, False)).concatenate(end)

    def pack(open_row: dict[str, tf.Tensor], block):
        batch, last = block
        docs = _docs(batch)  # [B, (n)]
        inputs, targets = docs[:, :-1], docs[:, 1:]  # [B, (n - 1)] pairs
        pairs = tf.cast(inputs.row_lengths(), tf.int32)  # [B]
        pair_index = tf.ragged.range(pairs).flat_values  # [pairs] index within its document
        pieces = (pairs + seq_len - 1) // seq_len  # [B]
        first_piece = tf.cumsum(pieces, exclusive=True)  # [B]
        piece = tf.gather(first_piece, inputs.value_rowids()) + pair_index // seq_len  # [pairs]
        piece_pairs = tf.math.unsorted_segment_sum(tf.ones_like(piece), piece, tf.reduce_sum(pieces))  # [P]
        piece_row, piece_segment = _next_fit(
            piece_pairs, tf.size(open_row["inputs"]), _max_or_zero(open_row["segment_ids"]), seq_len
        )
        # Slots of the open row first, then this block's, all in row order: [slots].
        slots = {
            "inputs": tf.concat([open_row["inputs"], inputs.flat_values], 0),
            "targets": tf.concat([open_row["targets"], targets.flat_values], 0),
            "segment_ids": tf.concat([open_row["segment_ids"], tf.gather(piece_segment, piece)], 0),
            "positions": tf.concat([open_row["positions"], pair_index % seq_len], 0),
        }
        row = tf.concat([tf.zeros_like(open_row["inputs"]), tf.gather(piece_row, piece)], 0)
        num_rows = _max_or_zero(piece_row) + 1  # the last one is still open
        row_slots = tf.math.bincount(row, minlength=num_rows)  # [num_rows]
        column = tf.range(tf.size(row)) - tf.gather(tf.cumsum(row_slots, exclusive=True), row)
        done = num_rows - 1 + tf.cast(last & (row_slots[-1] > 0), tf.int32)
        emit = row < done
        index = tf.stack([tf.boolean_mask(row, emit), tf.boolean_mask(column, emit)], axis=1)  # [emitted, 2]
        shape = tf.stack([done, seq_len])

        def scatter(values: tf.Tensor, pad) -> tf.Tensor:
            rows = tf.tensor_scatter_nd_update(tf.fill(shape, pad), index, tf.boolean_mask(values, emit))
            return tf.reshape(rows, [-1, seq_len])  # [done, seq_len]

        out = {k: scatter(slots[k], pad_id if k in ("inputs", "targets") else 0) for k in fields}
        out["weights"] = scatter(tf.ones(tf.shape(row), tf.float32), 0.0)
        return {k: tf.boolean_mask(slots[k], ~emit) for k in fields}, out

    initial = {k: tf.zeros([0], tf.int32) for k in fields}
    return blocks.scan(initial, pack).unbatch()


def mask_for_mlm(
    ds: tf.data.Dataset,
    seq_len: int,
    vocab_size: int,
    mask_id: int,
    cls_id: int,
    sep_id: int,
    pad_id: int = 0,
    max_predictions: int = 20,
    mask_rate: float = 0.15,
    seed: int = 0,
    batch_size: int = 64,
) -> tf.data.Dataset:
    """BERT dynamic masking ([CLS] x [SEP], 80% [MASK] / 10% random / 10% kept).

    Args:
      ds: yields [None] int32 token ids of one segment (no special tokens).
      seq_len: row length, [CLS] and [SEP] included; longer segments are truncated.
      vocab_size: random replacements are drawn from [0, vocab_size).
      mask_id, cls_id, sep_id, pad_id: special token ids.
      max_predictions: most masked positions per row.
      mask_rate: fraction of a row's tokens selected for prediction (rounded up).
      seed: masks are a function of (seed, input order, batch_size) only.
      batch_size: rows masked per step (speed; it keys the randomness).

    Returns:
      Dataset of the create_pretraining_data.py features; see the module docstring.
    """
    _check_positive(seq_len=seq_len, max_predictions=max_predictions, batch_size=batch_size)
    if seq_len < 3:
        raise UserError(f"seq_len={seq_len} leaves no room for tokens between [CLS] and [SEP]: use at least 3")
    if not 0.0 < mask_rate <= 1.0:
        raise UserError(f"mask_rate={mask_rate} must be in (0, 1]")

    def mask(index: tf.Tensor, batch: tf.Tensor) -> dict[str, tf.Tensor]:
        # Dense ops that draw exactly what tf_text's RandomItemSelector and mask_language_model
        # drew over the ragged rows [CLS] tokens [SEP] (same keys, same flat order), at a
        # fraction of their trace cost.
        size, width = tf.shape(batch, tf.int64)[0], tf.shape(batch)[1]  # B, longest
        column = tf.range(seq_len)  # [seq_len]
        # Tokens per row, up to the last id that is not -1 padding (as `_docs` reads them);
        # clipping also gives 0 for a [B, 0] batch of empty documents.
        n = tf.reduce_max(tf.where(batch != -1, tf.range(1, width + 1), 0), axis=1, keepdims=True)  # [B, 1]
        n = tf.clip_by_value(n, 0, seq_len - 2)
        tokens = tf.pad(batch[:, : seq_len - 2], [[0, 0], [1, seq_len - 1 - tf.minimum(width, seq_len - 2)]])
        # [B, seq_len]: [CLS] tokens [SEP] pad_id...; token t is at column t + 1.
        rows = tf.where(column == 0, cls_id, tf.where(column <= n, tokens, tf.where(column == n + 1, sep_id, pad_id)))
        in_row = column < n + 2  # [B, seq_len]: not padding
        slots = tf.where(in_row)  # [T, 2] (row, column), row-major: the order the random keys are drawn in
        key = tf.random.experimental.stateless_split(tf.stack([tf.constant(seed, tf.int64), index]), 2)  # [2, 2]
        order = tf.random.stateless_uniform(tf.shape(slots)[:1], key[0])  # [T] a sort key in [0, 1) per token
        order = tf.scatter_nd(slots, order, [size, seq_len])  # [B, seq_len]

        # Selection: num of a row's selectable tokens, those first by `order` (ties: the lower
        # column first, as argsort breaks them); [CLS], [SEP] and pad_id (padding too) never.
        selectable = (rows != cls_id) & (rows != sep_id) & (rows != pad_id)  # [B, seq_len]
        count = tf.reduce_sum(tf.cast(selectable, tf.float32), axis=1)  # [B]
        num = tf.minimum(tf.math.ceil(count * mask_rate), max_predictions)  # [B] float32 arithmetic, as tf_text
        by_order = tf.argsort(tf.where(selectable, order, 2.0))  # [B, seq_len] columns, unselectable last
        selected = tf.argsort(by_order) < tf.cast(num, tf.int32)[:, None]  # [B, seq_len]: rank < num
        picks = tf.where(selected)  # [S, 2] (row, column), row-major
        labels = tf.gather_nd(rows, picks)  # [S] original ids

        # 80% [MASK], 10% a random id, 10% unchanged, keyed by the flat index of the pick.
        seeds = tf.random.experimental.stateless_split(key[1], 2)  # [2, 2]
        u = tf.random.stateless_uniform(tf.shape(labels), seeds[0])  # [S]
        random_ids = tf.random.stateless_uniform(tf.shape(labels), seeds[1], 0, vocab_size, tf.int32)  # [S]
        values = tf.where(u < 0.8, mask_id, tf.where(u < 0.9, random_ids, labels))  # [S]

        # Predictions fill slots 0.. of their row in ascending column order.
        slot = tf.gather_nd(tf.cumsum(tf.cast(selected, tf.int64), axis=1, exclusive=True), picks)  # [S]
        predictions = tf.stack([picks[:, 0], slot], axis=1)  # [S, 2] (row, slot)
        shape = [size, max_predictions]
        return {
            "input_ids": tf.tensor_scatter_nd_update(rows, picks, values),
            "input_mask": tf.cast(in_row, tf.int32),
            "segment_ids": tf.zeros_like(rows),
            "masked_lm_positions": tf.scatter_nd(predictions, tf.cast(picks[:, 1], tf.int32), shape),
            "masked_lm_ids": tf.tensor_scatter_nd_update(tf.fill(shape, pad_id), predictions, labels),
            "masked_lm_weights": tf.scatter_nd(predictions, tf.ones(tf.shape(labels)), shape),
        }

    batches = _doc_batches(ds, batch_size).enumerate()
    return batches.map(mask, num_parallel_calls=_AUTOTUNE, deterministic=True).unbatch()


def pack_documents(ds: tf.data.Dataset, seq_len: int, pad_id: int = 0) -> tf.data.Dataset:
    """Evaluation rows: each document packed on its own, every next-token pair exactly once.

    A document d of n tokens has n - 1 pairs (d[t], d[t+1]); row j holds pairs
    j*seq_len .. j*seq_len + seq_len - 1 (so rows share one boundary token), and the
    last row is padded with pad_id and weight 0. Unlike concatenation, the rows do not
    depend on which documents a host reads or in what order, so an eval set split over
    any number of hosts has the same examples.

    Args:
      ds: [None] int32 documents (EOS appended).
      seq_len: row length.
      pad_id: id in padding slots.

    Returns:
      Rows {"inputs", "targets": [seq_len] int32, "weights": [seq_len] float32}.
    """
    _check_positive(seq_len=seq_len)

    def rows(doc):
        doc = tf.cast(doc, tf.int32)
        pairs = tf.size(doc) - 1
        n = (pairs + seq_len - 1) // seq_len  # rows of this document
        padded = tf.pad(doc, [[0, n * seq_len + 1 - tf.size(doc)]], constant_values=pad_id)
        inputs = tf.reshape(padded[:-1], [n, seq_len])  # [rows, seq_len]
        targets = tf.reshape(padded[1:], [n, seq_len])
        weights = tf.reshape(tf.cast(tf.range(n * seq_len) < pairs, tf.float32), [n, seq_len])
        return tf.data.Dataset.from_tensor_slices({"inputs": inputs, "targets": targets, "weights": weights})

    return ds.filter(lambda d: tf.size(d) > 1).flat_map(rows)
