"""Small models shared by the multi-rank jobs and the single-device reference in the tests.

Every case is deterministic in (rank, step) so the test can rebuild the global batch: the
concatenation, in rank order, of what each rank trained on."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import parallax_tf as ptf

STEPS = 5
BATCH = 4
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
}
# tf_keras' legacy optimizers (OptimizerV2): what a Keras user passes
KERAS_OPTIMIZERS = {
    "keras_momentum": lambda: _tf_keras().optimizers.legacy.SGD(0.1, momentum=0.9),
    "keras_adam": lambda: _tf_keras().optimizers.legacy.Adam(0.01),
    "keras_adagrad": lambda: _tf_keras().optimizers.legacy.Adagrad(0.1),
}
OPTIMIZERS.update(KERAS_OPTIMIZERS)
OPTIMIZERS_BY_RATE = {
    "sgd": tf.compat.v1.train.GradientDescentOptimizer,
    "momentum": lambda rate: tf.compat.v1.train.MomentumOptimizer(rate, 0.9),
    "adagrad": tf.compat.v1.train.AdagradOptimizer,
    "adam": tf.compat.v1.train.AdamOptimizer,
}
VOCAB, DIM, CLASSES, IDS_PER_EXAMPLE = 20, 4, 3, 3


def _tf_keras():
    import tf_keras
    return tf_keras


def minimize(optimizer, loss):
    """What the toolkit builds for Model(loss, optimizer): minimize, for a tf_keras optimizer
    apply_gradients of tf.gradients (its minimize needs a tape)."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return optimizer.minimize(loss)
    variables = tf.compat.v1.trainable_variables()
    return optimizer.apply_gradients([(g, v) for g, v in zip(tf.gradients(loss, variables), variables)
                                      if g is not None])


WORDS = [f"w{i}" for i in range(VOCAB - 1)]      # strings a lookup table maps to ids 0..VOCAB-2


def _words():
    return tf.compat.v1.placeholder(tf.string, [None, IDS_PER_EXAMPLE], name="words")


def _embedding(name="emb", vocab=VOCAB, partitioner=None, dtype=tf.float32):
    return tf.compat.v1.get_variable(name, [vocab, DIM], dtype=dtype, partitioner=partitioner,
                                     initializer=tf.compat.v1.random_normal_initializer(seed=1))


def _dense_head(features, dtype=tf.float32):
    w = tf.compat.v1.get_variable("w", [DIM, CLASSES], dtype=dtype,
                                  initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    b = tf.compat.v1.get_variable("b", [CLASSES], dtype=dtype, initializer=tf.compat.v1.zeros_initializer())
    return tf.nn.bias_add(tf.matmul(features, w), b)


def _classification_loss(logits):
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _ids():
    return tf.compat.v1.placeholder(tf.int64, [None, IDS_PER_EXAMPLE], name="ids")


def _script_batches(ctx) -> dict:
    """A single-device script's batches, in order: step s's global batch is batches s*N..s*N+N-1,
    which the toolkit shards so that rank r reads batch s*N + r, i.e. batch("mixed", r, s)."""
    size = ctx.size if ctx is not None else 1
    per_step = [batch("mixed", rank, step) for step in range(STEPS) for rank in range(size)]
    return {k: np.stack([b[k] for b in per_step]) for k in per_step[0]}


def _dataset_batches(ctx):
    """The batches of a tf.data pipeline model_fn builds: no input_fn, nothing fed."""
    dataset = tf.data.Dataset.from_tensor_slices(_script_batches(ctx))
    return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


CLIP_NORM = 0.05     # below the global norm of these models' gradients: clipping happens


def _mixed_loss():
    features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(), _ids()), axis=1)
    return _classification_loss(_dense_head(features))


def _batch_norm(x, name="bn", decay=0.9):
    """Hand-written batch norm as TF1 code writes it: moving statistics updated by assign ops
    in UPDATE_OPS, normalising with the batch's own statistics while training."""
    with tf.compat.v1.variable_scope(name):
        size = int(x.shape[-1])
        gamma = tf.compat.v1.get_variable("gamma", [size], initializer=tf.compat.v1.ones_initializer())
        beta = tf.compat.v1.get_variable("beta", [size], initializer=tf.compat.v1.zeros_initializer())
        moving_mean = tf.compat.v1.get_variable("moving_mean", [size], trainable=False,
                                                initializer=tf.compat.v1.zeros_initializer())
        moving_var = tf.compat.v1.get_variable("moving_variance", [size], trainable=False,
                                               initializer=tf.compat.v1.ones_initializer())
        mean, var = tf.nn.moments(x, [0])
        for moving, value in ((moving_mean, mean), (moving_var, var)):
            update = moving.assign(decay * moving + (1 - decay) * value)
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update.op)
        return tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3)


def _initializable_iterator_batches(ctx):
    """The same through an initializable iterator (the toolkit runs its initializer)."""
    iterator = tf.compat.v1.data.make_initializable_iterator(tf.data.Dataset.from_tensor_slices(_script_batches(ctx)))
    return iterator.get_next()


def _keras_functional(model: str):
    """A tf_keras functional model built on its own keras.Input (as tf_keras.applications are),
    then called on the model's placeholder."""
    tf_keras = _tf_keras()
    init = lambda seed: tf_keras.initializers.GlorotUniform(seed=seed)  # noqa: E731
    x, labels = tf.compat.v1.placeholder(tf.float32, [None, DIM], name="x"), \
        tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    inputs = tf_keras.Input(shape=(DIM,))
    if model == "keras_const":      # a raw TF op with a constant shape between functional layers
        hidden = tf.reshape(tf_keras.layers.Dense(4, kernel_initializer=init(3))(inputs), [-1, 2, 2])
        hidden = tf_keras.layers.Flatten()(hidden)
        training = None
    else:                           # keras_app: frozen batch norm; keras_app_bn: training batch norm
        hidden = tf_keras.layers.Dense(6, activation="relu", kernel_initializer=init(3))(inputs)
        hidden = tf_keras.layers.BatchNormalization(momentum=0.9, name="bn")(hidden)
        training = model == "keras_app_bn"
    net = tf_keras.Model(inputs, tf_keras.layers.Dense(CLASSES, kernel_initializer=init(4))(hidden))
    logits = net(x, training=training)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _keras(model: str):
    import tf_keras
    init = lambda seed: tf_keras.initializers.GlorotUniform(seed=seed)  # noqa: E731
    if model == "keras":        # Embedding (IndexedSlices -> PS) + Dense
        ids, labels = _ids(), tf.compat.v1.placeholder(tf.int64, [None], name="labels")
        net = tf_keras.Sequential([
            tf_keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=tf_keras.initializers.RandomNormal(seed=1)),
            tf_keras.layers.GlobalAveragePooling1D(),
            tf_keras.layers.Dense(CLASSES, kernel_initializer=init(2))])
        logits = net(ids)
    else:                       # keras_bn: batch norm on the input and in the middle
        x, labels = tf.compat.v1.placeholder(tf.float32, [None, DIM], name="x"), \
            tf.compat.v1.placeholder(tf.int64, [None], name="labels")
        net = tf_keras.Sequential([
            tf_keras.layers.BatchNormalization(momentum=0.9, name="bn_in"),
            tf_keras.layers.Dense(6, activation="relu", kernel_initializer=init(3)),
            tf_keras.layers.BatchNormalization(momentum=0.9, name="bn_mid"),
            tf_keras.layers.Dense(CLASSES, kernel_initializer=init(4))])
        logits = net(x, training=True)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return net, loss


IMAGE, CHANNELS = 6, 2


def _small_cnn():
    """conv 3x3 -> relu -> 2x2 max pool -> flatten -> FC 8 (relu) -> FC classes: a feature
    extractor below an FC head (Stanza's cut is the flatten)."""
    images = tf.compat.v1.placeholder(tf.float32, [None, IMAGE, IMAGE, CHANNELS], name="images")
    kernel = tf.compat.v1.get_variable("conv/kernel", [3, 3, CHANNELS, 4],
                                       initializer=tf.compat.v1.glorot_uniform_initializer(seed=6))
    bias = tf.compat.v1.get_variable("conv/bias", [4], initializer=tf.compat.v1.zeros_initializer())
    x = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(images, kernel, 1, "SAME"), bias))
    x = tf.reshape(tf.nn.max_pool2d(x, 2, 2, "VALID"), [-1, (IMAGE // 2) ** 2 * 4])
    for name, units, seed in (("fc1", 8, 7), ("fc2", CLASSES, 8)):
        w = tf.compat.v1.get_variable(f"{name}/kernel", [int(x.shape[-1]), units],
                                      initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))
        b = tf.compat.v1.get_variable(f"{name}/bias", [units], initializer=tf.compat.v1.zeros_initializer())
        x = tf.nn.bias_add(tf.matmul(x, w), b)
        x = tf.nn.relu(x) if name == "fc1" else x
    return _classification_loss(x)


def _keras_cnn_bn():
    """The same in tf_keras with batch norm after the convolution."""
    import tf_keras
    layers = tf_keras.layers
    images = tf.compat.v1.placeholder(tf.float32, [None, IMAGE, IMAGE, CHANNELS], name="images")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    net = tf_keras.Sequential([
        layers.Conv2D(4, 3, padding="same", use_bias=False, kernel_initializer=tf_keras.initializers.GlorotUniform(6)),
        layers.BatchNormalization(momentum=0.9, name="bn"), layers.ReLU(), layers.MaxPooling2D(2), layers.Flatten(),
        layers.Dense(8, activation="relu", kernel_initializer=tf_keras.initializers.GlorotUniform(7)),
        layers.Dense(CLASSES, kernel_initializer=tf_keras.initializers.GlorotUniform(8))])
    logits = net(images, training=True)
    return net, tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def build(model: str, optimizer: str):
    """model_fn(ctx) for a named case."""
    def model_fn(ctx=None):
        if model == "clip_decay":        # the user's own train op: clip by global norm, LR decay
            loss = _mixed_loss()
            step = tf.compat.v1.train.get_or_create_global_step()
            rate = tf.compat.v1.train.exponential_decay(0.1 if optimizer != "adam" else 0.01, step, 2, 0.5)
            opt = OPTIMIZERS_BY_RATE[optimizer](rate)
            grads, variables = zip(*opt.compute_gradients(loss))
            clipped, _ = tf.clip_by_global_norm(grads, CLIP_NORM)
            return ptf.Model(loss=loss, train_op=opt.apply_gradients(zip(clipped, variables), global_step=step))
        if model == "minimize_gs":       # minimize with the model's global step, a scaled gradient
            loss = _mixed_loss()
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = OPTIMIZERS[optimizer]()
            pairs = [(g * 2.0 if v.op.name == "w" else g, v) for g, v in opt.compute_gradients(loss)]
            return ptf.Model(loss=loss, train_op=opt.apply_gradients(pairs, global_step=step))
        if model == "bn":                # hand-written batch norm, UPDATE_OPS, train_op form
            x = tf.compat.v1.placeholder(tf.float32, [None, DIM], name="x")
            emb = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(), _ids()), axis=1)
            loss = _classification_loss(_dense_head(_batch_norm(x) + emb))
            with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
                train_op = OPTIMIZERS[optimizer]().minimize(
                    loss, global_step=tf.compat.v1.train.get_or_create_global_step())
            return ptf.Model(loss=loss, train_op=train_op)
        if model == "ema":               # an EMA of the weights, updated after each step
            loss = _mixed_loss()
            step = tf.compat.v1.train.get_or_create_global_step()
            apply = OPTIMIZERS[optimizer]().minimize(loss, global_step=step)
            ema = tf.compat.v1.train.ExponentialMovingAverage(0.5)
            with tf.control_dependencies([apply]):
                train_op = ema.apply(tf.compat.v1.trainable_variables())
            return ptf.Model(loss=loss, train_op=train_op)
        if model == "keras_clip":        # tf_keras optimizer, the user's own clipped apply_gradients
            loss = _mixed_loss()
            opt = OPTIMIZERS[optimizer]()
            variables = tf.compat.v1.trainable_variables()
            clipped, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), CLIP_NORM)
            return ptf.Model(loss=loss, train_op=opt.apply_gradients(zip(clipped, variables)))
        if model in ("keras_app", "keras_app_bn", "keras_const"):
            return ptf.Model(loss=_keras_functional(model), optimizer=OPTIMIZERS[optimizer]())
        if model == "keras":             # tf_keras model, optimizer form
            _, loss = _keras(model)
            return ptf.Model(loss=loss, optimizer=OPTIMIZERS[optimizer]())
        if model == "cnn_bn":            # tf_keras CNN, batch norm in the feature extractor
            net, loss = _keras_cnn_bn()
            with tf.control_dependencies(net.updates):
                train_op = OPTIMIZERS[optimizer]().minimize(
                    loss, global_step=tf.compat.v1.train.get_or_create_global_step())
            return ptf.Model(loss=loss, train_op=train_op)
        if model == "keras_bn":          # tf_keras with batch norm: updates in model.updates
            net, loss = _keras(model)
            with tf.control_dependencies(net.updates):
                train_op = OPTIMIZERS[optimizer]().minimize(
                    loss, global_step=tf.compat.v1.train.get_or_create_global_step())
            return ptf.Model(loss=loss, train_op=train_op)
        if model == "tfdata":
            feeds = _dataset_batches(ctx)
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(), feeds["ids"]), axis=1)
            labels = feeds["labels"]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=_dense_head(features)))
        elif model == "init_iter":
            feeds = _initializable_iterator_batches(ctx)
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(), feeds["ids"]), axis=1)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=feeds["labels"], logits=_dense_head(features)))
        elif model == "vocab_column":    # a vocabulary feature column: a lookup table, then an embedding
            fc = tf.compat.v1.feature_column
            column = fc.embedding_column(fc.categorical_column_with_vocabulary_list("words", WORDS, num_oov_buckets=1),
                                         DIM, initializer=tf.compat.v1.random_normal_initializer(seed=1))
            loss = _classification_loss(_dense_head(fc.input_layer({"words": _words()}, [column])))
        elif model == "hash_table":      # a bare StaticHashTable from strings to embedding rows
            table = tf.compat.v1.lookup.StaticHashTable(tf.compat.v1.lookup.KeyValueTensorInitializer(
                WORDS, np.arange(len(WORDS), dtype=np.int64), tf.string, tf.int64), VOCAB - 1)
            ids = table.lookup(_words())
            loss = _classification_loss(_dense_head(tf.reduce_mean(
                tf.compat.v1.nn.embedding_lookup(_embedding(), ids), axis=1)))
        elif model == "sparse_feed":     # a sparse_placeholder fed a SparseTensorValue
            tags = tf.compat.v1.sparse_placeholder(tf.int64, name="tags")
            features = tf.nn.embedding_lookup_sparse(_embedding(), tags, None, combiner="mean")
            loss = _classification_loss(_dense_head(features))
        elif model in ("cnn", "cnn_shards"):
            loss = _small_cnn()
        elif model == "ref_vars":          # non-resource (v1 "ref") variables
            emb = tf.compat.v1.get_variable("emb", [VOCAB, DIM], use_resource=False,
                                            initializer=tf.compat.v1.random_normal_initializer(seed=1))
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(emb, _ids()), axis=1)
            w = tf.compat.v1.get_variable("w", [DIM, CLASSES], use_resource=False,
                                          initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
            b = tf.compat.v1.get_variable("b", [CLASSES], use_resource=False,
                                          initializer=tf.compat.v1.zeros_initializer())
            loss = _classification_loss(tf.nn.bias_add(tf.matmul(features, w), b))
        elif model in ("mixed", "duplicates", "auto_mod"):
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(), _ids()), axis=1)
            loss = _classification_loss(_dense_head(features))
        elif model == "two_tables":      # two tables read by the same ids (a plan may route them apart)
            ids = _ids()
            features = sum(tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(name), ids), axis=1)
                           for name in ("emb", "emb_b"))
            loss = _classification_loss(_dense_head(features))
        elif model == "auto_div":        # TF2 lookup: contiguous ("div") rows per shard
            features = tf.reduce_mean(tf.nn.embedding_lookup(_embedding(), _ids()), axis=1)
            loss = _classification_loss(_dense_head(features))
        elif model == "partitioned":     # the user partitioned the embedding themselves
            emb = _embedding(vocab=VOCAB + 1, partitioner=tf.compat.v1.fixed_size_partitioner(3))
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(emb, _ids()), axis=1)
            loss = _classification_loss(_dense_head(features))
        elif model == "dense_only":      # float64, tf.Variable, no sparse gradient anywhere
            x = tf.compat.v1.placeholder(tf.float64, [None, DIM], name="x")
            w1 = tf.Variable(np.random.RandomState(3).randn(DIM, 5), name="w1")
            w2 = tf.Variable(np.random.RandomState(4).randn(5, CLASSES), name="w2")
            loss = _classification_loss(tf.matmul(tf.tanh(tf.matmul(x, w1)), w2))
        elif model == "sparse_only":     # nothing dense: the embedding is the whole model
            y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
            rows = tf.compat.v1.nn.embedding_lookup(_embedding(), _ids())
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(rows, axis=[1, 2]) - y))
        elif model == "rnn":             # embedding inside tf.while_loop control flow
            emb = _embedding()
            cell_w = tf.compat.v1.get_variable("cell_w", [2 * DIM, DIM],
                                               initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
            ids = _ids()
            inputs = tf.transpose(tf.compat.v1.nn.embedding_lookup(emb, ids), [1, 0, 2])

            def step(t, h):
                return t + 1, tf.tanh(tf.matmul(tf.concat([inputs[t], h], 1), cell_w))
            _, h = tf.while_loop(lambda t, h: t < IDS_PER_EXAMPLE, step,
                                 [tf.constant(0), tf.zeros_like(inputs[0])])
            loss = _classification_loss(_dense_head(h))
        else:
            raise ValueError(model)
        return ptf.Model(loss=loss, optimizer=OPTIMIZERS[optimizer]())
    return model_fn


def batch(model: str, rank: int, step: int) -> dict:
    model = "mixed" if model in ("tfdata", "init_iter", "ref_vars", "clip_decay", "minimize_gs", "ema", "keras",
                                 "keras_clip", "two_tables") else model
    model = "keras_bn" if model in ("keras_app", "keras_app_bn", "keras_const") else model
    model = "cnn" if model == "cnn_shards" else model
    rng = np.random.RandomState(1000 * step + rank)
    if model in ("vocab_column", "hash_table"):      # id VOCAB - 1: a word not in the vocabulary
        ids = rng.randint(0, VOCAB, [BATCH, IDS_PER_EXAMPLE])
        words = np.array([[WORDS[i] if i < len(WORDS) else "unknown" for i in row] for row in ids], dtype=object)
        return {"words": words, "labels": rng.randint(0, CLASSES, BATCH)}
    if model == "sparse_feed":       # 1 to IDS_PER_EXAMPLE ids per example
        counts = rng.randint(1, IDS_PER_EXAMPLE + 1, BATCH)
        indices = np.array([[i, j] for i, n in enumerate(counts) for j in range(n)], dtype=np.int64)
        return {"tags/indices": indices, "tags/values": rng.randint(0, VOCAB, len(indices)).astype(np.int64),
                "tags/shape": np.array([BATCH, IDS_PER_EXAMPLE], dtype=np.int64),
                "labels": rng.randint(0, CLASSES, BATCH)}
    if model == "dense_only":
        return {"x": rng.randn(BATCH, DIM), "labels": rng.randint(0, CLASSES, BATCH)}
    if model in ("cnn", "cnn_bn"):     # cnn_bn: a mean and scale of each rank's own
        images = rng.randn(BATCH, IMAGE, IMAGE, CHANNELS) * (2 if model == "cnn_bn" else 1) + (rank if model == "cnn_bn" else 0)
        return {"images": images.astype(np.float32), "labels": rng.randint(0, CLASSES, BATCH)}
    if model == "keras_bn":   # features with a mean and scale of their own, per rank
        return {"x": (rng.randn(BATCH, DIM) * 2 + 1 + rank).astype(np.float32), "labels": rng.randint(0, CLASSES, BATCH)}
    if model == "bn":
        feeds = batch("mixed", rank, step)
        feeds["x"] = (rng.randn(BATCH, DIM) * 2 + 1 + rank).astype(np.float32)
        return feeds
    high = 3 if model == "duplicates" else (VOCAB + 1 if model == "partitioned" else VOCAB)
    feeds = {"ids": rng.randint(0, high, [BATCH, IDS_PER_EXAMPLE])}
    if model == "sparse_only":
        feeds["y"] = rng.randn(BATCH).astype(np.float32)
    else:
        feeds["labels"] = rng.randint(0, CLASSES, BATCH)
    return feeds


def input_fn_for(model: str):
    if model in ("tfdata", "init_iter"):
        return None
    if model == "sparse_feed":       # one tf.compat.v1.SparseTensorValue, as a session feed takes it
        def sparse_input_fn(ctx):
            feeds = batch(model, ctx.rank, ctx.step)
            feeds["tags"] = tf.compat.v1.SparseTensorValue(*(feeds.pop(f"tags/{k}") for k in ("indices", "values",
                                                                                               "shape")))
            return feeds
        return sparse_input_fn
    if model == "cnn_shards":        # a list of two data shards: ctx.rank must be 0 or 1
        shards = [[batch(model, r, step) for step in range(STEPS)] for r in range(2)]
        return lambda ctx: shards[ctx.rank][ctx.step]
    return lambda ctx: batch(model, ctx.rank, ctx.step)


def global_batch(model: str, step: int, size: int) -> dict:
    parts = [batch(model, r, step) for r in range(size)]
    whole = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if not k.startswith("tags/")}
    if model == "sparse_feed":       # rank r's rows follow the rows of the ranks before it
        whole["tags/indices"] = np.concatenate([p["tags/indices"] + [r * BATCH, 0] for r, p in enumerate(parts)])
        whole["tags/values"] = np.concatenate([p["tags/values"] for p in parts])
        whole["tags/shape"] = np.array([size * BATCH, IDS_PER_EXAMPLE], dtype=np.int64)
    return whole


# (case name, model, optimizer, extra run options)
CASES = [(f"mixed_{opt}", "mixed", opt, {}) for opt in ("sgd", "momentum", "adagrad", "adam")] + [
    ("duplicates", "duplicates", "adagrad", {}),
    ("partitioned", "partitioned", "adagrad", {}),
    ("dense_only", "dense_only", "momentum", {}),
    ("sparse_only", "sparse_only", "adam", {}),
    ("rnn", "rnn", "sgd", {}),
    ("auto_mod", "auto_mod", "adagrad", {"partitions": 2}),
    ("auto_div", "auto_div", "momentum", {"partitions": 2}),
    ("no_local_aggregation", "mixed", "adagrad", {"local_aggregation": False}),
    ("tfdata", "tfdata", "momentum", {}),
    ("ref_vars", "ref_vars", "adagrad", {}),
    # real single-device models: the user's own train op, global step, model state, tf_keras
    ("clip_decay_sgd", "clip_decay", "sgd", {}),
    ("clip_decay_adam", "clip_decay", "adam", {}),
    ("minimize_gs", "minimize_gs", "momentum", {}),
    ("ema", "ema", "adagrad", {}),
    ("keras", "keras", "adam", {}),
    ("bn", "bn", "momentum", {}),
    ("keras_bn", "keras_bn", "sgd", {}),
    # what single-device scripts written elsewhere use: tables, iterators, sparse feeds, tf_keras
    ("vocab_column", "vocab_column", "adagrad", {}),
    ("hash_table", "hash_table", "momentum", {}),
    ("init_iter", "init_iter", "sgd", {}),
    ("sparse_feed", "sparse_feed", "adagrad", {}),
    ("keras_app", "keras_app", "sgd", {}),
    ("keras_app_bn", "keras_app_bn", "sgd", {}),
    ("keras_const", "keras_const", "momentum", {}),
    ("keras_momentum", "mixed", "keras_momentum", {}),
    ("keras_adam", "mixed", "keras_adam", {}),
    ("keras_adagrad", "mixed", "keras_adagrad", {}),
    ("keras_clip", "keras_clip", "keras_momentum", {}),
]
# Batch norm normalises with each rank's own batch (as Horovod does), so these match the
# average of per-rank gradients rather than one gradient of the concatenated batch.
PER_RANK_BATCH_STATISTICS = {"bn", "keras_bn", "cnn_bn", "keras_app_bn"}
# Models whose state is frozen (batch norm called with training=False): it must not move.
FROZEN_STATE = {"keras_app"}
# Models with a feature extractor below an FC head, for Stanza (not in CASES: not every strategy
# runs them): (case name, model, optimizer, extra run options)
STANZA_CASES = [("cnn_momentum", "cnn", "momentum", {}), ("cnn_adam", "cnn", "adam", {}),
                ("cnn_bn", "cnn_bn", "momentum", {}), ("mixed_sgd", "mixed", "sgd", {}),
                ("cnn_keras_adam", "cnn", "keras_adam", {})]
# Two tables on different routes in one plan (tests/test_toy_strategy.py)
SPLIT_CASES = [("two_tables_adagrad", "two_tables", "adagrad", {}), ("two_tables_adam", "two_tables", "adam", {})]
CASE_BY_NAME = {c[0]: c for c in CASES + STANZA_CASES + SPLIT_CASES + [("cnn_shards", "cnn_shards", "momentum", {})]}
