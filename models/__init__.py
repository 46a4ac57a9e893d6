"""The models tfpod trains, each with its Task (tfpod.task.Task): the registry of tasks by name.

To add one, see tfpod/task.py: a model module with its Task subclass, its instance
added here, and its gin files.
"""

from tfpod import UserError
from tfpod.models import bert, dlrm, gpt, llama, moe, resnet, ssd, transformer
from tfpod.task import Task, check_task

TASKS: dict[str, Task] = {t.name: t for t in (gpt.TASK, moe.TASK, llama.TASK, bert.TASK, resnet.TASK,
                                               transformer.TASK, ssd.TASK, dlrm.TASK)}
for _task in TASKS.values():
    check_task(_task)


def get_task(name: str) -> Task:
    """The task registered under `name` (experiment.model)."""
    if name not in TASKS:
        raise UserError(f"experiment.model={name!r} is not a model: use one of {', '.join(sorted(TASKS))}")
    return TASKS[name]
