"""Single-device TensorFlow training on the concatenated batches: what every strategy must match."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tests import cases


def train_single_device(model: str, optimizer: str, size, steps: int = cases.STEPS, seed: int = 0,
                        with_slots: bool = False):
    """Plain TF on the global batches; `size` is the rank count, or one count per step (a run
    resumed on another number of ranks)."""
    sizes = list(size) if isinstance(size, (list, tuple)) else [size] * steps
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)     # parallax_tf's default --seed
        # tf.data reads this rank's batches itself; the reference is fed the global batch instead
        built = cases.build("mixed" if model == "tfdata" else model, optimizer)()
        train = built.optimizer.minimize(built.loss)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step, ranks in enumerate(sizes):
                feeds = {graph.get_tensor_by_name(k + ":0"): v
                         for k, v in cases.global_batch(model, step, ranks).items()}
                sess.run(train, feeds)
            values = _whole_values(sess)
            if with_slots:
                values.update(_slot_values(sess, built.optimizer))
            return values


def _slot_values(sess, optimizer):
    """Slots under the names a Saver gives them ("emb/Adagrad"), whole."""
    out = {}
    for var in tf.compat.v1.trainable_variables():
        for name in optimizer.get_slot_names():
            slot = optimizer.get_slot(var, name)
            info = slot._get_save_slice_info()
            key = info.full_name if info else slot.op.name
            out.setdefault(key, []).append((info.var_offset[0] if info else 0, sess.run(slot)))
    return {k: np.concatenate([v for _, v in sorted(parts, key=lambda p: p[0])]) for k, parts in out.items()}


def _whole_values(sess):
    groups = {}
    for var in tf.compat.v1.trainable_variables():
        info = var._get_save_slice_info()
        groups.setdefault(info.full_name if info else var.op.name, []).append(var)
    out = {}
    for name, parts in groups.items():
        parts.sort(key=lambda v: v._get_save_slice_info().var_offset[0] if v._get_save_slice_info() else 0)
        out[name] = np.concatenate(sess.run(parts), axis=0) if len(parts) > 1 else sess.run(parts[0])
    return out


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-12))
