"""Published checkpoints in and out: Hugging Face GPT-2, BERT, Llama and Mistral.

    python -m tfpod.convert import --hf=DIR --model_dir=D [--mesh=... --cpu_devices=N]
    python main.py --model_dir=D [--gin_param=...]          # fine-tune: D/config.gin holds the model
    python -m tfpod.convert export --model_dir=D --hf=OUT [--checkpoint=D/checkpoints/ckpt-N]

  hub     Hugging Face folders: config.json, safetensors (one file or an index), one tensor at a time
  params  Param: one Hub tensor <-> tfpod variable(s), with both conversions
  gpt2    GPT2LMHeadModel <-> gpt
  bert    BertForPreTraining, BertForMaskedLM, BertModel <-> bert
  llama   LlamaForCausalLM, MistralForCausalLM <-> llama (Llama 3.1's rope_scaling too)
  run     import_hub (build the run on its mesh, fill it, step-0 checkpoint, config.gin), export_hub

A new family is a module like gpt2.py (model_type, config mapping both ways, its Params)
added to run.FAMILIES.

From Python: `tfpod.convert.run.import_hub(...)` and `export_hub(...)` (this package
imports nothing itself, so `python -m tfpod.convert` quiets TensorFlow before it loads).
"""
