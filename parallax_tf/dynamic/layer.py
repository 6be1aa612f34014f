"""`DynamicEmbedding` as a Keras layer: `ptf.keras.DynamicEmbedding` (Keras 3) and
`ptf.tf_keras.DynamicEmbedding` (tf_keras), one class body on either library's Layer.

Where the layer is called decides what it does:
- traced by the TF2 front end (ptf.run of a TF2 step, ptf.fit of a Keras 3 model): the rows are a
  stand-in the front end replaces, in every graph it builds, by a lookup of the layer's table
  (`tracing`, recorded in the trace; tf2/graph.py replaces them);
- in a tf.compat.v1 graph (a model_fn; ptf.fit of a tf_keras model): a lookup of that graph's
  table of the layer;
- anywhere else (eager, Keras' own predict and evaluate, a SavedModel): the live rows the last
  run left, read with standard ops (served.py), so the trained model predicts and exports
  without parallax_tf.
Between runs the layer keeps its table's whole state (rows, slots, counts, clock: state.py's
arrays), so a run (an epoch of ptf.fit) starts where the last one ended."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import weakref
from typing import Dict, List

import numpy as np
import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.dynamic import ids as id_lib
from parallax_tf.dynamic import initializers
from parallax_tf.dynamic import table as table_lib
from parallax_tf.dynamic.served import read_live
from parallax_tf.errors import ModelError

STAND_IN = "parallax_dynamic_rows"
_TRACING: List[list] = []           # while the TF2 front end traces a step: the lookups it records
# per tf.compat.v1 graph: table name -> the layer whose table it is
_LAYER_OF: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, object]]" = weakref.WeakKeyDictionary()


class LayerError(ModelError):
    """A ModelError raised in the layer's call. Keras 3 rewrites an error raised in a call into a
    message of several lines with the call's arguments, unless the error says it has them already."""
    _keras_call_info_injected = True


@dataclasses.dataclass(eq=False)
class TracedLookup:
    """One call of a layer in a traced step: its flat int64 ids and the rows' stand-in."""
    layer: object
    ids: tf.Tensor
    rows: tf.Tensor


@contextlib.contextmanager
def tracing():
    """Layers called inside leave stand-ins and record them (yielded)."""
    found: list = []
    _TRACING.append(found)
    try:
        yield found
    finally:
        _TRACING.pop()


class LayerBody:
    """The layer, whatever Keras it is built on (mixed into that Keras' Layer by `layer_class`)."""

    def __init__(self, output_dim: int, initializer=None, admit_after: int = 1, evict_after_steps=None,
                 capacity=None, optimizer=None, seed=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.output_dim = int(output_dim)
        if isinstance(initializer, dict):       # from get_config
            initializer = law_from_config(initializer)
        self.table_options = dict(initializer=initializer, admit_after=admit_after,
                                  evict_after_steps=evict_after_steps, capacity=capacity, optimizer=optimizer,
                                  seed=seed)
        self._options = table_lib.table_options(self.name, self.output_dim, **{
            k: v for k, v in self.table_options.items() if k != "optimizer"})
        self.state: Dict[str, np.ndarray] = {}          # the table's arrays, by state.py's short names
        self._live = None

    def _live_rows(self):
        if self._live is None:
            with tf.init_scope():
                self._live = (tf.Variable(np.zeros([0], np.int64), shape=tf.TensorShape([None]), trainable=False,
                                          name=f"{self.name}_ids"),
                              tf.Variable(np.zeros([0, self.output_dim], self._options.dtype.as_numpy_dtype),
                                          shape=tf.TensorShape([None, self.output_dim]), trainable=False,
                                          name=f"{self.name}_values"))
        return self._live

    def served_variables(self) -> tuple:
        """The variables of the live rows it reads outside the toolkit's graphs (none yet: ())."""
        return self._live or ()

    def build(self, input_shape=None):
        if tf.executing_eagerly():      # a layer built in a tf.compat.v1 graph reads that graph's table
            self._live_rows()
        super().build(input_shape)

    def call(self, ids, training=None):
        ids = id_lib.as_int64(ids)
        flat = tf.reshape(ids, [-1])
        graph = tf.compat.v1.get_default_graph()
        if _TRACING and not tf.executing_eagerly():
            rows = tf.identity(tf.zeros(tf.stack([tf.size(flat), self.output_dim]), self._options.dtype),
                               name=STAND_IN)
            _TRACING[-1].append(TracedLookup(self, flat, rows))
        elif not tf.executing_eagerly() and not getattr(graph, "building_function", False):
            rows = self.graph_table().lookup(flat)
        else:
            if training and tf_shim.gradient_tape_recording():     # a training step, not a save's trace
                raise LayerError(f"DynamicEmbedding {self.name!r} is called to train outside parallax_tf, which "
                                 "would not train it: train the model with ptf.fit (or the step with ptf.run), in "
                                 "one process too; predict and evaluate read the trained rows")
            ids_var, values_var = self._live_rows()
            rows = read_live(ids_var, values_var, self._options, flat)
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.output_dim]], 0))

    def graph_table(self) -> table_lib.DynamicEmbedding:
        """The current graph's table of this layer (made on first use, where the rewrite puts tables)."""
        graph = tf.compat.v1.get_default_graph()
        found = [t for t in table_lib.tables(graph) if t.name == self.name]
        if found:
            return found[0]
        table = table_lib.DynamicEmbedding(self.name, self.output_dim, **self.table_options)
        bind(graph, self.name, self)
        return table

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        """Keras' config: the table's options, its initial law and seed as resolved (a table's own
        optimizer object is not kept: a layer made from the config trains with the model's)."""
        config = super().get_config()
        config.update(output_dim=self.output_dim, **{k: v for k, v in self.table_options.items()
                                                    if k not in ("initializer", "optimizer", "seed")},
                      initializer=law_config(self._options.initializer), seed=self._options.seed)
        return config

    def take(self, arrays: Dict[str, np.ndarray]) -> None:
        """The table's state after a run (state.py's `<table>/<name>` keys); its live rows serve."""
        prefix = f"{self.name}/"
        taken = {k[len(prefix):]: np.asarray(v) for k, v in arrays.items() if k.startswith(prefix)}
        if not taken:
            return
        self.state = taken
        ids_var, values_var = self._live_rows()
        ids_var.assign(taken["ids"])
        values_var.assign(taken["values"].astype(self._options.dtype.as_numpy_dtype))

    def save_own_variables(self, store):
        for key, value in self.state.items():
            store[key] = value

    def load_own_variables(self, store):
        self.take({f"{self.name}/{key}": store[key] for key in store.keys()})


def law_config(law: id_lib.RowInitializer) -> dict:
    """A row law as plain data: its class and its fields."""
    return {"law": type(law).__name__, **vars(law)}


def law_from_config(config: dict) -> id_lib.RowInitializer:
    fields = dict(config)
    kind = fields.pop("law")
    cls = getattr(id_lib, kind, None) or getattr(initializers, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, id_lib.RowInitializer)):
        raise ModelError(f"DynamicEmbedding's config names an unknown row law {kind!r}")
    law = cls.__new__(cls)
    law.__dict__.update(fields)
    return law


def layer_class(base, module: str):
    """LayerBody on `base` (a Keras Layer class), named DynamicEmbedding in `module`."""
    return type("DynamicEmbedding", (LayerBody, base), {"__module__": module, "__doc__": DOC})


def module_attribute(namespace: dict, name: str, library: str):
    """`name` of the module whose globals are `namespace` (parallax_tf.keras, parallax_tf.tf_keras):
    DynamicEmbedding on `library`'s Layer, made (and registered for Keras' saving) on first use."""
    if name != "DynamicEmbedding":
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    keras = importlib.import_module(library)
    made = namespace[name] = keras.saving.register_keras_serializable("parallax_tf")(
        layer_class(keras.layers.Layer, namespace["__name__"]))
    return made


def start_values(graph) -> Dict[str, np.ndarray]:
    """What the tables of `graph` made for layers start from: each layer's state, by checkpoint key."""
    return {f"{name}/{key}": value for name, layer in _LAYER_OF.get(graph, {}).items()
            for key, value in layer.state.items()}


def layers_of(graph) -> List[object]:
    return list(_LAYER_OF.get(graph, {}).values())


def bind(graph, table_name: str, layer) -> None:
    """`graph`'s table `table_name` is `layer`'s (a front end that makes it itself)."""
    _LAYER_OF.setdefault(graph, {})[table_name] = layer


DOC = """An embedding layer over arbitrary int64 (or string) ids with no vocabulary: a
parallax_tf dynamic table (ptf.DynamicEmbedding's options: initializer, admit_after,
evict_after_steps, capacity, optimizer, seed; the table is named as the layer). It trains under
ptf.fit or ptf.run, on any number of ranks (one included), by the model's optimizer row by row
(SGD with or without momentum, Adagrad, Adam, Ftrl); after a run it reads its live rows with
standard ops, so model.predict, model.evaluate and a SavedModel work without parallax_tf."""
