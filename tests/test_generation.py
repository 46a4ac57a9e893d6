"""Generation with a key/value cache (models/decoding.py, the SavedModel's generate signatures):
greedy tokens equal the recompute-everything path's, sampling is reproducible and draws from
the softmax it filters, and requests that cannot be served fail with one line."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfpod import export
from tfpod.input import lm_data
from tfpod.models import decoding, gpt, llama, lm_serving

pytestmark = pytest.mark.unit

MODELS = {
    "gpt": lambda: gpt.GPT(gpt.GPTConfig(vocab_size=64, seq_len=48, num_layers=2, embed_dim=32, num_heads=4,
                                         mlp_dim=64, init_stddev=0.3)),
    "llama": lambda: llama.Llama(llama.LlamaConfig(vocab_size=64, seq_len=48, num_layers=2, embed_dim=32, num_heads=4,
                                                   num_kv_heads=2, mlp_dim=48, init_stddev=0.3)),
    "llama_mqa_rope_scaled": lambda: llama.Llama(llama.LlamaConfig(
        vocab_size=64, seq_len=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=1, mlp_dim=48,
        init_stddev=0.3, rope_scaling_factor=8.0, rope_original_len=8)),
}
EOS = 63


def built(name):
    model = MODELS[name]()
    model({"inputs": tf.zeros([1, 8], tf.int32)})
    return model


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
    _, signatures = lm_serving.serving(model, model.config, lm_data.LMDataConfig(format="ids", eos_id=EOS))
    got = signatures["generate_ids"](input_ids=ids, lengths=lengths, max_new_tokens=tf.constant(32),
                                     temperature=tf.constant(0.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                                     seed=tf.constant(0))
    ragged = tf.RaggedTensor.from_tensor(ids, lengths=lengths)
    want = tf.function(lambda r: lm_serving.recomputed_generate(
        lambda x: model({"inputs": x}, training=False), model.config.seq_len, r, tf.constant(32)))(ragged).numpy()
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
    logits = model({"inputs": tf.constant(sequence)}, training=False).numpy()[0]
    starts = len(prompts[row]) - 1
    log_softmax = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = log_softmax[np.arange(starts, starts + counts[row]), out[row, :counts[row]]]
    np.testing.assert_allclose(got["log_probs"].numpy()[row, :counts[row]], expected, atol=1e-4)


def test_sampling_is_reproducible_and_draws_from_the_filtered_softmax():
    """The first new token of 4,000 rows of one prompt (one draw each), temperature 0.7:
    its frequencies match softmax(logits / 0.7) by a chi-square test whose false-alarm rate
    is 1e-6 (bins of expected count < 5 merged); with top_k=5 only the 5 likeliest tokens
    come, with top_p=0.5 only the nucleus. The same seed gives the same tokens; another seed
    others."""
    model = built("llama")
    prompt = np.random.default_rng(1).integers(1, EOS, 7)
    rows = 4000
    ids, lengths = right_padded([prompt] * rows)
    logits = model({"inputs": tf.constant(prompt[None])}, training=False).numpy()[0, -1].astype(np.float64)
    draw = tf.function(lambda t, k, p, seed: decoding.generate(model, ids, lengths, tf.constant(1), EOS, t, k, p, seed,
                                                               kv_heads=2))
    first = lambda *a: draw(*a)["ids"].numpy()[:, 0]
    tokens = first(0.7, 0, 1.0, 3)
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
    np.testing.assert_array_equal(first(0.7, 0, 1.0, 3), tokens)
    assert (first(0.7, 0, 1.0, 4) != tokens).mean() > 0.3
    assert set(first(1.0, 5, 1.0, 3)) <= set(order[:5].tolist())
    cumulative = np.cumsum(np.sort(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())[::-1])
    nucleus = order[:int(np.searchsorted(cumulative, 0.5)) + 1]  # the smallest set reaching 0.5
    assert set(first(1.0, 0, 0.5, 3)) <= set(np.argsort(-logits)[:len(nucleus)].tolist())
    assert (first(0.0, 0, 1.0, 3) == np.argmax(logits)).all()  # temperature 0: greedy


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
    cold = served["sample"](text=texts, temperature=tf.constant(0.0), **options)
    np.testing.assert_array_equal(cold["ids"], greedy["ids"])
    hot = [served["sample"](text=texts, temperature=tf.constant(1.0), **options)["ids"].numpy() for _ in range(2)]
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
    again = served["generate"](text=texts, max_new_tokens=tf.constant(8))
    np.testing.assert_array_equal(again["ids"], greedy["ids"])


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
