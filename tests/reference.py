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
        built = cases.build("mixed" if model in ("tfdata", "init_iter") else model, optimizer)()
        train = built.train_op if built.train_op is not None else cases.minimize(built.optimizer, built.loss)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.tables_initializer()])
            for step, ranks in enumerate(sizes):
                feeds = {graph.get_tensor_by_name(k + ":0"): v
                         for k, v in cases.global_batch(model, step, ranks).items()}
                sess.run(train, feeds)
            values = _whole_values(sess)
            values.update(state_values(sess))
            if with_slots:
                values.update(_slot_values(sess, built.optimizer))
            return values


def train_per_rank_statistics(model: str, optimizer: str, size: int, steps: int = cases.STEPS, seed: int = 0):
    """The rule for models whose batch norm normalises with each rank's own batch: every rank
    takes the gradient of its batch (its own batch statistics) at the same weights, the mean of
    those gradients is applied once; each rank updates its own moving statistics, and what is
    read is their mean over ranks. Written here in one process, independently of the toolkit."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        built = cases.build(model, optimizer)()
        trainable = tf.compat.v1.trainable_variables()
        grads = tf.gradients(built.loss, trainable)
        holders = []     # a sparse gradient stays sparse: the optimizer's sparse update is the rule
        for v, g in zip(trainable, grads):
            if isinstance(g, tf.IndexedSlices):
                holders.append(tf.IndexedSlices(tf.compat.v1.placeholder(v.dtype.base_dtype, [None] + v.shape[1:].as_list()),
                                                tf.compat.v1.placeholder(tf.int64, [None]), v.shape.as_list()))
            else:
                holders.append(tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape))
        apply = cases.OPTIMIZERS[optimizer]().apply_gradients(zip(holders, trainable))
        state = [v for v in tf.compat.v1.global_variables() if "moving_" in v.op.name]
        handles = {v.handle.name for v in state}
        fed = {name + ":0" for name in cases.batch(model, 0, 0)}
        # a tf_keras functional model's updates of its own keras.Input call are never fed: not run
        updates = [op for op in graph.get_operations() if op.type.startswith("Assign") and op.inputs
                   and op.inputs[0].name in handles and "Initializer" not in op.name and "/Assign" not in op.name[-7:]
                   and {p + ":0" for p in _placeholders(op)} <= fed]
        holders_state = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in state]
        set_state = [v.assign(h) for v, h in zip(state, holders_state)]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(steps):
                shared = sess.run(state)
                rank_grads, rank_state = [], []
                for rank in range(size):
                    feeds = {graph.get_tensor_by_name(k + ":0"): v for k, v in cases.batch(model, rank, step).items()}
                    sess.run(set_state, dict(zip(holders_state, shared)))
                    rank_grads.append(sess.run(grads, feeds))
                    sess.run(updates, feeds)
                    rank_state.append(sess.run(state))
                sess.run(set_state, dict(zip(holders_state, [np.mean(s, axis=0) for s in zip(*rank_state)])))
                feeds = {}
                for holder, per_rank in zip(holders, zip(*rank_grads)):
                    if isinstance(holder, tf.IndexedSlices):   # all ranks' rows, each scaled by 1/size
                        feeds[holder.values] = np.concatenate([g.values for g in per_rank]) / size
                        feeds[holder.indices] = np.concatenate([g.indices for g in per_rank]).astype(np.int64)
                    else:
                        feeds[holder] = np.mean(per_rank, axis=0)
                sess.run(apply, feeds)
            values = _whole_values(sess)
            values.update(state_values(sess))
            return values


def _placeholders(op) -> set:
    seen, stack, found = set(), [op], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.type == "Placeholder":
            found.add(current.name)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return found


def state_values(sess):
    """Model state a Saver would hold besides the weights: batch-norm statistics, EMAs."""
    return {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()
            if not v.trainable and ("moving_" in v.op.name or "ExponentialMovingAverage" in v.op.name)}


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
