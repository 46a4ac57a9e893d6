"""Host input: per-host file splitting, the prepared corpus, the LM pipeline, resume, bad input."""

import dataclasses
import itertools
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

from tfpod import UserError
from tfpod.input import files as files_lib
from tfpod.api import run
from conftest import device_mesh
from tfpod.input import common, host_files, lm_data, prepare
from tfpod.input.common import ShardInfo


def make_files(d, n):
    for i in range(n):
        (d / f"part-{i:03d}.txt").write_text(f"file {i}\n")
    return str(d / "part-*.txt")


@pytest.mark.unit
@pytest.mark.parametrize("n_files,hosts", [(8, 2), (8, 4), (10, 3), (13, 4), (7, 7), (5, 1)])
def test_host_files_is_a_balanced_complete_disjoint_deterministic_partition(tmp_path, n_files, hosts):
    pattern = make_files(tmp_path, n_files)
    parts = [host_files(pattern, hosts, h, seed=3) for h in range(hosts)]
    everything = sorted(str(p) for p in tmp_path.glob("part-*.txt"))
    assert sorted(itertools.chain(*parts)) == everything  # complete and disjoint
    assert len(set(itertools.chain(*parts))) == n_files
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # balanced
    assert parts == [host_files(pattern, hosts, h, seed=3) for h in range(hosts)]  # deterministic
    if hosts > 1:
        assert parts != [host_files(pattern, hosts, h, seed=4) for h in range(hosts)]  # the seed shuffles


@pytest.mark.unit
def test_fewer_files_than_hosts_falls_back_to_record_sharding(tmp_path, caplog):
    pattern = make_files(tmp_path, 2)
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        shard = files_lib.plan(pattern, 3, 1)
    assert shard.record_shard and len(shard.files) == 2
    assert "2 file(s) for 3 hosts" in caplog.text


@pytest.mark.unit
def test_enough_files_means_file_splitting_even_with_one_file_per_host(tmp_path, caplog):
    pattern = make_files(tmp_path, 2)
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        shards = [files_lib.plan(pattern, 2, h) for h in range(2)]
    assert not any(s.record_shard for s in shards) and "for 2 hosts" not in caplog.text
    assert sorted(f for s in shards for f in s.files) == sorted(str(p) for p in tmp_path.glob("part-*.txt"))


@pytest.mark.unit
def test_pattern_matching_nothing_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"input pattern '.*nothing-\*\.tfrecord' matches no file"):
        host_files(str(tmp_path / "nothing-*.tfrecord"), 2, 0)
    with pytest.raises(UserError, match=r"host_id=2 is not in \[0, num_hosts=2\)"):
        host_files(make_files(tmp_path, 2), 2, 2)


@pytest.fixture(scope="module")
def corpus():
    return prepare.ensure()


@pytest.mark.unit
def test_prepared_corpus_splits_by_file_and_round_trips(corpus):
    manifest = prepare.prepare(corpus)  # cached: returns the manifest without rebuilding
    assert manifest["train_files"] > 1000 and manifest["eval_files"] > 20
    assert len(tf.io.gfile.glob(prepare.split_paths(corpus, "train"))) == prepare.TRAIN_SHARDS
    assert len(tf.io.gfile.glob(prepare.split_paths(corpus, "eval"))) == prepare.EVAL_SHARDS

    def paths(split):
        out = set()
        for rec in tf.data.TFRecordDataset(tf.io.gfile.glob(prepare.split_paths(corpus, split))):
            out.add(tf.train.Example.FromString(rec.numpy()).features.feature["path"].bytes_list.value[0].decode())
        return out

    train, evals = paths("train"), paths("eval")
    assert not train & evals and all(prepare.is_eval(p) for p in evals)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=prepare.vocab_path(corpus, 2048))
    assert sp.vocab_size() == 2048
    assert [sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()] == [0, 1, 2, 3]
    assert [sp.piece_to_id(p) for p in ("[MASK]", "[CLS]", "[SEP]")] == [4, 5, 6]
    source = "def f(x):\n\treturn {'a': x ** 2}  # ünïcode\n"
    assert sp.decode(sp.encode(source)) == source


def dataset(corpus, host_rows=4, num_hosts=1, host_id=0, seed=0, **cfg):
    data = lm_data.LMDataConfig(**{"shuffle_buffer": 128, **cfg})  # (a smaller buffer fills faster)
    where = lm_data.resolve(data)
    return lm_data.lm_dataset(data, where.train_files, where.vocab_path, 64, host_rows, ShardInfo(host_id, num_hosts), seed,
                              2048)


def first(ds, n=3):
    return [{k: v.numpy() for k, v in b.items()} for b in ds.take(n)]


def test_lm_dataset_contract_and_determinism(corpus):
    a = first(dataset(corpus))
    assert set(a[0]) == {"inputs", "targets", "weights"}
    assert a[0]["inputs"].shape == (4, 64) and a[0]["inputs"].dtype == np.int32
    np.testing.assert_array_equal(a[0]["inputs"][:, 1:], a[0]["targets"][:, :-1])  # next-token targets
    assert (a[0]["weights"] == 1).all()
    b = first(dataset(corpus))
    for x, y in zip(a, b):  # same seed, same batches
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    c = first(dataset(corpus, seed=1))
    assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(a, c))


def test_hosts_read_different_data(corpus):
    h0 = first(dataset(corpus, num_hosts=2, host_id=0))
    h1 = first(dataset(corpus, num_hosts=2, host_id=1))
    assert all((x["inputs"] != y["inputs"]).any() for x, y in zip(h0, h1))


def test_segment_packing_feeds_positions_and_segments(corpus):
    b = first(dataset(corpus, packing="segments"), 1)[0]
    assert {"segment_ids", "positions"} <= set(b)
    assert b["segment_ids"].shape == (4, 64)


def _small_run(model_dir, steps, extra=()):
    params = ["train.steps=%d" % steps, "train.global_batch_size=8", "train.steps_per_loop=2", "train.log_every=2",
              "train.checkpoint_every=2", "optimizer.decay_steps=8", "optimizer.warmup_steps=0",
              "gpt.num_layers=1", "gpt.embed_dim=64", "gpt.mlp_dim=128", *extra]
    return run(["gin/lm_tiny.gin"], params, str(model_dir), mesh=device_mesh())  # input is the point: one device


def test_bad_input_is_one_clear_line(tmp_path, corpus):
    vocab = prepare.vocab_path(corpus, 2048)
    empty = tmp_path / "empty.tfrecord"
    empty.write_bytes(b"")
    with pytest.raises(UserError, match=f"input file {empty} is empty"):
        _small_run(tmp_path / "a", 2, [f"lm_data.train_files='{empty}'", f"lm_data.vocab_path='{vocab}'"])

    good = sorted(tf.io.gfile.glob(prepare.split_paths(corpus, "eval")))[0]
    corrupt = tmp_path / "corrupt.tfrecord"
    raw = open(good, "rb").read()
    corrupt.write_bytes(raw[:40] + bytes(200) + raw[240:])
    with pytest.raises(UserError) as e:
        _small_run(tmp_path / "b", 2, [f"lm_data.train_files='{corrupt}'", f"lm_data.vocab_path='{vocab}'"])
    assert f"file {corrupt} is corrupt" in str(e.value) and "lm_data.skip_corrupt=True" in str(e.value)
    assert "\n" not in str(e.value)

    both = f"{corrupt},{good}"
    out = _small_run(tmp_path / "c", 2, [f"lm_data.train_files='{both}'", f"lm_data.vocab_path='{vocab}'",
                                         "lm_data.skip_corrupt=True"])
    assert np.all(np.isfinite(out["losses"]))

    with pytest.raises(UserError, match="vocabulary"):
        _small_run(tmp_path / "d", 2, [f"lm_data.vocab_path='{tmp_path / 'missing.model'}'"])


def test_trains_through_the_tf_data_service_with_segment_packing(tmp_path, corpus):
    """A dispatcher and a worker on loopback, in process; the host's pipeline runs on the
    worker. Its rows are packed by segments (segment ids and positions reach the model)."""
    dispatcher = tf.data.experimental.service.DispatchServer()
    address = dispatcher.target.split("://")[1]
    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=address)
    )
    out = _small_run(tmp_path, 4, [f"lm_data.service_address='{dispatcher.target}'", "lm_data.packing='segments'"])
    assert len(out["losses"]) == 4 and np.all(np.isfinite(out["losses"]))
    del worker


def test_a_changed_input_starts_over_with_a_warning_or_is_refused_when_strict(tmp_path, corpus, caplog):
    """Resuming with other data used to replay the old corpus's saved position (a changed
    train_files) or die in tf.data (a changed format: 'Failed to restore dataset iterator').
    The position is restored only into the input it was saved with; otherwise the new input
    starts from its beginning with one warning, or, with train.strict_resume, the run stops."""
    d = tmp_path / "run"
    _small_run(d, 2)  # the default corpus (TFRecords); checkpoint 2 holds its input position
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"doc{i}.txt").write_text("".join(f"def f{j}(x):\n    return x * {i + j}\n" for j in range(300)))
    new = [f"lm_data.train_files='{texts}/*.txt'", "lm_data.format='text'"]
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        out = _small_run(d, 4, new)
    assert out["step"] == 4 and np.all(np.isfinite(out["losses"]))
    assert "the input changed since checkpoint step 2 (this host's files: 32 gone (e.g. train-" in caplog.text
    assert "3 new (e.g. doc0.txt); lm_data.format: 'auto' -> 'text'; lm_data.train_files: None -> " in caplog.text
    assert "the input starts from its beginning at step 2" in caplog.text
    # The position saved at step 4 is two batches into the new input: it started from its beginning.
    cfg = lm_data.LMDataConfig(train_files=f"{texts}/*.txt", format="text")
    fresh = lambda: lm_data.lm_dataset(cfg, cfg.train_files, prepare.vocab_path(corpus, 2048), 64, 8, ShardInfo(0, 1), 0,
                                       2048)
    expected = first(fresh(), 3)[2]
    iterator = iter(fresh())
    tf.train.Checkpoint(iterator=iterator).restore(str(d / "checkpoints" / "input-host0" / "ckpt-4")).expect_partial()
    np.testing.assert_array_equal(next(iterator)["inputs"].numpy(), expected["inputs"])
    assert (d / "checkpoints" / "input-host0" / "ckpt-4.source.json").exists()

    config = (d / "config.gin").read_text()
    with pytest.raises(UserError) as e:
        _small_run(d, 6, new + ["lm_data.shuffle_buffer=512", "train.strict_resume=True"])
    assert str(e.value).startswith("the input changed since checkpoint step 4 (lm_data.shuffle_buffer: 1024 -> 512): "
                                   "train.strict_resume=True will not start the input over") and "\n" not in str(e.value)
    assert (d / "config.gin").read_text() == config  # the failed run's config did not replace it

    # A checkpoint without its source (an older tfpod's) whose position does not fit the pipeline.
    os.remove(d / "checkpoints" / "input-host0" / "ckpt-4.source.json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        assert _small_run(d, 6)["step"] == 6  # back on the default corpus
    assert "the input position saved at step 4 does not fit this input pipeline (" in caplog.text


@pytest.mark.unit
def test_every_task_records_what_its_input_is_built_from():
    from tfpod.models import TASKS

    for name in ("gpt", "bert", "resnet", "transformer"):
        task = TASKS[name]
        data, model = task.data_config_class(), task.config_class()
        source = task.make_input(data, model, ShardInfo(0, 1), 0).source
        assert source["files"] and all(size > 0 for _, size in source["files"]), name
        first_field = next(f.name for f in dataclasses.fields(data) if "eval" not in f.name)
        assert f"{task.data_name}.{first_field}" in source, name
        assert not any("eval" in k for k in source), name


@pytest.mark.unit
def test_binary_or_undecodable_text_files_are_refused_or_warned_of(tmp_path, corpus, caplog):
    """Files read as text (no .tfrecord name, or lm_data.format='text') used to be trained on
    whatever they held: a TFRecord without its extension, random bytes, another encoding."""
    record = tmp_path / "shard-00000"  # a TFRecord file without its extension
    with tf.io.TFRecordWriter(str(record)) as w:
        w.write(tf.train.Example(features=tf.train.Features(feature={"text": tf.train.Feature(
            bytes_list=tf.train.BytesList(value=[b"def f():\n    return 1\n"]))})).SerializeToString())
    with pytest.raises(UserError) as e:
        _small_run(tmp_path / "a", 2, [f"lm_data.train_files='{record}'"])
    assert str(e.value) == (f"input file {record} is read as text but is binary (NUL bytes; it reads as a TFRecord "
                            "file): set lm_data.format='tfrecord'")

    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(np.random.RandomState(0).randint(128, 192, 4000).astype(np.uint8)))
    with pytest.raises(UserError, match=r"noise.txt is read as text but 100% of its first 4000 bytes are not UTF-8"):
        common.check_text_files([str(noise)], "")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes((("x = 1  # a plain line\n" * 9 + "caf\u00e9\n") * 10).encode("latin-1"))  # 10 of 2030 bytes
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        common.check_text_files([str(latin)], "")
    assert f"10 of the 2030 bytes read from the start of 1 text file(s) are not UTF-8 (0.49%; most in {latin})" in caplog.text


@pytest.mark.unit
def test_a_shared_data_config_words_its_errors_in_the_tasks_own_gin_names():
    """gpt and moe both read lm_data.*: each one's message names its own model knobs."""
    from tfpod.models import TASKS

    for name in ("gpt", "moe"):
        task = TASKS[name]
        model = task.config_class(seq_len=32)
        with pytest.raises(UserError) as e:
            task.make_input(lm_data.LMDataConfig(seq_len=64), model, ShardInfo(0, 1), 0)
        assert str(e.value) == (f"lm_data.seq_len=64 is outside [1, 32], the model's maximum length ({name}.seq_len): "
                                f"lower lm_data.seq_len or raise {name}.seq_len")


def test_a_vocabulary_of_your_own_text_gets_tfpods_ids_and_a_foreign_one_is_refused(tmp_path, caplog):
    """`python -m tfpod.input.prepare --vocab_from` trains SentencePiece on your files with tfpod's
    special ids, which lm_data takes; a model with sentencepiece's default ids (eos 2, a normal
    piece at tfpod's end-of-document id 3) is one line naming both ids; your text with the default
    corpus's vocabulary is a loud warning naming the fix."""
    import json as json_lib
    import subprocess
    import sys

    import sentencepiece as spm

    rng = np.random.default_rng(0)
    words = [''.join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(300)]
    text = tmp_path / "mine.txt"
    text.write_text("\n".join(" ".join(rng.choice(words, size=12)) for _ in range(400)))
    out = tmp_path / "mine.model"
    result = subprocess.run([sys.executable, "-m", "tfpod.input.prepare", f"--vocab_from={tmp_path}/*.txt",
                             "--vocab_size=300", f"--vocab_out={out}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json_lib.loads(result.stdout.splitlines()[-1])["special_ids"]["eos"] == prepare.EOS_ID
    model = spm.SentencePieceProcessor(model_file=str(out))
    assert (model.pad_id(), model.eos_id(), model.piece_to_id("[MASK]")) == (prepare.PAD_ID, prepare.EOS_ID,
                                                                               prepare.MASK_ID)
    cfg = lm_data.LMDataConfig(train_files=str(text), vocab_path=str(out))
    assert lm_data.resolve(cfg).vocab_path == str(out)
    again = subprocess.run([sys.executable, "-m", "tfpod.input.prepare", f"--vocab_from={text}", f"--vocab_out={out}"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "exists" in again.stderr  # nothing is overwritten

    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "defaults"), vocab_size=300,
                                   minloglevel=2)  # sentencepiece's own ids: unk 0, bos 1, eos 2
    foreign = lm_data.LMDataConfig(train_files=str(text), vocab_path=str(tmp_path / "defaults.model"))
    with pytest.raises(UserError, match=r"its end-of-document piece is id 2 .* but tfpod ends every document with id "
                                        r"3, which is .* there: train it with tfpod's ids .* or set lm_data.eos_id=2"):
        lm_data.resolve(foreign)
    assert lm_data.resolve(dataclasses.replace(foreign, eos_id=2)).vocab_path.endswith("defaults.model")
    with caplog.at_level(logging.WARNING, logger="tfpod"):
        lm_data.resolve(lm_data.LMDataConfig(train_files=str(text)))
    assert "tokenized with the default corpus's vocabulary" in caplog.text and "--vocab_from=" in caplog.text
