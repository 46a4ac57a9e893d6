"""Context parallelism: a `context` mesh axis splits every activation of a decoder along the
sequence (tfpod.partitioning.context, tfpod.attention.context_attention). Losses equal
`data:8`'s at 4,096 tokens with packed documents; checkpoints move between meshes with and
without `context`; a resumed run is exact; it composes with the presets, recomputation,
microbatches and pipeline stages."""

import json
import shutil

import numpy as np
import pytest

import tfpod
from conftest import device_mesh, main_py
from tfpod import UserError
from tfpod.api import run
from tfpod.partitioning import context

LONG = ["gpt.seq_len=4096", "gpt.num_layers=1", "gpt.embed_dim=16", "gpt.num_heads=2", "gpt.mlp_dim=32",
        "train.global_batch_size=8",
        "train.steps=2", "train.log_every=1", "train.steps_per_loop=1", "train.checkpoint_every=100",
        "lm_data.packing='segments'", "attention.block_size=1024"]
SHORT = ["gpt.seq_len=256", "train.global_batch_size=8", "train.log_every=1", "train.steps_per_loop=1",
         "lm_data.packing='segments'", "attention.block_size=32"]


@pytest.mark.unit
def test_the_balanced_order_gives_each_device_a_chunk_from_each_end():
    order = context.zigzag(16, 4)  # 8 chunks of 2: device c holds chunks c and 7 - c
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(order) == list(range(16))
    with pytest.raises(UserError, match="does not split into 8 equal chunks"):
        context.zigzag(12, 4)


def test_context_meshes_give_data_parallel_losses_at_4096_tokens(tmp_path):
    """A 1-layer GPT at 4,096 tokens with packed documents (segments crossing the chunks'
    boundaries) trains data:8's losses (relative 1e-5, fp32) on `context:2,model:2,data:2`
    with the `2d` preset (Megatron's heads and MLP over `model`, weights' embed dimension over
    `data`), recomputation and 2 microbatches. (`context:4`: the checkpoint test below.)"""
    out = {}
    for spec, params in (("data:8", []), ("context:2,model:2,data:2", ["sharding.preset='2d'", "gpt.remat=True",
                                                                            "train.microbatches=2"])):
        model_dir = tmp_path / spec.replace(":", "").replace(",", "_")
        out[spec] = run(["gin/lm_tiny.gin"], LONG + params, str(model_dir), mesh_spec=spec)["losses"]
    assert len(out["data:8"]) == 2
    np.testing.assert_allclose(out["context:2,model:2,data:2"], out["data:8"], rtol=1e-5)
    assert "on mesh context:2,model:2,data:2" in (tmp_path / "context2_model2_data2" / "layouts.txt").read_text()


def test_checkpoints_move_between_meshes_with_and_without_context_and_resume_exactly(tmp_path):
    """A 1-layer GPT at 256 tokens, packed: 4 steps on data:8; 2 steps on context:4,data:2 resumed for 2
    on data:8, and 2 on data:8 resumed on context:2,model:2,data:2 (tensor), give its losses
    (relative 1e-5); 2 steps on context:4,data:2 resumed there give the uninterrupted context
    run's losses exactly."""
    def train(name, spec, steps, preset="data"):
        params = SHORT + [f"train.steps={steps}", "train.checkpoint_every=2", f"sharding.preset='{preset}'",
                          "gpt.num_layers=1"]
        return run(["gin/lm_tiny.gin"], params, str(tmp_path / name), mesh_spec=spec)["losses"]

    whole = train("whole", "data:8", 4)
    train("a", "context:4,data:2", 2)
    shutil.copytree(tmp_path / "a", tmp_path / "d")  # (resumed on its own mesh below)
    np.testing.assert_allclose(train("a", "data:8", 4), whole[2:], rtol=1e-5)
    train("b", "data:8", 2)
    np.testing.assert_allclose(train("b", "context:2,model:2,data:2", 4, "tensor"), whole[2:], rtol=1e-5)
    uninterrupted = train("c", "context:4,data:2", 4)
    np.testing.assert_allclose(uninterrupted, whole, rtol=1e-5)
    assert train("d", "context:4,data:2", 4) == uninterrupted[2:]


def test_llama_and_pipeline_stages_under_context(tmp_path):
    """A 1-layer Llama (rotary positions, grouped-query attention) on context:2,model:2,data:2 (tensor),
    and GPT in 2 pipeline stages of context:2,data:2: data:8's losses (relative 1e-5)."""
    def losses(name, gin, spec, *params):
        p = SHORT + ["train.steps=2", "train.checkpoint_every=100", *params]
        if gin == "gin/llama_tiny.gin":
            p = [x.replace("gpt.", "llama.") for x in p] + ["llama.num_layers=1"]
        return run([gin], p, str(tmp_path / name), mesh_spec=spec)["losses"]

    llama = losses("llama", "gin/llama_tiny.gin", "data:8")
    np.testing.assert_allclose(losses("llama_c", "gin/llama_tiny.gin", "context:2,model:2,data:2",
                                      "sharding.preset='tensor'"), llama, rtol=1e-5)
    # (the pipeline in its own process: a stage mesh's step picked up a scalar of this process's earlier meshes)
    staged = tmp_path / "stages"
    result = main_py("--gin_file=gin/lm_tiny.gin", "--cpu_devices=8", "--mesh=stage:2,context:2,data:2",
                     f"--model_dir={staged}", "--nopreflight",
                     *[f"--gin_param={p}" for p in SHORT + ["train.steps=2", "train.microbatches=2"]])
    assert result.returncode == 0, result.stderr[-2000:]
    stages = [json.loads(l)["loss"] for l in open(staged / "metrics.jsonl") if '"train"' in l]
    np.testing.assert_allclose(stages, losses("gpt", "gin/lm_tiny.gin", "data:8"), rtol=1e-5)


def test_context_refuses_what_it_cannot_split(tmp_path):
    """Attention dropout under `context`, a padding-masked encoder (BERT), a sequence the
    balanced chunks do not divide, and a Keras model under fit: one clear line each."""
    with pytest.raises(UserError, match="the mesh's `context` axis .* a Keras model under fit cannot"):
        tfpod.sharding(device_mesh("context:4,data:2"))
    with pytest.raises(UserError, match="context` mesh axis needs a decoder's self-attention"):
        run(["gin/bert_tiny.gin"], ["train.steps=1", "train.synthetic_data=True"], str(tmp_path / "bert"),
            mesh=device_mesh("context:2,data:4"))
    with pytest.raises(UserError, match="context` mesh axis needs a decoder's self-attention"):
        run(["gin/lm_tiny.gin"], SHORT + ["train.steps=1", "gpt.attention_dropout=0.1"], str(tmp_path / "a"),
            mesh=device_mesh("context:4,data:2"))
    with pytest.raises(UserError, match="a sequence of 100 tokens does not split into 8 equal chunks"):
        run(["gin/lm_tiny.gin"], SHORT + ["train.steps=1", "gpt.seq_len=100"], str(tmp_path / "b"),
            mesh=device_mesh("context:4,data:2"))
