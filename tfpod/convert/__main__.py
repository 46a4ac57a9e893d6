"""python -m tfpod.convert import|export: see tfpod.convert."""

from __future__ import annotations

import sys

import tfpod  # noqa: F401  (selects tf_keras before TensorFlow loads)
from absl import app, flags

from tfpod import UserError, console

FLAGS = flags.FLAGS
flags.DEFINE_string("hf", None, "import: a Hugging Face model folder (config.json + safetensors); export: the folder "
                    "to write (a LoRA run's with its adapters merged)")
flags.DEFINE_string("peft", None, "export: a LoRA run's adapters alone, as a PEFT folder to write "
                    "(adapter_config.json + adapter_model.safetensors)")
flags.DEFINE_string("model_garden", None, "import: a Model Garden BERT checkpoint prefix (TF2 BertEncoder or "
                    "BertPretrainerV2, or a Google TF1 BERT checkpoint such as bert_model.ckpt)")
flags.DEFINE_string("bert_config", None, "import --model_garden: its bert_config.json (default: next to the checkpoint)")
flags.DEFINE_string("model_dir", None, "the tfpod run's folder (import writes config.gin and checkpoints/ there)")
flags.DEFINE_string("checkpoint", None, "export: the checkpoint prefix (default: the newest in model_dir)")
flags.DEFINE_string("mesh", None, "import: mesh spec to place the weights on, e.g. data:4,model:2 (default: data:-1)")
flags.DEFINE_integer("cpu_devices", None, "split the host CPU into this many logical devices")
flags.DEFINE_multi_string("gin_param", [], "import: gin bindings added to the written config.gin")

COMMANDS = ("import", "export")


def main(argv) -> None:
    verbose = FLAGS.verbosity >= 1
    console.setup(verbose)
    try:
        if len(argv) != 2 or argv[1] not in COMMANDS:
            raise UserError(f"usage: python -m tfpod.convert {'|'.join(COMMANDS)} --hf=DIR|--model_garden=CKPT --model_dir=D "
                            f"(got {' '.join(argv[1:]) or 'no command'})")
        if argv[1] == "import" and bool(FLAGS.hf) == bool(FLAGS.model_garden):
            raise UserError("import needs one of --hf (a Hugging Face folder) or --model_garden (a checkpoint)")
        if not FLAGS.model_dir or (argv[1] == "export" and not (FLAGS.hf or FLAGS.peft)):
            raise UserError(f"{argv[1]} needs --model_dir" + (" and --hf or --peft (the folder to write)"
                                                               if argv[1] == "export" else ""))
        with console.quiet(enabled=not verbose and tfpod.USER_TF_LOG_LEVEL is None):
            from tfpod.convert import run

            if argv[1] == "import" and FLAGS.model_garden:
                from tfpod.convert import model_garden

                model_garden.import_model_garden(FLAGS.model_garden, FLAGS.model_dir, FLAGS.bert_config, FLAGS.mesh,
                                                 FLAGS.cpu_devices, tuple(FLAGS.gin_param))
            elif argv[1] == "import":
                run.import_hub(FLAGS.hf, FLAGS.model_dir, FLAGS.mesh, FLAGS.cpu_devices, tuple(FLAGS.gin_param))
            else:
                if FLAGS.hf:
                    run.export_hub(FLAGS.model_dir, FLAGS.hf, FLAGS.checkpoint)
                if FLAGS.peft:
                    from tfpod.convert import peft

                    peft.export_peft(FLAGS.model_dir, FLAGS.peft, FLAGS.checkpoint)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        if verbose:
            raise
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
