"""Keras models tfpod trains, each a task module with the same surface.

A task module declares: NAME, Config (dataclass, gin-configurable as `<NAME>.*`),
DEFAULT_PRESET, AXIS_RULES (variable-path rules giving logical axes), build(config),
input_signature(config), batch_axes(), synthetic_batch(config, rows, rng),
loss_and_metrics(model, batch, training), flops_per_token(config), EVAL_METRIC, and its
input: DATA (the gin name of its data config), DataConfig, and
make_input(data_config, model_config, num_hosts, host_id, seed) -> tfpod.input.pipeline.TaskInput.
"""

from tfpod.models import bert, gpt, moe, resnet, transformer

TASKS = {gpt.NAME: gpt, moe.NAME: moe, bert.NAME: bert, resnet.NAME: resnet, transformer.NAME: transformer}


def get_task(name: str):
    """The task module registered under `name`."""
    from tfpod import UserError

    if name not in TASKS:
        raise UserError(f"experiment.model={name!r} is not a model: use one of {', '.join(sorted(TASKS))}")
    return TASKS[name]
