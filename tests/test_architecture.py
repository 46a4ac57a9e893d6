"""The seams a contributor builds on: the Task contract, the run API's modes, the config
registry, the compatibility module's version check, and the precision policy restored."""

import dataclasses

import numpy as np
import pytest
import tf_keras

from tfpod import UserError, api, compat, config
from tfpod.models import TASKS, get_task
from tfpod.task import Task, check_task

pytestmark = pytest.mark.unit  # no multi-device training


def test_every_model_implements_the_task_contract_and_declares_its_capabilities():
    """The registry (tfpod.models.TASKS) is the one list of models; a capability is declared on
    the class, with the method or config switch it stands for (tfpod reads the declaration, never
    probes for the method or the field)."""
    assert len(TASKS) >= 6 and "gpt" in TASKS
    for name, task in TASKS.items():
        assert isinstance(task, Task) and task.name == name
        assert not getattr(type(task), "__abstractmethods__", None), (name, type(task).__abstractmethods__)
        assert dataclasses.is_dataclass(task.config_class) and dataclasses.is_dataclass(task.data_config_class)
        assert task.axis_rules and task.default_preset
        check_task(task)
        assert task.pipelines == (type(task).staged is not Task.staged), name
        assert task.serves == (type(task).serving is not Task.serving), name
        fields = {f.name for f in dataclasses.fields(task.config_class)}
        assert task.recomputes == ("remat" in fields), name
        assert task.skips_corrupt == ("skip_corrupt" in {f.name for f in dataclasses.fields(task.data_config_class)}), name
    assert {n for n, t in TASKS.items() if t.pipelines} == {"gpt", "moe", "llama", "bert"}
    assert isinstance(TASKS["moe"], type(TASKS["gpt"]))  # MoE reuses GPT by subclassing
    with pytest.raises(UserError, match=r"experiment.model='gtp' is not a model: use one of bert, dlrm, gpt, llama, moe"):
        get_task("gtp")


def test_a_task_missing_part_of_the_contract_is_refused():
    class Half(Task):  # a config and methods, but no rules
        name, config_class, data_name, data_config_class = "half", object, "half_data", object
        default_preset, eval_metric = "data", None

    with pytest.raises(TypeError, match="abstract"):
        Half()
    Half.__abstractmethods__ = frozenset()
    with pytest.raises(TypeError, match=r"task Half does not set Task.axis_rules"):
        check_task(Half())
    Half.axis_rules = TASKS["gpt"].axis_rules
    with pytest.raises(TypeError, match=r"task Half: its data_config_class <class 'object'> is not a dataclass "
                                        r"subclassing tfpod.input.common.DataConfig"):
        check_task(Half())


def test_a_task_without_serving_trains_and_export_refuses_it_in_one_line(tmp_path):
    """A research model need not write a SavedModel signature to train: Task.serving is optional."""
    from tfpod import export
    from tfpod.models import resnet

    class Unserved(resnet.ResNetTask):
        serving = Task.serving
        serves = False

    task = Unserved()
    check_task(task)
    config = resnet.ResNetConfig(depth=10, depth_multiplier=0.25, image_size=32, num_classes=10)
    batch = task.synthetic_batch(config, 2, np.random.default_rng(0))
    model = task.build(config)
    loss, _ = task.loss_and_metrics(model, batch, True)  # the training loss needs no serving
    assert float(loss) > 0
    with pytest.raises(UserError, match=r"model 'resnet' has no serving signatures \(Task.serving\): it trains"):
        export.export(task, config, task.data_config_class(), str(tmp_path))


def test_every_task_is_configurable_under_its_gin_names():
    config.parse_config(["gin/lm_tiny.gin"], ["train.steps=3"])
    for task in TASKS.values():
        assert isinstance(config.build_config(task.name), task.config_class)
        assert isinstance(config.build_config(task.data_name), task.data_config_class)
    assert config.build_config("train").steps == 3


def test_every_knob_is_documented_and_docs_config_md_is_generated_from_the_dataclasses():
    """docs/config.md is `python -m tfpod.config_doc`'s output: a knob added, renamed or
    re-described in a config dataclass without regenerating the page fails here."""
    import os

    from tfpod import config_doc

    assert config_doc.undocumented() == []
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")).read()
    assert page == config_doc.markdown(), "docs/config.md is stale: python -m tfpod.config_doc > docs/config.md"
    for name in ("train.microbatches", "ssd.nms_iou", "detection_data.train_files", "gpt.remat", "moe.num_layers"):
        assert f"`{name}`" in page


def test_main_modes_are_the_run_apis():
    from tfpod import main

    assert set(api.MODES) == {"train", "eval", "train_and_eval", "export", "plan"}
    assert set(main.FLAGS["mode"].parser.enum_values) == set(api.MODES)
    with pytest.raises(UserError, match="--mode='serve'"):
        api.run(["gin/lm_tiny.gin"], [], "/nonexistent/run", mode="serve")


def test_other_library_versions_stop_with_one_line():
    compat.check_versions()  # the installed ones are the tested ones
    with pytest.raises(UserError) as e:
        compat.check_versions({"tf-keras": "2.21.0"})
    assert str(e.value).startswith("tf-keras 2.21.0 is installed, but tfpod is written against tf-keras 2.20.x")
    assert "pip install 'tf-keras==2.20.*'" in str(e.value) and "\n" not in str(e.value)
    compat.check_versions({"tensorflow": "2.20.3"})  # a patch release is the same minor version


def test_the_precision_policy_is_restored_not_reset():
    from tfpod.precision import precision_policy

    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with precision_policy("mixed_bfloat16"):
            assert tf_keras.mixed_precision.global_policy().name == "mixed_bfloat16"
        assert tf_keras.mixed_precision.global_policy().name == "mixed_float16"
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def test_a_log_level_tfpod_set_is_not_taken_for_the_users_by_its_children():
    """A pytest worker or a launched host inherits the level tfpod set in its parent; it is
    still tfpod's to choose (the console filter stays on), while a user's own level is kept."""
    import os
    import subprocess
    import sys

    probe = [sys.executable, "-c", "import tfpod; print(tfpod.USER_TF_LOG_LEVEL)"]
    inherited = {**os.environ}
    inherited.update(TF_CPP_MIN_LOG_LEVEL="2", TFPOD_SET_TF_CPP_MIN_LOG_LEVEL="2")
    assert subprocess.run(probe, env=inherited, capture_output=True, text=True).stdout.strip() == "None"
    users = {**inherited, "TF_CPP_MIN_LOG_LEVEL": "1"}
    assert subprocess.run(probe, env=users, capture_output=True, text=True).stdout.strip() == "1"


def test_the_cpu_line_says_which_kernel_path_runs():
    """.ci/run prints it first: a CI log says whether oneDNN or Eigen kernels were checked."""
    import os
    import subprocess
    import sys

    from tfpod import runtime

    avx512 = " avx512f " in open("/proc/cpuinfo").read()
    line = runtime.describe_cpu()
    on = avx512 and os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0"
    assert line.startswith("cpu: ") and ("oneDNN on" if on else "oneDNN off") in line, line
    assert ("AVX-512 yes" if avx512 else "AVX-512 no") in line and "TensorFlow 2.20" in line
    if on:  # TF_ENABLE_ONEDNN_OPTS=0 gives the Eigen path, and the line says so
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
        line = subprocess.run([sys.executable, "-c", "from tfpod import runtime; print(runtime.describe_cpu())"],
                              capture_output=True, text=True, env=env, timeout=120).stdout.strip()
        assert "oneDNN off (TF_ENABLE_ONEDNN_OPTS=0)" in line, line
