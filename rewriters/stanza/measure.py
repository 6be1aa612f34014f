"""What inspection finds for Stanza (and for auto, which weighs it): where the FC head begins,
and, timed, the head's forward+backward alone and the batch's example count."""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf

from rewriters.stanza import cut as layer_cut


@dataclasses.dataclass
class HeadFound:
    head: Optional[object]         # cut.HeadCut: where the FC head begins
    problem: Optional[str]         # why there is no clean cut, when there is none
    compute_s: Optional[float]     # the head's forward+backward alone, when timed
    batch_size: Optional[int]      # examples in the captured batch, when timed


class HeadMeasure:
    name = "head"

    def measure(self, view) -> HeadFound:
        training = view.training
        try:
            parts = {name: [v for v, _ in pairs] for name, pairs in view.groups.items()}
            head = layer_cut.find_head(training.loss, parts, view.layers, view.state_vars, training.train_op)
        except layer_cut.LayerCutError as err:
            return HeadFound(None, str(err), None, None)
        compute_s, batch = _time_head(view, head) if view.evaluate and view.time_compute else (None, None)
        return HeadFound(head, None, compute_s, batch)


def found_head(capture) -> HeadFound:
    """The head inspection found (a capture made without HeadMeasure has none)."""
    return capture.measured.get("head") or HeadFound(None, "inspection did not look for an FC head", None, None)


def _time_head(view, head):
    """The FC head's forward+backward alone (its cut tensors fed, so nothing below runs), and
    the batch's example count: what the cost model needs to predict Stanza."""
    graph, training = view.graph, view.training
    variables = [v for name in head.variables for v, _ in view.groups[name]]
    cut = [graph.get_tensor_by_name(t.name) for t in head.cut]
    grads = [g for g in tf.gradients(training.loss, variables + [t for t, spec in zip(cut, head.cut)
                                                                 if spec.kind != "data"]) if g is not None]
    with view.session() as sess:
        values = sess.run(cut, view.feeds)
        batch = next(int(np.shape(v)[0]) for v, spec in zip(values, head.cut) if spec.kind != "replicated")
        return view.time_step(sess, grads, dict(zip(cut, values))), batch
