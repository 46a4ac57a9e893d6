"""Mesh spec parsing (no devices needed) and meshes over the 8 logical test devices."""

import pytest

from tfpod import UserError
from tfpod.mesh import describe, make_mesh, parse_mesh_spec


@pytest.mark.parametrize(
    "spec,n,expected",
    [
        ("data:-1", 8, [("data", 8)]),
        ("data:-1,model:2", 8, [("data", 4), ("model", 2)]),
        ("data:2,model:-1", 8, [("data", 2), ("model", 4)]),
        ("data:1,model:8", 8, [("data", 1), ("model", 8)]),
        (" data : 4 , model : 2 ", 8, [("data", 4), ("model", 2)]),
        ("data:2,expert:4", 8, [("data", 2), ("expert", 4)]),
        ("data:-1,model:2", 16, [("data", 8), ("model", 2)]),
    ],
)
@pytest.mark.unit
def test_parse_resolves(spec, n, expected):
    assert parse_mesh_spec(spec, n) == expected


@pytest.mark.parametrize(
    "spec,n,needle",
    [
        ("data:4,model:4", 8, "has 16 devices but the job has 8"),
        ("data:2", 8, "has 2 devices but the job has 8"),
        ("data:-1,model:-1", 8, "at most one axis may be -1"),
        ("data:-1,model:3", 8, "does not divide the 8 devices"),
        ("data", 8, "is not 'name:size'"),
        ("data:x", 8, "is not an integer"),
        ("data:0", 8, "sizes are positive"),
        ("data:-2", 8, "sizes are positive"),
        ("data:4,data:2", 8, "appears twice"),
        ("", 8, "is empty"),
        ("1data:8", 8, "is not 'name:size'"),
    ],
)
@pytest.mark.unit
def test_parse_errors_are_one_clear_line(spec, n, needle):
    with pytest.raises(UserError) as e:
        parse_mesh_spec(spec, n)
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg


@pytest.mark.unit
def test_error_names_both_numbers():
    with pytest.raises(UserError, match=r"has 12 devices but the job has 8"):
        parse_mesh_spec("data:3,model:4", 8)


@pytest.mark.unit
def test_make_mesh_over_logical_devices():
    mesh = make_mesh("data:-1,model:2")
    assert mesh.dim_names == ["data", "model"]
    assert (mesh.dim_size("data"), mesh.dim_size("model")) == (4, 2)
    assert mesh.device_type() == "CPU"
    assert len(mesh.local_devices()) == 8


@pytest.mark.unit
def test_describe_logs_batch_and_tokens():
    mesh = make_mesh("data:4,model:2")
    line = describe(mesh, global_batch=16, seq_len=64)
    assert "data:4,model:2" in line
    assert "global batch 16" in line
    assert "per-device batch 4" in line
    assert "tokens per step 1024" in line
    with pytest.raises(UserError, match="does not divide over mesh axis 'data' of size 4"):
        describe(mesh, global_batch=6, seq_len=64)


@pytest.mark.unit
def test_logical_cpu_devices_share_the_cores():
    """8 logical devices on this host's cores: each op gets cores // 8 intra-op threads
    (at least 1) instead of every core (runtime._share_cores), and the knob is validated."""
    import os

    import tensorflow as tf

    from tfpod import runtime

    assert runtime.info().num_local_devices == 8
    if not os.environ.get("TF_NUM_INTRAOP_THREADS"):  # (a user's setting wins)
        assert tf.config.threading.get_intra_op_parallelism_threads() == max(1, len(os.sched_getaffinity(0)) // 8)
    os.environ["TFPOD_GRAPH_OPTIMIZATIONS"], saved = "yes", os.environ.get("TFPOD_GRAPH_OPTIMIZATIONS")
    try:
        with pytest.raises(UserError, match="TFPOD_GRAPH_OPTIMIZATIONS='yes': use 1"):
            runtime.initialize(cpu_devices=8, device_type="CPU")
    finally:
        os.environ["TFPOD_GRAPH_OPTIMIZATIONS"] = saved or "0"


def test_a_callers_own_mesh_runs_and_what_cannot_be_one_is_one_line(tmp_path):
    """api.run(..., mesh=M): a dtensor.Mesh the caller built (here over 1 of the 8 devices)
    instead of a spec; anything else, a spec beside it, or --mode=plan is one line, before
    anything is written."""
    from conftest import device_mesh
    from tfpod.api import run

    small = ["gpt.num_layers=1", "train.steps=1", "train.steps_per_loop=1", "train.log_every=1",
             "train.synthetic_data=True", "train.global_batch_size=4"]
    for kwargs, needle in [(dict(mesh="data:1"), "RunOptions.mesh: a dtensor.Mesh, not str; or give mesh_spec"),
                           (dict(mesh=device_mesh(), mesh_spec="data:8"),
                            "RunOptions: mesh_spec='data:8' and a mesh given; give one of them"),
                           (dict(mesh=device_mesh(), mode="plan"), "--mode=plan plans a mesh spec (mesh_spec), not a "
                                                                   "built mesh: give mesh_spec")]:
        with pytest.raises(UserError) as e:
            run(["gin/lm_tiny.gin"], small, str(tmp_path / "bad"), **kwargs)
        assert str(e.value) == needle
        assert not (tmp_path / "bad" / "config.gin").exists()
    out = run(["gin/lm_tiny.gin"], small, str(tmp_path / "one"), mesh=device_mesh())
    assert out["step"] == 1 and "on mesh data:1,model:1" in (tmp_path / "one" / "layouts.txt").read_text()
