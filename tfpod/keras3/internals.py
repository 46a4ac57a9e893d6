"""The one place tfpod touches Keras 3's private modules (`keras.src`): compat.py for Keras 3.

The backing (tfpod.keras3) replaces a few methods of Keras 3's TensorFlow backend: how a
variable is made and assigned, the trainer's compiled functions and epoch iterator, and the
functions of the backend's `distribution_lib` prototype. Every such access is a function
here, written against the Keras version in TESTED; `check_version` stops with one line when
another is installed, not later in an AttributeError deep in Keras.

Public API (`keras.distribution.*`, `keras.Model`, `keras.layers.*`) is used directly elsewhere.
"""

from __future__ import annotations

import importlib
import importlib.metadata

from tfpod import UserError

TESTED = "3.15"  # the Keras 3 minor version the accesses below are written for


def check_version(installed: str | None = None) -> None:
    """Raises one UserError line when the installed Keras is not the tested minor version."""
    version = installed or importlib.metadata.version("keras")
    if version != TESTED and not version.startswith(TESTED + "."):
        raise UserError(f"keras {version} is installed, but tfpod's Keras 3 backing (tfpod.keras3) is written against "
                        f"keras {TESTED}.x (it replaces internals that change between versions): pip install "
                        f"'keras=={TESTED}.*'")


def _module(name: str):
    return importlib.import_module(name)


def backend_name() -> str:
    """Keras 3's backend ("tensorflow", "jax", ...), read without importing a backend twice."""
    return _module("keras.src.backend").backend()


def variable_class():
    """The TensorFlow backend's `keras.Variable` class (keras.src.backend.tensorflow.core.Variable)."""
    return _module("keras.src.backend.tensorflow.core").Variable


def backend_distribution_lib():
    """The TensorFlow backend's `distribution_lib` module: the prototype tfpod fills in."""
    return _module("keras.src.backend.tensorflow.distribution_lib")


def trainer_module():
    """keras.src.backend.tensorflow.trainer (TensorFlowTrainer, TFEpochIterator)."""
    return _module("keras.src.backend.tensorflow.trainer")


def base_epoch_iterator_class():
    """Keras's backend-independent EpochIterator (the data adapter, the step counting)."""
    return _module("keras.src.trainers.epoch_iterator").EpochIterator



def global_seed() -> int | None:
    """The seed `keras.utils.set_random_seed` set (None: none was)."""
    return _module("keras.src.utils.rng_utils").get_random_seed()


def tensor_layout_class():
    return _module("keras.src.distribution.distribution_lib").TensorLayout


# ---------------------------------------------------------------------------
# A Keras variable's parts: the backend tf.Variable it wraps, its path, its layout.


def value_of(variable):
    """The backend tf.Variable a Keras variable wraps (None while its initialization is deferred)."""
    return variable._value


def set_value_of(variable, value) -> None:
    variable._value = value


def shape_of(variable):
    """The Keras variable's shape as Keras recorded it (None before `_initialize` of a value)."""
    return variable._shape


def set_shape_of(variable, shape) -> None:
    variable._shape = shape


def dtype_of(variable) -> str:
    return variable._dtype



def set_layout_of(variable, layout) -> None:
    variable._layout = layout


def aggregation_of(variable):
    return variable._map_aggregation(variable.aggregation)


def flatten_layers(model) -> list:
    """Every layer of a Keras 3 model, nested ones included, the model last."""
    return list(model._flatten_layers(include_self=False)) + [model]



def reset_compiled_functions(model) -> None:
    """Drops a model's traced train/test/predict functions (they hold the variables they captured)."""
    model.train_function = model.test_function = model.predict_function = None




def seed_generator_module():
    """keras.src.random.seed_generator (global_seed_generator: the generator unseeded random ops draw from)."""
    return _module("keras.src.random.seed_generator")


def random_module():
    """keras.src.backend.tensorflow.random: the TensorFlow backend's random draws."""
    return _module("keras.src.backend.tensorflow.random")


def draw_seed(seed):
    """The int32 [2] seed a TensorFlow-backend random op draws from (a SeedGenerator advances)."""
    module = random_module()
    return module._cast_seed(module.draw_seed(seed))


def concrete_noise_shape(inputs, noise_shape):
    return random_module()._get_concrete_noise_shape(inputs, noise_shape)


def nn_module():
    """keras.src.backend.tensorflow.nn: convolutions, pooling (what keras.ops.* call)."""
    return _module("keras.src.backend.tensorflow.nn")


def tf_optimizer_class():
    """The TensorFlow backend's optimizer base class (keras.src.backend.tensorflow.optimizer.TFOptimizer)."""
    return _module("keras.src.backend.tensorflow.optimizer").TFOptimizer


def embedding_table(layer):
    """An Embedding layer's own table variable (a Keras variable; `embeddings` adds LoRA to it)."""
    return getattr(layer, "_embeddings", None)


def image_module():
    """keras.src.backend.tensorflow.image: resize (what Resizing and keras.ops.image.resize call)."""
    return _module("keras.src.backend.tensorflow.image")


def base_trainer_class():
    """keras.src.trainers.trainer.Trainer (compile lives there; Keras compares a model's compile to it)."""
    return _module("keras.src.trainers.trainer").Trainer


def backup_save_method(callback_class):
    """keras.callbacks.BackupAndRestore's method that writes the backup (weights, then epoch metadata)."""
    return callback_class._save_model


def set_backup_save_method(callback_class, method) -> None:
    callback_class._save_model = method


def backup_weights_path(callback) -> str:
    return callback._weights_path


def distribution_base_class():
    """keras.src.distribution.distribution_lib.Distribution (DataParallel's and ModelParallel's base)."""
    return _module("keras.src.distribution.distribution_lib").Distribution
