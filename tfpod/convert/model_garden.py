"""Model Garden BERT checkpoints -> tfpod's bert, read as Model Garden reads them.

    python -m tfpod.convert import --model_garden=CKPT [--bert_config=bert_config.json] --model_dir=D

Two kinds, told apart by their keys:
  * the original Google TF1 BERT checkpoints (`bert/encoder/layer_0/attention/self/query/kernel`
    ...): Model Garden's own converter (official.nlp.tools.tf1_bert_checkpoint_converter_lib,
    what tf2_bert_encoder_checkpoint_converter runs) renames and reshapes them into a
    temporary checkpoint with its Keras names, which is then read one tensor at a time;
  * TF2 object checkpoints of a `BertEncoder` or a `BertPretrainerV2` (any root name, e.g.
    tf.train.Checkpoint(encoder=...), (model=...) or (**pretrainer.checkpoint_items)):
    Model Garden's model of the bert_config.json is built and restored, as its trainers do.

tfpod's bert is Model Garden's encoder, so the names map directly: encoder weights under
`bert/encoder/`, the masked-LM head (`bert/cls/predictions/...`) under `bert/masked_lm/`,
the TF1 next-sentence classifier under `bert/next_sentence/`. bert_config.json's "gelu"
is Model Garden's (and Google BERT's) tanh form: tfpod's gelu_approximate. What the checkpoint lacks
(the heads of an encoder checkpoint, the next-sentence classifier of a TF2 pretrainer)
is initialized fresh, as for Hugging Face's BertModel and BertForMaskedLM.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

from tfpod import UserError
from tfpod.convert import bert
from tfpod.convert.run import write_run

NSP = {"predictions/transform/logits/kernel": "bert/next_sentence/kernel",
       "predictions/transform/logits/bias": "bert/next_sentence/bias"}


def tfpod_name(name: str) -> str:
    """A Model Garden Keras variable name (as its converter writes it) -> tfpod's."""
    if name in NSP:
        return NSP[name]
    if name.startswith("bert/cls/predictions/"):
        return "bert/masked_lm/" + name[len("bert/cls/predictions/"):]
    return "bert/encoder/" + name


def architecture(names) -> str:
    """The Hugging Face architecture with the same parts (what is read, what starts fresh)."""
    names = set(names)
    if not any(n.startswith("bert/masked_lm/") for n in names):
        return "BertModel"
    return "BertForPreTraining" if "bert/next_sentence/kernel" in names else "BertForMaskedLM"


def import_model_garden(path: str, model_dir: str, bert_config: str | None = None, mesh_spec: str | None = None,
                        cpu_devices: int | None = None, gin_params: tuple[str, ...] = ()) -> dict:
    """A Model Garden BERT checkpoint -> model_dir/config.gin and a step-0 checkpoint."""
    import tensorflow as tf

    from tfpod import runtime

    runtime.initialize(cpu_devices=cpu_devices)  # before Model Garden's model or reader touches a device
    if not tf.io.gfile.exists(path + ".index"):
        raise UserError(f"--model_garden={path}: no such checkpoint (expected {path}.index; pass the prefix, e.g. "
                        "bert_model.ckpt)")
    config_path = bert_config or os.path.join(os.path.dirname(path), "bert_config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"--model_garden={path}: no {config_path}; pass --bert_config=the bert_config.json it was "
                        "trained with")
    with open(config_path) as f:
        hub_config = json.load(f)
    keys = [k for k, _ in tf.train.list_variables(path)]
    vocab = os.path.join(os.path.dirname(path), "vocab.txt")
    vocab = vocab if os.path.isfile(vocab) else None
    with tempfile.TemporaryDirectory() as scratch:
        if any(k.endswith("/.ATTRIBUTES/VARIABLE_VALUE") for k in keys):
            names = _restored_tf2(path, hub_config, keys)
            arrays = ((tfpod_name(n), v.numpy(), n) for n, v in names.items())
        else:
            converted = _converted_tf1(path, hub_config, scratch)
            reader = tf.train.load_checkpoint(converted)
            names = sorted(n for n in reader.get_variable_to_shape_map() if not n.startswith(("global_step", "_")))
            arrays = ((tfpod_name(n), reader.get_tensor(n), n) for n in names)
        arch = architecture(tfpod_name(n) for n in names)
        # Model Garden's (and Google BERT's) "gelu" is the tanh form, Hugging Face's gelu_new.
        act = {"gelu": "gelu_new"}.get(hub_config.get("hidden_act", "gelu"), hub_config.get("hidden_act"))
        model_config = bert.model_config({**hub_config, "hidden_act": act, "architectures": [arch]})
        return write_run(bert, arch, model_config, hub_config, arrays, model_dir, mesh_spec, cpu_devices,
                         gin_params, path, vocab)  # (bert's VOCAB_FILE, vocab.txt, beside the checkpoint)


def _converted_tf1(path: str, hub_config: dict, scratch: str) -> str:
    """Model Garden's TF1 -> Keras-names conversion of a Google BERT checkpoint (its optimizer
    slots excluded); returns the temporary checkpoint."""
    from official.nlp.tools import tf1_bert_checkpoint_converter_lib as lib

    out = os.path.join(scratch, "ckpt")
    lib.convert(checkpoint_from_path=path, checkpoint_to_path=out, num_heads=hub_config["num_attention_heads"],
                name_replacements=lib.BERT_V2_NAME_REPLACEMENTS, permutations=lib.BERT_V2_PERMUTATIONS,
                exclude_patterns=["adam", "Adam"])
    return out


def _restored_tf2(path: str, hub_config: dict, keys: list[str]) -> dict:
    """{Model Garden variable name: variable} of the BertEncoder or BertPretrainerV2 the TF2
    checkpoint holds, restored as Model Garden restores it."""
    import tensorflow as tf
    import tf_keras
    from official.modeling import tf_utils
    from official.nlp.modeling import models, networks

    roots = {k.split("/", 1)[0] for k in keys if not k.startswith(("save_counter", "_CHECKPOINTABLE"))}
    init = tf_keras.initializers.TruncatedNormal(stddev=hub_config.get("initializer_range", 0.02))
    encoder = networks.BertEncoder(
        vocab_size=hub_config["vocab_size"], hidden_size=hub_config["hidden_size"],
        num_layers=hub_config["num_hidden_layers"], num_attention_heads=hub_config["num_attention_heads"],
        intermediate_size=hub_config["intermediate_size"], activation=tf_utils.get_activation(hub_config["hidden_act"]),
        max_sequence_length=hub_config["max_position_embeddings"], type_vocab_size=hub_config["type_vocab_size"],
        initializer=init)
    pretrainer = any(re.search(r"masked_lm|mlm|cls", k) for k in keys)
    model = encoder
    if pretrainer:
        model = models.BertPretrainerV2(encoder_network=encoder, mlm_activation=tf_utils.get_activation(
            hub_config["hidden_act"]), mlm_initializer=init)
        model(model.inputs)
    if roots == {"encoder", "masked_lm"}:
        ckpt = tf.train.Checkpoint(**model.checkpoint_items)
    elif len(roots) == 1:
        ckpt = tf.train.Checkpoint(**{roots.pop(): model})
    else:
        raise UserError(f"--model_garden={path}: a TF2 checkpoint with the objects {sorted(roots)}: tfpod reads one "
                        "BertEncoder or BertPretrainerV2 (one root, or encoder and masked_lm)")
    try:
        ckpt.read(path).assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:
        raise UserError(f"--model_garden={path} does not fit the bert_config.json's model "
                        f"({str(e).splitlines()[0][:300]})") from None
    return {w.name.split(":")[0]: w for w in model.weights}
