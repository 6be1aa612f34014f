"""What inspection finds for DSP: where a pipeline stage may begin, with each op's measured time
(a traced step), so the planner can balance the stages."""
from __future__ import annotations

import tensorflow as tf

from rewriters.dsp import cut


class PipelineMeasure:
    name = "pipeline"

    def measure(self, view):
        """cut.PipelineCuts, or None where inspection does not evaluate (no times)."""
        if not view.evaluate:
            return None
        grads = [g.values if isinstance(g, tf.IndexedSlices) else g
                 for pairs in view.groups.values() for _, g in pairs if g is not None]
        with view.session() as sess:
            op_seconds = cut.op_times(sess, grads, view.feeds)
        return cut.find(view.training.loss, {n: [v for v, _ in pairs] for n, pairs in view.groups.items()}, op_seconds)
