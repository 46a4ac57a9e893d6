"""Keras 3's `keras.distribution` backend functions for TensorFlow, made real with DTensor.

Keras 3 calls its backend's `distribution_lib` for devices, the multi-host start, meshes,
layouts and relayouts; on TensorFlow that module is a prototype ("DO NOT USE",
`distribute_value` a TODO). `install` puts these functions in its place:

  list_devices, get_device_count   this job's devices ("cpu:0", ...; every host's), starting
                                   tfpod's runtime first (logical CPU devices, DTensor clients)
  initialize                       `keras.distribution.initialize(job_addresses, num_processes,
                                   process_id)`: tfpod's multi-host runtime (the same
                                   DTENSOR_* environment `tfpod.launch` sets)
  num_processes, process_id        hosts and this host's index
  _to_backend_mesh                 a DeviceMesh -> a dtensor.Mesh over its devices
  _to_backend_layout               a TensorLayout -> a dtensor.Layout
  distribute_tensor (= distribute_value)  a value in a layout: a relayout inside a step, a
                                   host value placed piece by piece outside one
  distribute_variable              a DVariable of a value in a layout
  distribute_data_input            this host's rows of a batch -> one batch-sharded DTensor
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpod import UserError, runtime
from tfpod.keras3 import internals, placement

def _runtime() -> runtime.RuntimeInfo:
    """tfpod's runtime, started on first use (logical CPU devices from $TFPOD_CPU_DEVICES,
    DTensor clients from DTENSOR_*); one line when TensorFlow already started without it."""
    try:
        return runtime.info()
    except RuntimeError as e:  # TensorFlow's devices were fixed before the runtime could start
        raise UserError(
            "keras.distribution on TensorFlow needs tfpod's DTensor runtime, and TensorFlow had already started "
            "without it: call keras.distribution.initialize() (or tfpod.runtime.initialize(cpu_devices=8) for 8 "
            f"logical CPU devices) before any TensorFlow op runs ({e})") from None


def list_devices(device_type: str | None = None) -> list[str]:
    """Every device of the job ("cpu:0" ... in global order), of `device_type` or the runtime's.

    Raises:
      UserError: a device type other than the one tfpod's runtime runs.
    """
    info = _runtime()
    if device_type is not None and device_type.upper() != info.device_type:
        raise UserError(f"keras.distribution.list_devices({device_type!r}): tfpod's runtime runs {info.device_type} "
                        f"devices; ask for {info.device_type.lower()!r} (or None)")
    return [f"{info.device_type.lower()}:{i}" for i in range(info.num_global_devices)]


def get_device_count(device_type: str | None = None) -> int:
    return len(list_devices(device_type))


def initialize(job_addresses: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """`keras.distribution.initialize`: this host joins a multi-host DTensor job.

    Args:
      job_addresses: "host:port,host:port,..." of every process, in process order
        (DTENSOR_JOBS); None: the environment's (tfpod.launch, SLURM, Kubernetes).
      num_processes: processes in the job; process_id: this one's index.
    """
    given = [job_addresses is not None, num_processes is not None, process_id is not None]
    if any(given):
        if not all(given):
            raise UserError("keras.distribution.initialize: give job_addresses, num_processes and process_id together "
                            "(or none of them, to take the environment tfpod.launch or the cluster sets)")
        runtime.configure_hosts(int(num_processes), int(process_id), job_addresses)
    else:
        runtime.configure_hosts(None, None, None)
    _runtime()


def num_processes() -> int:
    return _runtime().num_clients


def process_id() -> int:
    return _runtime().client_id


def _device_ids(device_mesh) -> np.ndarray:
    """The global ids of a DeviceMesh's devices ("cpu:3" -> 3), in the mesh's shape."""
    info = _runtime()
    ids = []
    for d in np.asarray(device_mesh.devices).flatten():
        kind, _, index = str(d).rpartition(":")
        if kind.upper() != info.device_type or not index.isdigit() or int(index) >= info.num_global_devices:
            raise UserError(f"keras.distribution.DeviceMesh: device {d!r} is not one of this job's "
                            f"{info.num_global_devices} {info.device_type} devices: take them from "
                            "keras.distribution.list_devices()")
        ids.append(int(index))
    if len(set(ids)) != len(ids):
        raise UserError(f"keras.distribution.DeviceMesh: a device appears twice in {list(device_mesh.devices.flat)}")
    return np.array(ids).reshape(device_mesh.shape)


def _to_backend_mesh(device_mesh) -> dtensor.Mesh:
    """A Keras DeviceMesh as a dtensor.Mesh with the same axis names, sizes and device order.

    Raises:
      UserError: a device not of this job, or (several hosts) devices not in the job's order.
    """
    info = _runtime()
    ids = _device_ids(device_mesh)
    dims = list(zip(device_mesh.axis_names, [int(s) for s in device_mesh.shape]))
    if info.num_clients > 1:
        if not np.array_equal(ids.flatten(), np.arange(ids.size)) or ids.size != info.num_global_devices:
            raise UserError("keras.distribution.DeviceMesh on several hosts: list every device of the job in "
                            "keras.distribution.list_devices() order (each host holds its own devices in that "
                            "order; reorder the mesh's axes instead)")
        return dtensor.create_distributed_mesh(dims, device_type=info.device_type)
    devices = [f"{info.device_type}:{i}" for i in ids.flatten()]
    return dtensor.create_mesh(dims, devices=devices, device_type=info.device_type)


def _to_backend_layout(tensor_layout) -> dtensor.Layout:
    """A Keras TensorLayout (its device mesh set) as a dtensor.Layout."""
    if tensor_layout.device_mesh is None:
        raise UserError(f"keras.distribution.TensorLayout{tuple(tensor_layout.axes)} has no device mesh: give it one "
                        "(TensorLayout(axes, device_mesh)) or put it in a LayoutMap made with one")
    mesh = tensor_layout.device_mesh.backend_mesh
    return dtensor.Layout([a if a is not None else dtensor.UNSHARDED for a in tensor_layout.axes], mesh)


def backend_layout(layout) -> dtensor.Layout:
    """A TensorLayout or dtensor.Layout as a dtensor.Layout."""
    if isinstance(layout, dtensor.Layout):
        return layout
    if isinstance(layout, internals.tensor_layout_class()):
        return layout.backend_layout
    raise UserError(f"expected a keras.distribution.TensorLayout, got {type(layout).__name__} {layout!r}")


def distribute_tensor(tensor, layout):
    """`keras.distribution.distribute_tensor`: `tensor` in `layout`.

    Inside a step (a DTensor function) a relayout; outside one, a host value is placed piece
    by piece and a DTensor relaid out.
    """
    layout = backend_layout(layout)
    if not tf.executing_eagerly():
        return dtensor.relayout(tensor, layout)
    if isinstance(tensor, tf.Tensor) and dtensor.is_dtensor(tensor):
        return tensor if dtensor.fetch_layout(tensor) == layout else dtensor.relayout(tensor, layout)
    value = np.asarray(tensor)
    placement.check_layout(layout, value.shape, "keras.distribution.distribute_tensor: a value")
    return placement.place(value, layout)


def distribute_variable(value, layout) -> dtensor.DVariable:
    """A DVariable holding `value` in `layout`."""
    return dtensor.DVariable(distribute_tensor(value, layout))


def distribute_data_input(per_process_batch, layout, batch_dim_name: str | None = None) -> tf.Tensor:
    """This host's rows of a batch (all of it on one host) -> a DTensor split over the batch axis."""
    return placement.place_rows(np.asarray(per_process_batch), backend_layout(layout))


FUNCTIONS = {
    "list_devices": list_devices, "get_device_count": get_device_count, "initialize": initialize,
    "num_processes": num_processes, "process_id": process_id, "_to_backend_mesh": _to_backend_mesh,
    "_to_backend_layout": _to_backend_layout, "distribute_tensor": distribute_tensor,
    "distribute_value": distribute_tensor, "distribute_variable": distribute_variable,
    "distribute_data_input": distribute_data_input,
}


def install() -> None:
    """Fills the TensorFlow backend's distribution_lib prototype with these functions."""
    module = internals.backend_distribution_lib()
    for name, function in FUNCTIONS.items():
        setattr(module, name, function)
