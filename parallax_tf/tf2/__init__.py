"""The TF2 front end: `ptf.run(train_step, dataset)`.

The script's own training step (a tf.function or a Python function computing the loss under
tf.GradientTape and applying the gradients with a Keras 3, tf_keras or tf.compat.v1.train
optimizer, or by hand) is traced once (trace.py) and imported, as the toolkit's training
record, into every graph the pipeline builds (graph.py): inspection, planning, the strategy's
rewrite and the runtime are the ones a model_fn goes through. The dataset yields the
single-device script's batches; each step trains on one, split over the data ranks (data.py).
After the run, the script's own variables hold the trained values on every rank."""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from parallax_tf import rank_run
from parallax_tf.errors import ConfigError
from parallax_tf.model import RunContext
from parallax_tf.tf2.data import StepInputs, element_count
from parallax_tf.tf2.graph import Converter, captured
from parallax_tf.tf2.naming import VariableNames
from parallax_tf.tf2.trace import trace
from parallax_tf.training_record import Training


def is_dataset(value) -> bool:
    return isinstance(value, tf.data.Dataset)


class StepFrontEnd:
    """A TF2 step and its dataset as the pipeline's front end (parallax_tf.front_end)."""

    dialect = "a TF2 training step"
    traced = True
    writes_back = True          # Result.variables holds every piece of state (slots too): write_back reads them

    def __init__(self, step, dataset):
        if not callable(step):
            raise ConfigError(f"ptf.run(train_step, dataset): train_step is a {type(step).__name__}, not a function")
        self.step, self.dataset = step, dataset
        self._converter: Optional[Converter] = None

    def steps(self, given: Optional[int], shard_reading: bool = False) -> int:
        """The run's steps: `given`, or one pass over the dataset (read in N shards: a pass over
        each rank's shard)."""
        if given is not None:
            return given
        count = element_count(self.dataset)
        if count is None:
            raise ConfigError("the dataset is infinite: give ptf.run(train_step, dataset, steps=N)")
        readers = rank_run.size() if shard_reading else 1
        if count < readers:
            raise ConfigError(f"the dataset holds {count} element(s) for {readers} reader(s): nothing to train on")
        return count // readers

    @property
    def converter(self) -> Converter:
        if self._converter is None:
            traced = trace(self.step, self.dataset.element_spec)
            names = VariableNames(self.step, list(captured(traced).variables.values()))
            self._converter = Converter(traced, self.dataset.element_spec, names)
        return self._converter

    def input_fn(self, shard_reading: bool = False) -> StepInputs:
        return StepInputs(self.dataset, self.converter.inputs, shard_reading)

    def build(self, ctx: RunContext, variable_hook=None, shard: bool = True, input_decisions=None,
              row_splits=None) -> Training:
        return self.converter.build(ctx, variable_hook, row_splits)

    def write_back(self, result) -> None:
        """The script's variables take the trained values (by their single-device names). State
        every rank updates from its own batch reads as its mean over ranks; a variable that says
        its copies add up (tf.VariableAggregation.SUM: a Keras metric's total and count) takes
        their sum."""
        converter, plan = self.converter, result.plan.by_name()
        for variable in converter.found.variables.values():
            name = converter.names.of(variable, converter.slot_owner.get(id(variable)))
            if name not in result.variables:
                continue
            value = result.variables[name]
            entry = plan.get(name)
            if entry is not None and entry.params.get("combine") == "mean" and \
                    variable.aggregation == tf.VariableAggregation.SUM:
                value = value * result.size
            variable.assign(value)
        for lookup in converter.trace.dynamic_lookups:
            lookup.layer.take(result.variables)
