"""The one place tfpod touches private parts of tf_keras, Model Garden and TensorFlow.

tfpod builds on internals these libraries do not promise to keep: how tf_keras makes a model's
variables lazily and places them on a mesh, optimizer slots, a layer's random generator, the
steps of MultiHeadAttention's call, Model Garden layers' one-hot switches. Every such access is
a function here, written against the versions in TESTED; importing this package checks the
installed versions first and stops with one line when one differs (setup.py pins them), not
later in an AttributeError deep in a library.

Its modules, by what they touch (this package re-exports their names: `compat.<name>`):

  versions          TESTED, check_versions (run at import)
  keras_layers      tf_keras: layer traversal, calls and builds, lazy variables and their
                    placement, random generators and masks, training state
  keras_optimizers  tf_keras's legacy optimizers (Model Garden's) and metrics on a mesh
  keras_attention   MultiHeadAttention's (and CachedAttention's) steps, projections, dropout
  model_garden      Model Garden layers: embeddings' switches, BertEncoderV2's parts
  tf_core           TensorFlow: checkpoints, oneDNN, variable handles, tf.data and DTensor
                    iterators, a 1-device mesh's DTensor program called directly; sacrebleu's
                    statistics

Public API (tf_keras.Model, tf_keras.layers.*, tf.data, dtensor) is used directly elsewhere.
"""

from __future__ import annotations

from tfpod.compat.versions import TESTED, check_versions
from tfpod.compat.keras_layers import (assign_moving_average, build_layer, call_training, causal_padding,
                                       check_replayable_dropout, create_dvariable, dtensor_save_spec, first_paths,
                                       flatten, flatten_layers, inner_variable, intercept_variable_reads,
                                       intercepting_layer_builds, intercepting_layer_calls, is_functional, keras_mask,
                                       layout_map_lib, layout_map_of, lazy_initial_value, lazy_variable, no_autograph,
                                       normalization_inputs, normalization_shapes, place_model_variables,
                                       saveable_object_class, set_checkpoint_saveable, set_inner_variable,
                                       set_layout_map, set_lazy_initial_value, set_trainable, set_training_state,
                                       split_first_argument, stateless_dropout_generator, stateless_seed,
                                       steps_per_execution, tf_keras, training_state, training_value,
                                       unfuse_normalization, weight_lists, wrap_create_dvariable,
                                       wrap_variable_mapping, wrap_variable_reads)
from tfpod.compat.keras_optimizers import (adam_coefficients, apply_updates, create_optimizer_weights, create_slots,
                                           decayed_lr, legacy_has_state, legacy_optimizer_class, new_on_mesh,
                                           optimizer_built, optimizer_mesh, optimizer_scalars, prepare_updates,
                                           slot_table, uses_weight_decay, var_key)
from tfpod.compat.keras_attention import (attention_axes, attention_dropout, build_for_call, causal_mask,
                                          multi_head_attention_with_steps, project_inputs, project_output)
from tfpod.compat.model_garden import (encoder_attention_mask, encoder_embeddings, encoder_input_layers,
                                       position_embeddings, rename_layer, set_embedding_initializer, set_one_hot,
                                       set_transformer_layers, transformer_layers)
from tfpod.compat.tf_core import (bleu_sentence_statistics, bound_objects, checkpoint_object_graph,
                                  checkpoint_objects, dtensor_iterator_base, flat_caller, iterator_resource,
                                  onednn_enabled, pack_resources, record_checkpoint, set_iterator_element_layouts,
                                  share_variable_handle_programs, unary_dataset_base, variant_tensor,
                                  dtensor_local_program)
