"""What a user's model_fn returns and what ptf.run hands back."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np


@dataclasses.dataclass
class Model:
    """Returned by model_fn: a scalar loss built in the default graph, and either an optimizer
    (tf.compat.v1.train or tf_keras.optimizers.legacy: the toolkit builds `optimizer.minimize(loss)`,
    with the model's state updates) or the
    train_op the single-device script already builds (minimize, or compute_gradients -> any
    transform -> apply_gradients, with a global step, under control_dependencies(update_ops))."""
    loss: object
    optimizer: object = None
    train_op: object = None
    # what a Scaffold's init_op would run besides the variables' initializers (tables, your own
    # resources): run on every rank; variables start from the single-device values instead
    init_op: object = None
    # {name: scalar tensor} reported beside the loss, averaged over ranks (progress line, summary,
    # Result.metrics, TensorBoard); a vector of fixed length is averaged element by element
    # (Result.metrics only). Where ctx.batch_joined, over the joined batches, weighted by rows
    metrics: Optional[Dict[str, object]] = None
    # what a served model answers: a tensor or {name: tensor} computed from placeholders
    # (parallax_tf.export_saved_model); training ignores it
    predictions: object = None


@dataclasses.dataclass
class RunContext:
    """Passed to model_fn(ctx) and input_fn(ctx): who this rank is and which step runs."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    step: int = 0
    # the strategy computes the loss once over the data ranks' batches joined (stanza's FC node):
    # a loss that is the mean over the rows the graph sees is the single-device one
    batch_joined: bool = False
    # model_fn builds the graph export_saved_model serves: no dropout, batch norm on its moving
    # statistics
    serving: bool = False


@dataclasses.dataclass
class Result:
    variables: Dict[str, np.ndarray]   # single-device name -> whole final value, on every rank: the
                                       # model's variables and its state (mean over ranks where
                                       # each rank updates it from its own batch)
    losses: List[float]                # this rank's loss per step
    plan: object = None
    global_step: int = 0
    start_step: int = 0                # > 0 when the run resumed from a checkpoint
    checkpoint: Optional[str] = None   # the last checkpoint written or resumed from
    wall_time_s: float = 0.0
    examples_per_s: Optional[float] = None
    examples_per_step: int = 0         # all ranks together
    bytes_per_step: Dict[str, float] = dataclasses.field(default_factory=dict)   # this rank, per route
    cluster_bytes_per_step: Dict[str, float] = dataclasses.field(default_factory=dict)   # all ranks, per route
    lower_bound_bytes_per_step: float = 0.0   # the least this rank's share of the plan must move
    step_times: List[float] = dataclasses.field(default_factory=list)
    cpu_s_per_step: float = 0.0       # this process's CPU time (all threads, servers included)
    step_cpu_s: List[float] = dataclasses.field(default_factory=list)   # the same, step by step
    extras: Dict[str, object] = dataclasses.field(default_factory=dict)   # a strategy's own figures
                                       # (ps_plus: "staleness", pushes per staleness on this rank)
    # per-rank histograms a strategy reports at the end, the same on every rank: name -> rank ->
    # bucket -> count (ps_plus: "staleness", pushes applied by staleness, as the servers counted)
    histograms: Dict[str, Dict[int, Dict[int, int]]] = dataclasses.field(default_factory=dict)
    lost_ranks: List[int] = dataclasses.field(default_factory=list)   # ranks the run went on without
    # Model.metrics per step: the mean over ranks (a synchronous strategy's; ps_plus: this rank's)
    metrics: Dict[str, List[float]] = dataclasses.field(default_factory=dict)
    # the loss per step as the progress line shows it: the mean over ranks (ps_plus: this rank's)
    mean_losses: List[float] = dataclasses.field(default_factory=list)
    plan_only: bool = False            # run(plan_only=True): only `plan` is filled in; nothing trained
    rank: int = 0                      # this process's rank in the job that trained (ptf.rank())
    size: int = 1                      # the job's number of ranks (ptf.size())


def check_metrics(metrics) -> None:
    """Model.metrics is {name: numeric scalar tensor}, or one ModelError saying what it is."""
    import tensorflow as tf
    from parallax_tf.errors import ModelError
    if metrics is None:
        return
    if not isinstance(metrics, dict):
        raise ModelError(f"Model(metrics=...) is a {type(metrics).__name__}; pass a dict {{name: scalar tensor}}")
    for name, value in metrics.items():
        if not isinstance(name, str) or not isinstance(value, tf.Tensor) or value.shape.rank not in (0, 1) \
                or not value.shape.is_fully_defined() or not (value.dtype.is_floating or value.dtype.is_integer):
            raise ModelError(f"metric {name!r} is {getattr(value, 'shape', type(value).__name__)}; each metric must "
                             "be a numeric scalar (or a vector of fixed length) tensor of model_fn's graph (e.g. "
                             "tf.reduce_mean of a batch's accuracy)")


def check_predictions(predictions) -> None:
    """Model.predictions is None, a tensor or {name: tensor}, or one ModelError saying what it is."""
    import tensorflow as tf
    from parallax_tf.errors import ModelError
    if predictions is None:
        return
    named = predictions if isinstance(predictions, dict) else {"predictions": predictions}
    for name, value in named.items():
        if not isinstance(name, str) or not isinstance(value, tf.Tensor):
            raise ModelError(f"Model(predictions=...) holds {name!r}: {type(value).__name__}; pass a tensor of "
                             "model_fn's graph or a dict {name: tensor}")
