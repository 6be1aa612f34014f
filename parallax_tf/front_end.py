"""Front ends: the dialects a model comes in, each producing the same training record.

The pipeline (inspect -> plan -> rewrite -> run) reads a model only through a front end's
`build`, which makes the model's training graph in the current default graph, each variable
through `variable_hook(next_creator, kwargs, in_apply)` (the rewriter's placement), and returns
its training_record.Training:
- `ModelFn`: a tf.compat.v1 model_fn, built by calling it (training_graph.build);
- `parallax_tf.tf2.StepFrontEnd`: a TF2 training step over a dataset, traced once and imported.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol

from parallax_tf import training_graph
from parallax_tf.model import RunContext
from parallax_tf.plan import InputDecision
from parallax_tf.training_record import Training


class FrontEnd(Protocol):
    dialect: str        # what the user gave, for messages ("a model_fn", "a TF2 training step")
    traced: bool        # a traced step imported into each graph (only some strategies rewrite it)

    def build(self, ctx: RunContext, variable_hook=None, shard: bool = True,
              input_decisions: Optional[List[InputDecision]] = None,
              row_splits: Optional[Dict[str, List[int]]] = None) -> Training:
        """The model's training graph in the current default graph, and its record. `shard`
        (--shard_input) and `input_decisions` (the plan's): how the tf.data pipelines it builds
        are read by ctx's ranks (parallax_tf.input_shard). `row_splits`: variable -> the rows
        of each shard the plan splits it into (a front end whose record has `split_refusals`
        splits them; a model_fn's are split by the rewriter's get_variable partitioner)."""


class ModelFn:
    """A tf.compat.v1 model_fn(ctx) returning ptf.Model."""

    dialect = "a model_fn"
    traced = False

    def __init__(self, model_fn: Callable):
        self.model_fn = model_fn

    def build(self, ctx: RunContext, variable_hook=None, shard: bool = True,
              input_decisions: Optional[List[InputDecision]] = None,
              row_splits: Optional[Dict[str, List[int]]] = None) -> Training:
        return training_graph.build(self.model_fn, ctx, variable_hook=variable_hook, shard=shard,
                                    input_decisions=input_decisions)


def of(model) -> FrontEnd:
    """`model` as a front end: one already, or a model_fn."""
    return model if hasattr(model, "build") and hasattr(model, "dialect") else ModelFn(model)
