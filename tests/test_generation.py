"""Generation with a key/value cache (models/decoding.py, the SavedModel's generate signatures):
greedy tokens equal the recompute-everything path's, sampling is reproducible and draws from
the softmax it filters, and requests that cannot be served fail with one line."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfpod import export
from tfpod.input import lm_data
from tfpod.models import decoding, gpt, llama, lm_serving, moe


MODELS = {
    "gpt": lambda: gpt.GPT(gpt.GPTConfig(vocab_size=64, seq_len=48, num_layers=2, embed_dim=32, num_heads=4,
                                         mlp_dim=64, init_stddev=0.3)),
    "llama": lambda: llama.Llama(llama.LlamaConfig(vocab_size=64, seq_len=48, num_layers=2, embed_dim=32, num_heads=4,
                                                   num_kv_heads=2, mlp_dim=48, init_stddev=0.3)),
    "llama_mqa_rope_scaled": lambda: llama.Llama(llama.LlamaConfig(
        vocab_size=64, seq_len=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=1, mlp_dim=48,
        init_stddev=0.3, rope_scaling_factor=8.0, rope_original_len=8)),
    # capacity 8 = group_size: training's routing drops no token, as decoding's never does
    "moe": lambda: moe.MoELM(moe.MoEConfig(vocab_size=64, seq_len=48, num_layers=2, embed_dim=32, num_heads=4,
                                          mlp_dim=64, num_experts=4, expert_mlp_dim=32, group_size=8,
                                          capacity_factor=2.0, init_stddev=0.3)),
}
EOS = 63


def built(name):
    model = MODELS[name]()
    model({"inputs": tf.zeros([1, 8], tf.int32)})
    return model


def logits_fn(model):
    """The model's logits of ids [batch, n] (MoE: run on them padded to seq_len, its groups' length)."""
    if not isinstance(model, moe.MoELM):
        return lambda x: model({"inputs": x}, training=False)
    pad = lambda x: tf.pad(x, [[0, 0], [0, model.config.seq_len - tf.shape(x)[1]]])
    return lambda x: model({"inputs": tf.ensure_shape(pad(x), [None, model.config.seq_len])},
                           training=False)[:, :tf.shape(x)[1]]


def right_padded(prompts):
    ids = np.zeros([len(prompts), max(map(len, prompts))], np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return tf.constant(ids), tf.constant([len(p) for p in prompts], tf.int32)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_the_recomputing_path(name):
    """Prompts of 1, 6 and 13 tokens in one batch, 32 new tokens: the cached path's tokens are
    the recomputing path's (the model run on the whole sequence for every token), up to each
    row's first EOS, and EOS after it."""
    model = built(name)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, EOS, n) for n in (6, 13, 1)]
    ids, lengths = right_padded(prompts)
    _, signatures = lm_serving.serving(model, model.config, lm_data.LMDataConfig(format="ids", eos_id=EOS),
                                       whole_sequences=isinstance(model, moe.MoELM))
    got = signatures["generate_ids"](input_ids=ids, lengths=lengths, max_new_tokens=tf.constant(32),
                                     temperature=tf.constant(0.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                                     seed=tf.constant(0))
    ragged = tf.RaggedTensor.from_tensor(ids, lengths=lengths)
    want = tf.function(lambda r: lm_serving.recomputed_generate(
        logits_fn(model), model.config.seq_len, r, tf.constant(32)))(ragged).numpy()
    out, counts = got["ids"].numpy(), got["num_tokens"].numpy()
    for row in range(3):
        n = counts[row]
        assert n >= 1
        np.testing.assert_array_equal(out[row, :n], want[row, :n])
        assert n == 32 or (out[row, n - 1] == EOS and (out[row, n:] == EOS).all())
    assert len({tuple(r) for r in out}) == 3  # the rows are their own
    # Each token's log-probability is the model's log-softmax at its position.
    row = 0
    sequence = np.concatenate([prompts[row], out[row, :counts[row]]])[None]
    logits = logits_fn(model)(tf.constant(sequence)).numpy()[0]
    starts = len(prompts[row]) - 1
    log_softmax = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = log_softmax[np.arange(starts, starts + counts[row]), out[row, :counts[row]]]
    np.testing.assert_allclose(got["log_probs"].numpy()[row, :counts[row]], expected, atol=1e-4)


def test_sampling_is_reproducible_and_draws_from_the_filtered_softmax():
    """The first new token of 4,000 rows of one prompt, each row its own seed, temperature
    0.7: its frequencies match softmax(logits / 0.7) by a chi-square test whose false-alarm
    rate is 1e-6 (bins of expected count < 5 merged). Options per row: rows with top_k=5 draw
    only the 5 likeliest tokens, rows with top_p=0.5 only the nucleus, rows at temperature 0
    the argmax, in one batch. The same seed gives the same token whatever else is in the
    batch; other seeds others."""
    model = built("llama")
    prompt = np.random.default_rng(1).integers(1, EOS, 7)
    rows = 4000
    logits = model({"inputs": tf.constant(prompt[None])}, training=False).numpy()[0, -1].astype(np.float64)
    draw = tf.function(lambda ids, lengths, t, k, p, seed: decoding.generate(
        model, ids, lengths, tf.constant(1), EOS, t, k, p, seed, kv_heads=2))

    def first(t, k, p, seed, n=rows):
        return draw(*right_padded([prompt] * n), t, k, p, seed)["ids"].numpy()[:, 0]

    seeds = np.arange(rows, dtype=np.int32)
    tokens = first(0.7, 0, 1.0, seeds)
    probs = np.exp((logits - logits.max()) / 0.7)
    probs /= probs.sum()
    order = np.argsort(-probs)
    expected, observed = probs[order] * rows, np.bincount(tokens, minlength=64)[order].astype(float)
    keep = expected >= 5
    expected = np.append(expected[keep], expected[~keep].sum())
    observed = np.append(observed[keep], observed[~keep].sum())
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < stats.chi2.ppf(1 - 1e-6, len(expected) - 1), (chi2, len(expected))
    assert len(set(tokens)) > 10  # a real spread, not the argmax
    np.testing.assert_array_equal(first(0.7, 0, 1.0, seeds), tokens)
    np.testing.assert_array_equal(first(0.7, 0, 1.0, seeds[17:20], n=3), tokens[17:20])  # alone, the same
    assert (first(0.7, 0, 1.0, seeds + rows) != tokens).mean() > 0.3
    assert (first(0.7, 0, 1.0, 3) == first(0.7, 0, 1.0, 3)[0]).all()  # one seed for every row: one draw
    cumulative = np.cumsum(np.sort(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())[::-1])
    nucleus = np.argsort(-logits)[:int(np.searchsorted(cumulative, 0.5)) + 1]  # the smallest set reaching 0.5
    third = rows // 3
    t = np.full(rows, 1.0, np.float32)
    t[2 * third:] = 0.0
    k = np.where(np.arange(rows) < third, 5, 0).astype(np.int32)
    p = np.where((np.arange(rows) >= third) & (np.arange(rows) < 2 * third), 0.5, 1.0).astype(np.float32)
    mixed = first(t, k, p, seeds)
    assert set(mixed[:third]) <= set(order[:5].tolist()) and len(set(mixed[:third])) > 1
    assert set(mixed[third:2 * third]) <= set(nucleus.tolist())
    assert (mixed[2 * third:] == np.argmax(logits)).all()  # temperature 0: greedy


def test_the_saved_model_generates_and_refuses_what_it_cannot_serve_in_one_line(tmp_path):
    """The exported SavedModel (text signatures: the default corpus's tokenizer) generates
    greedily, samples, and takes ids; a prompt longer than the context, a negative
    max_new_tokens and ids outside the vocabulary each fail with one line, and the loaded
    model serves the next request."""
    config = llama.LlamaConfig(vocab_size=2048, seq_len=32, num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2,
                               mlp_dim=48, init_stddev=0.3)
    model = llama.Llama(config)
    model({"inputs": tf.zeros([1, 8], tf.int32)})
    module, signatures = lm_serving.serving(model, config, lm_data.LMDataConfig())
    assert {"serving_default", "generate", "sample", "generate_ids", "ids"} == set(signatures)
    served = tf.saved_model.load(export.write(module, signatures, str(tmp_path))).signatures
    texts = tf.constant(["def f(x):", "import"])
    greedy = served["generate"](text=texts, max_new_tokens=tf.constant(8))
    assert greedy["ids"].shape == (2, 8) and greedy["text"].shape == (2,) and greedy["log_probs"].shape == (2, 8)
    options = dict(max_new_tokens=tf.constant(8), top_k=tf.constant(0), top_p=tf.constant(1.0), seed=tf.constant(5))
    sample = lambda **a: served["sample"](text=texts, stop=tf.constant(""), **options, **a)
    cold = sample(temperature=tf.constant(0.0))
    np.testing.assert_array_equal(cold["ids"], greedy["ids"])
    hot = [sample(temperature=tf.constant(1.0))["ids"].numpy() for _ in range(2)]
    np.testing.assert_array_equal(*hot)
    too_long = tf.constant(["x " * 40])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"a prompt of \d+ tokens plus max_new_tokens=8 is more "
                                                             r"than the model context, seq_len=32: send a shorter"):
        served["generate"](text=too_long, max_new_tokens=tf.constant(8))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"max_new_tokens is -1: send a number >= 0"):
        served["generate"](text=texts, max_new_tokens=tf.constant(-1))
    ids_options = dict(options, temperature=tf.constant(0.0))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"input_ids holds values from 1 to 4000, outside "
                                                             r"\[0, 2048\)"):
        served["generate_ids"](input_ids=tf.constant([[1, 4000]]), lengths=tf.constant([2]), **ids_options)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"temperature has 3 values for 2 rows: send one value "
                                                             r"for every row or one per row"):
        sample(temperature=tf.constant([1.0, 0.5, 0.2]))
    again = served["generate"](text=texts, max_new_tokens=tf.constant(8))
    np.testing.assert_array_equal(again["ids"], greedy["ids"])


def test_per_row_limits_and_stop_strings_end_each_row_on_its_own(tmp_path):
    """In one request: a row with max_new_tokens=3 stops after 3 tokens while the other goes
    on to 8 (the greedy tokens either way); a stop string ends its row at the token whose text
    completes it, and the text is cut before it. The README's worked REST requests, made
    into tensors as TF Serving makes them, are served."""
    from tfpod.input import text as text_lib

    config = llama.LlamaConfig(vocab_size=2048, seq_len=160, num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2,
                               mlp_dim=48, init_stddev=0.3)
    model = llama.Llama(config)
    model({"inputs": tf.zeros([1, 8], tf.int32)})
    data = lm_data.LMDataConfig()
    module, signatures = lm_serving.serving(model, config, data)
    served = tf.saved_model.load(export.write(module, signatures, str(tmp_path))).signatures
    tokenizer = text_lib.load_tokenizer(lm_data.resolve(data).vocab_path)
    texts = tf.constant(["def f(x):", "import"])
    greedy = served["generate"](text=texts, max_new_tokens=tf.constant(8))
    ids = greedy["ids"].numpy()
    assert (greedy["num_tokens"].numpy() == 8).all()  # (no EOS from this model in 8 tokens)
    options = dict(temperature=tf.constant([0.0, 0.0]), top_k=tf.constant([0, 0]), top_p=tf.constant([1.0, 1.0]),
                   seed=tf.constant([0, 0]))
    short = served["sample"](text=texts, max_new_tokens=tf.constant([3, 8]), stop=tf.constant(["", ""]), **options)
    assert short["ids"].shape == (2, 8) and list(short["num_tokens"].numpy()) == [3, 8]
    np.testing.assert_array_equal(short["ids"].numpy()[0, :3], ids[0, :3])
    assert (short["ids"].numpy()[0, 3:] == data.eos).all()
    np.testing.assert_array_equal(short["ids"].numpy()[1], ids[1])
    assert short["text"].numpy()[1] == greedy["text"].numpy()[1]

    full = greedy["text"].numpy()[0].decode()
    prefix = lambda n: tokenizer.detokenize(tf.constant(ids[0, :n])).numpy().decode()
    n_stop = next(n for n in range(2, 9) if len(prefix(n)) > len(prefix(n - 1)) >= 1)
    stop = prefix(n_stop)[-1]  # the last character of the n_stop-th token's text, new at that token
    first = next(n for n in range(1, 9) if stop in prefix(n))  # where it first appears
    stopped = served["sample"](text=texts, max_new_tokens=tf.constant(8), stop=tf.constant([stop, ""]), **options)
    assert list(stopped["num_tokens"].numpy()) == [first, 8]
    np.testing.assert_array_equal(stopped["ids"].numpy()[0, :first], ids[0, :first])
    assert stopped["text"].numpy()[0].decode() == full[:full.index(stop)]
    assert stopped["text"].numpy()[1] == greedy["text"].numpy()[1]
    every_row = served["sample"](text=texts, max_new_tokens=tf.constant(8), stop=tf.constant([[stop, "zzzz"]]),
                                 **options)  # [1, 2]: both stops for every row
    assert every_row["num_tokens"].numpy()[0] == first
    for body in readme_requests():
        signature = served[body["signature_name"]]
        specs = signature.structured_input_signature[1]
        if "instances" in body:  # the row format: each input stacked over the instances
            inputs = {k: [row[k] for row in body["instances"]] for k in body["instances"][0]}
        else:
            inputs = body["inputs"]
        assert set(inputs) == set(specs)
        out = signature(**{k: tf.constant(v, specs[k].dtype) for k, v in inputs.items()})
        rows = len(inputs.get("text", inputs.get("input_ids")))
        assert out["ids"].shape[0] == rows and (out["num_tokens"].numpy() >= 1).all()


def test_gpt_moe_and_llama_exports_generate_in_a_fresh_process(tmp_path):
    """Each decoder's export (text signatures), loaded by a fresh process with tensorflow and
    tensorflow_text only, samples what the model gives in this process: per-row options, a
    stop string, the cache."""
    import json
    import os
    import subprocess
    import sys
    from test_export import LOADER

    inputs = {"text": ["def f(x):", "import", "class A"], "max_new_tokens": [6, 10, 8],
              "temperature": [0.0, 0.9, 0.7], "top_k": [0, 20, 0], "top_p": [1.0, 1.0, 0.8], "seed": [0, 1, 2],
              "stop": [["", ""], ["(", "zz"], ["", ""]]}
    small = dict(vocab_size=2048, seq_len=32, num_layers=2, embed_dim=32, num_heads=4, init_stddev=0.3)
    models = {"gpt": gpt.GPT(gpt.GPTConfig(mlp_dim=64, **small)),
              "moe": moe.MoELM(moe.MoEConfig(mlp_dim=64, num_experts=4, expert_mlp_dim=32, group_size=8, **small)),
              "llama": llama.Llama(llama.LlamaConfig(num_kv_heads=2, mlp_dim=48, **small))}
    jobs, expected = {}, {}
    for name, model in models.items():
        model({"inputs": tf.zeros([1, 8], tf.int32)})
        module, signatures = lm_serving.serving(model, model.config, lm_data.LMDataConfig(),
                                                whole_sequences=name == "moe")
        out = signatures["sample"](**{k: tf.constant(v) for k, v in inputs.items()})
        expected.update({f"{name}/sample/{k}": v.numpy() for k, v in out.items()})
        jobs[name] = {"dir": export.write(module, signatures, str(tmp_path / name)), "calls": {"sample": inputs}}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TF_USE_LEGACY_KERAS", "TFPOD", "PYTHONPATH"))}
    proc = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / "jobs.json"), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=clean)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []  # no tfpod, tf_keras or Model Garden
    served = dict(np.load(tmp_path / "out.npz"))
    for key, want in expected.items():
        if key.endswith("log_probs"):
            np.testing.assert_allclose(served[key], want, atol=1e-5)
        else:
            np.testing.assert_array_equal(served[key], want.astype(bytes) if want.dtype == object else want)
    for name in models:
        assert expected[f"{name}/sample/num_tokens"][0] == 6  # greedy row 0: no EOS within its 6


@pytest.mark.parametrize("family", ["gpt2", "mistral"])
def test_greedy_tokens_equal_transformers_generate_for_an_imported_model(family, tmp_path):
    """A random TFGPT2LMHeadModel / TFMistralForCausalLM written as a Hub folder and imported:
    the export's `generate_ids` gives transformers' own greedy `generate` (left-padded with its
    attention mask) token for token, 32 new tokens after prompts of 3, 9 and 1 tokens."""
    transformers = pytest.importorskip("transformers")
    from test_convert import write_hub_folder
    from tfpod.convert import run as convert

    tf.keras.utils.set_random_seed(0)
    if family == "gpt2":
        hf = transformers.TFGPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, initializer_range=0.3, eos_token_id=95, bos_token_id=95))
        architecture = "GPT2LMHeadModel"
    else:
        hf = transformers.TFMistralForCausalLM(transformers.MistralConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, sliding_window=None, rope_theta=10000.0,
            initializer_range=0.3, eos_token_id=95, bos_token_id=1))
        architecture = "MistralForCausalLM"
    hf(tf.zeros([1, 4], tf.int32))
    write_hub_folder(hf, tmp_path / "hub", architecture)
    convert.import_hub(str(tmp_path / "hub"), str(tmp_path / "run"))
    served = tf.saved_model.load(export.saved_model(str(tmp_path / "run"))["export_dir"]).signatures
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 95, n) for n in (3, 9, 1)]
    ids, lengths = right_padded(prompts)
    ours = served["generate_ids"](input_ids=ids, lengths=lengths, max_new_tokens=tf.constant(32),
                                  temperature=tf.constant(0.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                                  seed=tf.constant(0))
    width = max(map(len, prompts))
    left = np.zeros([3, width], np.int32)
    mask = np.zeros([3, width], np.int32)
    for i, p in enumerate(prompts):
        left[i, width - len(p):], mask[i, width - len(p):] = p, 1
    theirs = hf.generate(tf.constant(left), attention_mask=tf.constant(mask), max_new_tokens=32, do_sample=False,
                         pad_token_id=0, eos_token_id=95).numpy()[:, width:]
    for row in range(3):
        n = int(ours["num_tokens"][row])
        np.testing.assert_array_equal(ours["ids"].numpy()[row, :n], theirs[row, :n])
    assert len({tuple(r) for r in theirs.tolist()}) == 3


def readme_requests() -> list[dict]:
    """The JSON bodies of the serving requests the README and docs/generation.md show (their
    curl lines run by bash with a curl that prints what it would send)."""
    import json
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read().split("Serving a language model")[1]
    docs = open(os.path.join(root, "docs", "generation.md")).read().split("## Requests (TF Serving REST)")[1]
    bodies = ""
    for text in (readme, docs):
        block = text.split("```sh\n")[1].split("```")[0].split("\n", 1)[1]  # the lines after the docker line
        script = 'curl() { printf "%s\\0" "$2"; }\n' + block
        bodies += subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    requests = [json.loads(body) for body in bodies.split("\0") if body.strip()]
    assert len(requests) == 6
    return requests

