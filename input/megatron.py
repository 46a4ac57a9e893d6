"""Megatron's indexed datasets (`PREFIX.bin` + `PREFIX.idx`) -> tfpod's token-id records.

MLPerf's Llama 3.1 recipes (and NeMo and Megatron-LM users) keep pre-tokenized C4 as
Megatron "mmap" indexed datasets: `preprocess_data_for_megatron.py` / `preprocess_data.py`
write one `.bin` of every token back to back and one `.idx`:

    b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B (1 uint8 ... 4 int32, 8 uint16),
    sequence count <Q, document count <Q,
    sequence lengths int32[sequences], byte offsets int64[sequences],
    document starts int64[documents] (sequence indices: 0, ..., sequences)

A document is the sequences between two document starts (one sequence unless sentences
were split). `convert` writes them, in order, as `lm_data.format='ids'` TFRecords (one
document a record, contiguous ranges a file, so hosts split the files and an eval set
keeps its order):

    python -m tfpod.input.megatron --from=DIR/c4-validation-91205-samples.en_text_document \\
        --ids_out=DIR/ids --shards=8

Data prepared without `--append-eod` (MLPerf's C4) has nothing between documents;
`lm_data.append_eos=False` trains on the same token stream.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import struct
import sys
from typing import Iterator, Sequence

import numpy as np

from tfpod import UserError

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_FIX = "pass the path prefix of a Megatron .bin/.idx pair (e.g. DIR/c4-train.en_0_text_document)"


class Index:
    """A Megatron `.idx`: the token dtype, each sequence's length and byte offset, and the
    sequence index where each document starts (`document_starts[-1]` = sequences)."""

    def __init__(self, prefix: str):
        path = prefix + ".idx"
        if not os.path.exists(path) or not os.path.exists(prefix + ".bin"):
            missing = path if not os.path.exists(path) else prefix + ".bin"
            raise UserError(f"--from={prefix}: {missing} does not exist: {_FIX}")
        with open(path, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != HEADER:
            raise UserError(f"{path} is not a Megatron mmap index (its header is {head[:9]!r}, not {HEADER!r}): {_FIX}")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in DTYPES or np.dtype(DTYPES[code]).kind not in "iu":
            raise UserError(f"{path}: index version {version} with token dtype code {code}: tfpod reads version 1 "
                            "with integer tokens (codes 1-5, 8)")
        raw = np.memmap(path, mode="r")
        self.dtype = np.dtype(DTYPES[code])
        self.lengths = np.frombuffer(raw, np.int32, sequences, 34)
        self.offsets = np.frombuffer(raw, np.int64, sequences, 34 + 4 * sequences)
        self.document_starts = np.frombuffer(raw, np.int64, documents, 34 + 12 * sequences)
        if documents < 1 or self.document_starts[0] != 0 or self.document_starts[-1] != sequences:
            raise UserError(f"{path}: its document starts do not run from 0 to its {sequences} sequences: the index "
                            "is damaged; prepare it again")

    @property
    def num_documents(self) -> int:
        return len(self.document_starts) - 1


def documents(prefix: str, index: Index | None = None) -> Iterator[np.ndarray]:
    """Each document's tokens (int64), in order (`index`: prefix's, when already read)."""
    index = index or Index(prefix)
    tokens = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r")
    size = index.dtype.itemsize
    for d in range(index.num_documents):
        first, last = index.document_starts[d], index.document_starts[d + 1]
        if first == last:
            yield np.zeros([0], np.int64)
            continue
        start = index.offsets[first] // size
        count = int(index.lengths[first:last].sum())
        yield np.asarray(tokens[start:start + count], np.int64)


def convert(prefixes: Sequence[str], out_dir: str, shards: int = 1) -> dict:
    """Writes the documents of `prefixes` (in order) as `shards` id-record files in out_dir.

    Files are `<prefix name>-NNNNN-of-MMMMM.tfrecord`, each a contiguous range of one
    prefix's documents. Nothing is overwritten.

    Returns:
      {"files": [...], "documents": n, "tokens": n, "max_id": the largest token id}.
    """
    from tfpod.input import lm_data

    if shards < 1:
        raise UserError(f"--shards={shards} must be positive")
    indexes = [(prefix, Index(prefix)) for prefix in prefixes]
    os.makedirs(out_dir, exist_ok=True)
    files, total, tokens, max_id = [], 0, 0, -1
    for prefix, index in indexes:
        name = os.path.basename(prefix)
        bounds = np.linspace(0, index.num_documents, shards + 1).astype(int)
        stream = documents(prefix, index)
        for k in range(shards):
            path = os.path.join(out_dir, f"{name}-{k:05d}-of-{shards:05d}.tfrecord")
            if os.path.exists(path):
                raise UserError(f"{path} exists: write to a new --ids_out folder (nothing is overwritten)")
            seen = []  # (length, largest id) of each document, counted as it streams by

            def counted(n):
                for doc in itertools.islice(stream, n):
                    seen.append((len(doc), int(doc.max()) if len(doc) else -1))
                    yield doc

            total += lm_data.write_ids_records(path, counted(bounds[k + 1] - bounds[k]))
            files.append(path)
            tokens += sum(n for n, _ in seen)
            max_id = max([max_id] + [m for _, m in seen])
    return {"files": files, "documents": total, "tokens": tokens, "max_id": max_id}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfpod.input.megatron", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="prefixes", required=True,
                        help="Megatron .bin/.idx path prefixes, comma-separated")
    parser.add_argument("--ids_out", required=True, help="the folder of id records to write")
    parser.add_argument("--shards", type=int, default=1, help="files per prefix")
    args = parser.parse_args(argv)
    try:
        result = convert(args.prefixes.split(","), args.ids_out, args.shards)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
