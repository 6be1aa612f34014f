"""Every private TensorFlow name the toolkit uses, in one place: `tensorflow.python.*` modules,
the graph-editing methods of TF's own Operation and Graph, the tf.compat.v1.train optimizers'
hyper-parameters and state, tf.data's iterator makers. Each name is pinned (PINNED, checked by
tests/test_compat.py on the installed TensorFlow), so a name that moves in a new release is
found here, by name, rather than in a run that fails.

Imports TensorFlow only inside the functions that need it: importing this module costs nothing
(parallax_tf/devices.py imports no TensorFlow)."""
from __future__ import annotations

import copy
from typing import Callable, List, Sequence, Tuple

from parallax_tf.compat import pins

# (where it lives, name, what the toolkit uses it for); a `where` ending in "()" is an instance
PINNED: List[Tuple[str, str, str]] = [
    ("tensorflow.python.eager.record", "could_possibly_record",
     "a dynamic layer called to train under a GradientTape outside the toolkit (dynamic/layer.py)"),
    ("tensorflow.python.ops.gradients_util", "_GradientsHelper",
     "every gradient call of model_fn, recorded by swapping it (training_graph.py)"),
    ("tensorflow.python.client.pywrap_tf_session", "TF_GraphRemoveFunction",
     "a graph function re-placed (runtime/placement.py)"),
    ("tensorflow.python.client.pywrap_tf_session", "TF_FunctionImportFunctionDef", "the same"),
    ("tensorflow.python.client.pywrap_tf_session", "TF_GraphCopyFunction", "the same"),
    ("tensorflow.python.client.pywrap_tf_session", "TF_DeleteFunction", "the same"),
    ("tensorflow.python.client.timeline", "Timeline", "a traced step as a Chrome trace (runtime/hooks.py)"),
    ("tensorflow.python.client.session.BaseSession", "_make_callable_from_options",
     "a step's feeds and fetches made into one callable (runtime/step_call.py; tf_keras' v1 backend uses it too)"),
    ("tensorflow.core.protobuf.config_pb2", "CallableOptions", "the same"),
    ("tensorflow.python.client.session.BaseSession", "_do_call",
     "a callable's error named by its op, as session.run names it (runtime/step_call.py)"),
    ("tensorflow.python.framework.kernels", "get_registered_kernels_for_op",
     "which op types have a GPU kernel (devices.py)"),
    ("tensorflow.python.ops.gen_resource_variable_ops", "resource_gather",
     "a PS variable's distinct rows, read once (rewriters/shared/rebuild.py)"),
    ("tensorflow.python.data.ops.dataset_ops", "DatasetV1", "its iterator makers, patched to shard (input_shard.py)"),
    ("tensorflow.python.data.ops.dataset_ops.DatasetV1", "_make_one_shot_iterator", "the same"),
    ("tensorflow.python.data.ops.dataset_ops.DatasetV1", "_make_initializable_iterator", "the same"),
    ("tensorflow.python.data.ops.dataset_ops", "DatasetV2", "what a dataset is (input_shard.py)"),
    ("tensorflow.python.data.ops.iterator_ops", "Iterator", "make_initializer, patched to shard (input_shard.py)"),
    ("tensorflow.python.data.ops.iterator_ops.Iterator", "make_initializer", "the same"),
    ("tensorflow.python.data.ops.iterator_ops.Iterator()", "_iterator_resource",
     "the op of an iterator the toolkit sharded (input_shard.py)"),
    ("tensorflow.python.data.ops.dataset_ops.DatasetV2()", "_variant_tensor",
     "the ops of a tf.data pipeline, compared between two ranks' builds (input_shard.py)"),
    ("tensorflow.Graph()", "_get_function", "the body of a function a tf.data pipeline calls (input_shard.py)"),
    ("tensorflow.__internal__.eager_context", "eager_mode", "eager execution inside a graph (fit/spec.py)"),
    ("tensorflow.python.eager.context", "context",
     "the coordination service's heartbeat set before MultiWorkerMirroredStrategy (tools/baselines_mwms.py)"),
    ("tensorflow.python.eager.context.Context", "configure_coordination_service", "the same"),
    ("tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2", "CoordinatedJob", "the same"),
    ("tensorflow.python.feature_column.feature_column", "_DenseColumn",
     "what tf.compat.v1.feature_column.input_layer takes: a dynamic table's column (parallax_tf/dynamic/columns.py)"),
    ("tensorflow.Operation", "_id", "ops in creation order (inputs first)"),
    ("tensorflow.Operation", "_add_control_inputs", "a control dependency added to an existing op"),
    ("tensorflow.Operation", "_remove_all_control_inputs", "an op's control dependencies replaced"),
    ("tensorflow.Operation", "_update_input", "an op's input rewired"),
    ("tensorflow.Operation", "_set_device", "an existing op re-placed"),
    ("tensorflow.Graph()", "_c_graph", "the graph's C handle, for its functions (runtime/placement.py)"),
    ("tensorflow.DType", "_is_ref_dtype", "a reference-typed tensor (rewriters/shared/pruning.py)"),
    ("tensorflow.Variable", "_get_save_slice_info", "the parts of a partitioned variable"),
    ("tensorflow.compat.v1.train.Optimizer", "_call_if_callable", "a hyper-parameter given as a callable"),
    ("tensorflow.compat.v1.train.AdamOptimizer", "_get_beta_accumulators", "Adam's non-slot state"),
    ("tensorflow.compat.v1.train.AdamOptimizer()", "_lr", "Adam's hyper-parameters (rewriters/ps_plus)"),
    ("tensorflow.compat.v1.train.AdamOptimizer()", "_beta1", "the same"),
    ("tensorflow.compat.v1.train.AdamOptimizer()", "_beta2", "the same"),
    ("tensorflow.compat.v1.train.AdamOptimizer()", "_epsilon", "the same"),
    ("tensorflow.compat.v1.train.MomentumOptimizer()", "_learning_rate",
     "Momentum's hyper-parameters (rewriters/ps_plus)"),
    ("tensorflow.compat.v1.train.MomentumOptimizer()", "_momentum", "the same"),
    ("tensorflow.compat.v1.train.MomentumOptimizer()", "_use_nesterov", "the same"),
    ("tensorflow.compat.v1.train.GradientDescentOptimizer()", "_learning_rate",
     "its learning rate (rewriters/ps_plus, parallax_tf/dynamic/rules.py)"),
    ("tensorflow.compat.v1.train.AdagradOptimizer()", "_learning_rate",
     "Adagrad's hyper-parameters (a dynamic table's row rule, parallax_tf/dynamic/rules.py)"),
    ("tensorflow.compat.v1.train.AdagradOptimizer()", "_initial_accumulator_value", "the same"),
    ("tensorflow.compat.v1.train.FtrlOptimizer()", "_learning_rate",
     "FTRL's hyper-parameters (a dynamic table's row rule, parallax_tf/dynamic/rules.py)"),
    ("tensorflow.compat.v1.train.FtrlOptimizer()", "_learning_rate_power", "the same"),
    ("tensorflow.compat.v1.train.FtrlOptimizer()", "_initial_accumulator_value", "the same"),
    ("tensorflow.compat.v1.train.FtrlOptimizer()", "_l1_regularization_strength", "the same"),
    ("tensorflow.compat.v1.train.FtrlOptimizer()", "_l2_regularization_strength", "the same"),
    ("tensorflow.compat.v1.train.FtrlOptimizer()", "_l2_shrinkage_regularization_strength", "the same"),
    ("tensorflow.compat.v1.train.FtrlOptimizer()", "_beta", "the same"),
    ("tensorflow.compat.v1.train.GradientDescentOptimizer()", "_slots",
     "an optimizer's copy with state of its own (rewriters/slim_dp)"),
    ("tensorflow.compat.v1.train.GradientDescentOptimizer()", "_non_slot_dict", "the same"),
    ("tensorflow.compat.v1.train.GradientDescentOptimizer()", "_deferred_slot_restorations", "the same"),
]


def _samples() -> dict:
    import tensorflow as tf
    train = tf.compat.v1.train

    def iterator():
        with tf.Graph().as_default():
            return tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.range(1))
    return {"tensorflow.Graph()": tf.Graph,
            "tensorflow.python.data.ops.iterator_ops.Iterator()": iterator,
            "tensorflow.python.data.ops.dataset_ops.DatasetV2()": lambda: tf.data.Dataset.range(1),
            "tensorflow.compat.v1.train.AdamOptimizer()": lambda: train.AdamOptimizer(0.1),
            "tensorflow.compat.v1.train.MomentumOptimizer()": lambda: train.MomentumOptimizer(0.1, 0.9),
            "tensorflow.compat.v1.train.GradientDescentOptimizer()": lambda: train.GradientDescentOptimizer(0.1),
            "tensorflow.compat.v1.train.AdagradOptimizer()": lambda: train.AdagradOptimizer(0.1),
            "tensorflow.compat.v1.train.FtrlOptimizer()": lambda: train.FtrlOptimizer(0.1)}


def missing() -> List[str]:
    """The pinned names this TensorFlow does not have, as where.name."""
    return pins.unresolved(PINNED, _samples())


# ---- gradients ------------------------------------------------------------------------------

def gradients_helper() -> Callable:
    """The function every tf.gradients / tf.compat.v1.gradients call goes through."""
    from tensorflow.python.ops import gradients_util
    return gradients_util._GradientsHelper


def set_gradients_helper(helper: Callable) -> None:
    """Makes `helper` the function gradient calls go through (gradients_helper() restores it)."""
    from tensorflow.python.ops import gradients_util
    gradients_util._GradientsHelper = helper


# ---- ops and graphs ---------------------------------------------------------------------------

def creation_order(op) -> int:
    """A sort key: an op made before another has a smaller one (its inputs come first)."""
    return op._id


def add_control_inputs(op, ops: Sequence) -> None:
    """`op` runs after each of `ops` too."""
    op._add_control_inputs(ops)


def remove_all_control_inputs(op) -> None:
    op._remove_all_control_inputs()


def gradient_tape_recording() -> bool:
    """Whether a GradientTape records the ops made now."""
    from tensorflow.python.eager import record
    return record.could_possibly_record()


def update_input(op, index: int, tensor) -> None:
    """`op`'s input `index` is `tensor` from now on."""
    op._update_input(index, tensor)


def replace_uses(old, new) -> None:
    """Every op that reads tensor `old` reads `new` instead."""
    for consumer in list(old.consumers()):
        for index, tensor in enumerate(consumer.inputs):
            if tensor is old:
                update_input(consumer, index, new)


def create_op(graph, op_type: str, inputs, dtypes, attrs: dict, name: str):
    """An op of `op_type` made in `graph` from its node attributes (a copy of another op)."""
    return graph._create_op_internal(op_type, inputs, dtypes, name=name, attrs=attrs)


def set_device(op, device: str) -> None:
    """Places an op already in the graph."""
    op._set_device(device)


def is_ref_dtype(dtype) -> bool:
    return dtype._is_ref_dtype


def replace_graph_function(graph, name: str, function_def) -> None:
    """The function `name` of `graph`'s library replaced by `function_def` (a FunctionDef)."""
    from tensorflow.python.client import pywrap_tf_session as c_api
    c_api.TF_GraphRemoveFunction(graph._c_graph, name)
    imported = c_api.TF_FunctionImportFunctionDef(function_def.SerializeToString())
    try:
        c_api.TF_GraphCopyFunction(graph._c_graph, imported, None)
    finally:
        c_api.TF_DeleteFunction(imported)


def registered_kernels(op_type: str) -> list:
    """The KernelDefs this TensorFlow registers for `op_type` (raises for an op type TF does not know)."""
    from tensorflow.python.framework import kernels
    return kernels.get_registered_kernels_for_op(op_type).kernel


def resource_gather(handle, indices, dtype, name: str):
    """The rows `indices` of a resource variable (by its handle), as one op of the graph."""
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops.resource_gather(handle, indices, dtype=dtype, name=name)


def configure_coordination_service(leader: str, workers: int, heartbeat_timeout_s: int) -> None:
    """The coordination service MultiWorkerMirroredStrategy starts (it leaves one configured
    before it alone), with a heartbeat bound of `heartbeat_timeout_s`."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=leader, heartbeat_timeout_in_ms=heartbeat_timeout_s * 1000,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=workers)])


def session_callable(session, feeds: Sequence[str], fetches: Sequence[str], targets: Sequence[str],
                     timeout_ms: int) -> Callable:
    """TF's callable for one set of feeds, fetches and targets (tensor and op names): called with
    the feeds' values in order (arrays of the placeholders' dtypes), it returns the fetches' values.
    session.run converts every feed in Python and finds its executors by name on every call."""
    from tensorflow.core.protobuf import config_pb2
    options = config_pb2.CallableOptions(feed=feeds, fetch=fetches, target=targets)
    options.run_options.timeout_in_ms = timeout_ms
    made = session._make_callable_from_options(options)
    return lambda *values: session._do_call(made, *values)


def chrome_trace(step_stats) -> str:
    """A traced step's step_stats (RunMetadata.step_stats) as a Chrome trace (JSON text)."""
    from tensorflow.python.client import timeline
    return timeline.Timeline(step_stats).generate_chrome_trace_format()


def eager_mode():
    """A context in which ops run eagerly, inside a graph-mode default graph too."""
    import tensorflow as tf
    return tf.__internal__.eager_context.eager_mode()


# ---- variables ----------------------------------------------------------------------------------

def save_slice_info(variable):
    """TF's own record of which part of a partitioned variable `variable` is (None if whole)."""
    return variable._get_save_slice_info()


def set_save_slice_info(variable, full_name: str, full_shape, offset, shape) -> None:
    """Records `variable` as rows `offset` of the whole variable `full_name` (as a partitioner does)."""
    import tensorflow as tf
    variable._set_save_slice_info(tf.Variable.SaveSliceInfo(full_name, list(full_shape), list(offset), list(shape)))


# ---- tf.data ------------------------------------------------------------------------------------

def iterator_makers() -> Tuple[Tuple[type, str], ...]:
    """(class, method name) of what binds a dataset to a graph-mode iterator. Every such iterator
    goes through one of the first two (tf.compat.v1.data.make_one_shot_iterator /
    make_initializable_iterator call them, as do the deprecated Dataset methods, through
    DatasetV1Adapter for a tf.data.Dataset); a reinitializable iterator
    (Iterator.from_structure) is bound to a dataset by the third."""
    from tensorflow.python.data.ops import dataset_ops, iterator_ops
    return ((dataset_ops.DatasetV1, "_make_one_shot_iterator"),
            (dataset_ops.DatasetV1, "_make_initializable_iterator"),
            (iterator_ops.Iterator, "make_initializer"))


def is_dataset(value) -> bool:
    from tensorflow.python.data.ops import dataset_ops
    return isinstance(value, dataset_ops.DatasetV2)


def dataset_variant(dataset):
    """The tensor a graph-mode dataset's pipeline computes (its last op's output)."""
    return getattr(dataset, "_variant_tensor", None)


def function_definition(graph, name: str):
    """The FunctionDef of a function the graph holds (a tf.data map's), or None."""
    found = graph._get_function(name)
    if found is None:
        return None
    return getattr(found, "cached_definition", None) or getattr(found, "definition", None)


def iterator_resource(iterator):
    """A graph-mode iterator's resource tensor."""
    return iterator._iterator_resource


# ---- tf.compat.v1.train optimizers --------------------------------------------------------------

def call_if_callable(optimizer, value):
    """A hyper-parameter's value: called first when given as a callable, as the optimizer does."""
    return optimizer._call_if_callable(value)


def adam_hyper_parameters(optimizer) -> tuple:
    """An AdamOptimizer's (learning rate, beta1, beta2, epsilon), as given."""
    return optimizer._lr, optimizer._beta1, optimizer._beta2, optimizer._epsilon


def momentum_hyper_parameters(optimizer) -> tuple:
    """A MomentumOptimizer's (learning rate, momentum, use_nesterov), as given."""
    return optimizer._learning_rate, optimizer._momentum, optimizer._use_nesterov


def adagrad_hyper_parameters(optimizer) -> tuple:
    """An AdagradOptimizer's (learning rate, initial accumulator value), as given."""
    return optimizer._learning_rate, optimizer._initial_accumulator_value


def ftrl_hyper_parameters(optimizer) -> dict:
    """An FtrlOptimizer's hyper-parameters, as given, by the names of its constructor."""
    return {"learning_rate": optimizer._learning_rate, "learning_rate_power": optimizer._learning_rate_power,
            "initial_accumulator_value": optimizer._initial_accumulator_value,
            "l1_regularization_strength": optimizer._l1_regularization_strength,
            "l2_regularization_strength": optimizer._l2_regularization_strength,
            "l2_shrinkage_regularization_strength": optimizer._l2_shrinkage_regularization_strength,
            "beta": optimizer._beta}


def learning_rate(optimizer):
    """The learning rate of an optimizer that keeps it as _learning_rate (GradientDescent, ...)."""
    return optimizer._learning_rate


def beta_accumulators(optimizer) -> list:
    """An AdamOptimizer's non-slot variables (beta1 and beta2 powers)."""
    return list(optimizer._get_beta_accumulators())


def dense_feature_column_base() -> type:
    """The base class of the columns tf.compat.v1.feature_column.input_layer accepts."""
    from tensorflow.python.feature_column import feature_column
    return feature_column._DenseColumn


def fresh_copy(optimizer):
    """A copy of a tf.compat.v1.train optimizer (same hyper-parameters) with slots and non-slot
    state of its own."""
    clone = copy.copy(optimizer)
    clone._slots, clone._non_slot_dict, clone._deferred_slot_restorations = {}, {}, {}
    return clone
