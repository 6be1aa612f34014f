"""Dynamic embedding tables in one process (no ranks): the row rules against TensorFlow's own
optimizers on a fixed table, admission, eviction and capacity against a reference written here,
sparse lookups, string ids, bounded memory, and the messages for a user's mistakes."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_tf as ptf
from parallax_tf import dynamic
from parallax_tf.dynamic import ids as id_lib
from parallax_tf.dynamic import initializers
from parallax_tf.dynamic.state import DynamicState
from parallax_tf.errors import ConfigError, ModelError
from tests import dynamic_models

N, DIM = 40, 4


def _train(ids_per_step, optimizer, fixed: bool, **table_options):
    """Trains sum-of-rows regression on [batch, 3] id batches: (losses, ids, rows, state)."""
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None, 3])
        table = dynamic.DynamicEmbedding("emb", DIM, **table_options)
        if fixed:
            with tf.compat.v1.Session() as sess:
                start = sess.run(table.shards[0].initial_rows(tf.range(N, dtype=tf.int64)))
            weights = tf.compat.v1.get_variable("fixed", initializer=start)
            rows = tf.nn.embedding_lookup(weights, ids)
        else:
            rows = table.lookup(ids)
        target = tf.cast(tf.reduce_sum(ids % 3, 1), tf.float32)
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(rows, [1, 2]) - target))
        opt = dynamic_models.OPTIMIZERS[optimizer]()
        train = opt.minimize(loss) if fixed else dynamic.step(loss, opt)
        state = DynamicState([table])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = [sess.run([loss, train], {ids: batch})[0] for batch in ids_per_step]
            if fixed:
                used = np.unique(np.concatenate([b.ravel() for b in ids_per_step]))
                return np.array(losses), used, sess.run(weights)[used], None
            arrays = state.read(sess)
            return np.array(losses), arrays["emb/ids"], arrays["emb/values"], arrays


def _batches(steps=6, seed=0, high=N):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, high, size=(5, 3)) for _ in range(steps)]


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "ftrl"])
def test_a_dynamic_table_trains_as_a_fixed_table_initialised_by_the_same_rule(optimizer):
    batches = _batches()
    got_losses, got_ids, got_rows, state = _train(batches, optimizer, fixed=False)
    want_losses, want_ids, want_rows, _ = _train(batches, optimizer, fixed=True)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_losses, want_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_rows, want_rows, rtol=0, atol=1e-5)
    assert state["emb/clock"].tolist() == [len(batches), len(want_ids), 0]


def _bookkeeping(ids_per_step, admit_after=1, evict_after=None, capacity=None):
    """The table's rules in plain Python: (live ids, {id: count}, {id: last seen step}, admitted,
    evicted)."""
    count, last, live, admitted, evicted = {}, {}, set(), 0, 0
    for step, batch in enumerate(ids_per_step):
        for i in batch.ravel().tolist():
            count[i] = count.get(i, 0) + 1
        for i in set(batch.ravel().tolist()):
            last[i] = step
            if i not in live and count[i] >= admit_after:
                live.add(i)
                admitted += 1
        if evict_after is not None:
            for i in [i for i in last if last[i] <= step - evict_after]:
                evicted += i in live
                live.discard(i), count.pop(i), last.pop(i)
        if capacity is not None:
            for group in (sorted(live), sorted(set(last) - live)):
                ranked = sorted(group, key=lambda i: (last[i], i))
                for i in ranked[:max(0, len(ranked) - capacity)]:
                    evicted += i in live
                    live.discard(i), count.pop(i), last.pop(i)
    return live, count, last, admitted, evicted


@pytest.mark.parametrize("options", [dict(admit_after=2), dict(evict_after_steps=3),
                                     dict(admit_after=2, evict_after_steps=3), dict(capacity=9),
                                     dict(admit_after=3, capacity=5, evict_after_steps=4)])
def test_admission_eviction_and_capacity_follow_their_rules(options):
    batches = _batches(steps=10, seed=1)
    _, ids, rows, state = _train(batches, "adagrad", fixed=False, **options)
    live, count, last, admitted, evicted = _bookkeeping(
        batches, options.get("admit_after", 1), options.get("evict_after_steps"), options.get("capacity"))
    assert ids.tolist() == sorted(live)
    assert state["emb/seen_ids"].tolist() == sorted(count)
    assert state["emb/counts"].tolist() == [count[i] for i in sorted(count)]
    assert state["emb/last_seen"].tolist() == [last[i] for i in sorted(count)]
    assert state["emb/clock"].tolist() == [len(batches), admitted, evicted]
    assert state["emb/accumulator"].shape == rows.shape


def test_an_id_waiting_for_admission_reads_zeros_and_its_gradient_is_dropped():
    batches = [np.array([[5, 6, 6]]), np.array([[5, 7, 7]]), np.array([[5, 6, 8]])]
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None, 3])
        table = dynamic.DynamicEmbedding("emb", DIM, admit_after=2, initializer=dynamic.constant(1.0))
        rows = table.lookup(ids)
        loss = tf.reduce_sum(rows)
        train = dynamic.step(loss, tf.compat.v1.train.GradientDescentOptimizer(0.5))
        with tf.compat.v1.Session() as sess:
            read = [sess.run([rows, train], {ids: b})[0][0, :, 0].tolist() for b in batches]
    # step 0: nothing admitted (6 reached 2 occurrences there: admitted at its end, no gradient);
    # step 1: 6 is live (its initial row 1.0), 5 reaches 2 and is admitted; step 2: 5 and 6 live,
    # neither trained yet by a step in which it was live
    assert read == [[0, 0, 0], [0, 0, 0], [1.0, 1.0, 0]]


def test_lookup_sparse_combines_as_embedding_lookup_sparse():
    sparse = tf.compat.v1.SparseTensorValue(indices=[[0, 0], [0, 1], [1, 0], [3, 0], [3, 1], [3, 2]],
                                           values=[3, 9, 3, 1, 1, 7], dense_shape=[4, 3])
    for combiner in ("sum", "mean", "sqrtn"):
        graph = tf.Graph()
        with graph.as_default():
            sp = tf.compat.v1.sparse_placeholder(tf.int64)
            table = dynamic.DynamicEmbedding("emb", DIM)
            got = table.lookup_sparse(sp, combiner)
            weights = table.shards[0].initial_rows(tf.range(10, dtype=tf.int64))
            want = tf.nn.embedding_lookup_sparse(weights, sp, None, combiner=combiner)
            with tf.compat.v1.Session() as sess:
                got_v, want_v = sess.run([got, want], {sp: sparse})
        assert got_v.shape == (4, DIM)
        np.testing.assert_allclose(got_v[[0, 1, 3]], want_v[[0, 1, 3]], rtol=1e-6)
        np.testing.assert_array_equal(got_v[2], np.zeros(DIM))     # a row without ids


def test_string_ids_are_their_fingerprints_and_initial_rows_depend_on_the_id_alone():
    graph = tf.Graph()
    with graph.as_default():
        words = tf.constant([["red", "blue"], ["blue", "green"]])
        hashed = dynamic.as_int64(words)
        table = dynamic.DynamicEmbedding("words", DIM, seed=11)
        by_string, by_id = table.lookup(words), table.lookup(hashed)
        alone = table.lookup(tf.reshape(hashed[1, 1], [1]))
        two_shards = dynamic.DynamicEmbedding("other", DIM, seed=11)
        with tf.compat.v1.Session() as sess:
            h, s, i, a = sess.run([hashed, by_string, by_id, alone])
            want = sess.run(tf.strings.to_hash_bucket_fast(words, 2 ** 63 - 1))
    np.testing.assert_array_equal(h, want)
    np.testing.assert_array_equal(s, i)
    np.testing.assert_array_equal(a[0], s[1, 1])      # the same row, read alone or in a batch
    assert s.std() > 0.1 and np.abs(s).max() <= np.sqrt(3.0 / DIM)


def test_the_feature_column_embeds_as_input_layer_does_with_its_other_columns():
    graph = tf.Graph()
    with graph.as_default():
        words = tf.compat.v1.sparse_placeholder(tf.string)
        counts = tf.compat.v1.placeholder(tf.float32, [None, 1])
        column = dynamic.embedding_column("words", DIM, combiner="sqrtn", seed=5)
        layer = tf.compat.v1.feature_column.input_layer(
            {"words": words, "count": counts}, [column, tf.compat.v1.feature_column.numeric_column("count")])
        (table,) = dynamic.tables(graph)
        direct = table.lookup_sparse(tf.SparseTensor(words.indices, dynamic.as_int64(words.values),
                                                     words.dense_shape), "sqrtn")
        feed = {words: tf.compat.v1.SparseTensorValue([[0, 0], [0, 1], [1, 0]], ["a", "b", "a"], [2, 2]),
                counts: [[2.0], [3.0]]}
        with tf.compat.v1.Session() as sess:
            got, want = sess.run([layer, direct], feed)
    assert table.name == "words_dynamic_embedding" and got.shape == (2, DIM + 1)
    np.testing.assert_array_equal(got[:, 0], [2.0, 3.0])           # input_layer orders columns by name
    np.testing.assert_allclose(got[:, 1:], want, rtol=1e-6)
    assert not np.allclose(want[0], want[1])


@pytest.mark.parametrize("initializer", [dynamic.uniform(), dynamic.normal(0.3), initializers.gaussian(0.0, 0.3, True),
                                         initializers.gaussian(1.0, 0.3, False), initializers.uniform_range(-1, 2)],
                         ids=["uniform", "normal", "truncated_gaussian", "gaussian", "uniform_range"])
def test_the_compiled_initial_rows_equal_the_served_standard_ops(initializer):
    with tf.Graph().as_default():
        ids = tf.constant([0, 1, -1, 2 ** 62 + 7, -2 ** 63, 2 ** 63 - 1, 123456789], tf.int64)
        compiled = initializer.rows(ids, 5, 1234567, tf.float32)
        standard = initializer.rows(ids, 5, 1234567, tf.float32, standard_ops=True)
        kinds = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
        with tf.compat.v1.Session() as sess:
            got, want = sess.run([compiled, standard])
    assert "ParallaxIdUniform" in kinds
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) == got.size


def test_the_compiled_owners_equal_the_standard_ops():
    with tf.Graph().as_default():
        ids = tf.constant([0, 1, -1, 2 ** 62 + 7, -2 ** 63, 2 ** 63 - 1, 123456789, *range(100, 400)], tf.int64)
        compiled = [id_lib.owner(ids, shards) for shards in (2, 3, 8)]
        standard = [id_lib.owner(ids, shards, standard_ops=True) for shards in (2, 3, 8)]
        kinds = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
        with tf.compat.v1.Session() as sess:
            got, want = sess.run([compiled, standard])
    assert "ParallaxIdOwner" in kinds
    for shards, g, w in zip((2, 3, 8), got, want):
        np.testing.assert_array_equal(g, w)
        assert set(g.tolist()) == set(range(shards))


def test_ids_from_a_huge_range_train_in_bounded_memory():
    rng = np.random.RandomState(3)
    batches = [rng.randint(0, 2 ** 62, size=(16, 3), dtype=np.int64) for _ in range(40)]   # every id new
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None, 3])
        table = dynamic.DynamicEmbedding("emb", DIM, capacity=64, evict_after_steps=2)
        loss = tf.reduce_sum(tf.square(table.lookup(ids)))
        train = dynamic.step(loss, tf.compat.v1.train.AdagradOptimizer(0.1))
        rows, tracked = table.shards[0].counters()[0], tf.size(table.shards[0].tracked()[0])
        sizes = []
        with tf.compat.v1.Session() as sess:
            for batch in batches:     # the sizes read once the step (its boundary) is over
                sess.run(train, {ids: batch})
                sizes.append(sess.run([rows, tracked]))
    assert max(r for r, _ in sizes) == 64 and max(t for _, t in sizes) == 64    # 96 new ids a step, 64 kept


def _initial_rows(initializer, dim=16, ids=20000, **table_options):
    """The rows a table with `initializer` gives ids 0..ids-1 on first use."""
    with tf.Graph().as_default():
        table = dynamic.DynamicEmbedding("emb", dim, initializer=initializer, **table_options)
        with tf.compat.v1.Session() as sess:
            return sess.run(table.shards[0].initial_rows(tf.range(ids, dtype=tf.int64)))


_FAN = 16     # the tables' dim: a row's fan for Glorot and He
_TRUNC = 0.87962566103423978     # std of a standard normal truncated at +-2
# name -> (initializer, exact value) or (initializer, [low, high), mean, std)
_TF_INITIALIZERS = {
    "tf.zeros_initializer": (lambda: tf.zeros_initializer(), 0.0),
    "tf.zeros_initializer class": (lambda: tf.zeros_initializer, 0.0),
    "tf.keras Zeros": (lambda: tf.keras.initializers.Zeros(), 0.0),
    "keras Ones": (lambda: __import__("keras").initializers.Ones(), 1.0),
    "tf.ones_initializer": (lambda: tf.ones_initializer(), 1.0),
    "tf.constant_initializer": (lambda: tf.constant_initializer(0.25), 0.25),
    "v1 constant_initializer": (lambda: tf.compat.v1.constant_initializer(-1.5), -1.5),
    "tf.keras Constant": (lambda: tf.keras.initializers.Constant(3.0), 3.0),
    "tf.random_uniform_initializer": (lambda: tf.random_uniform_initializer(-0.2, 0.6), (-0.2, 0.6), 0.2,
                                      0.8 / np.sqrt(12)),
    "v1 random_uniform_initializer": (lambda: tf.compat.v1.random_uniform_initializer(), (0.0, 1.0), 0.5,
                                      1 / np.sqrt(12)),
    "keras RandomUniform": (lambda: __import__("keras").initializers.RandomUniform(), (-0.05, 0.05), 0.0,
                            0.1 / np.sqrt(12)),
    "tf.random_normal_initializer": (lambda: tf.random_normal_initializer(0.5, 0.3), (-np.inf, np.inf), 0.5, 0.3),
    "tf.keras RandomNormal": (lambda: tf.keras.initializers.RandomNormal(stddev=2.0), (-np.inf, np.inf), 0.0, 2.0),
    "tf.keras TruncatedNormal": (lambda: tf.keras.initializers.TruncatedNormal(stddev=0.3), (-0.6, 0.6), 0.0,
                                 0.3 * _TRUNC),
    "v1 truncated_normal_initializer": (lambda: tf.compat.v1.truncated_normal_initializer(1.0, 0.1), (0.8, 1.2),
                                        1.0, 0.1 * _TRUNC),
    "tf.keras GlorotUniform": (lambda: tf.keras.initializers.GlorotUniform(), (-np.sqrt(6 / (2 * _FAN)),
                               np.sqrt(6 / (2 * _FAN))), 0.0, np.sqrt(2 / (2 * _FAN))),
    "tf.initializers GlorotUniform": (lambda: tf.initializers.GlorotUniform(), (-np.sqrt(6 / (2 * _FAN)),
                                      np.sqrt(6 / (2 * _FAN))), 0.0, np.sqrt(2 / (2 * _FAN))),
    "v1 glorot_uniform_initializer": (lambda: tf.compat.v1.glorot_uniform_initializer(),
                                      (-np.sqrt(6 / (2 * _FAN)), np.sqrt(6 / (2 * _FAN))), 0.0, np.sqrt(1 / _FAN)),
    "keras GlorotNormal": (lambda: __import__("keras").initializers.GlorotNormal(),
                           (-2 * np.sqrt(1 / _FAN) / _TRUNC, 2 * np.sqrt(1 / _FAN) / _TRUNC), 0.0, np.sqrt(1 / _FAN)),
    "tf.keras HeUniform": (lambda: tf.keras.initializers.HeUniform(), (-np.sqrt(6 / _FAN), np.sqrt(6 / _FAN)),
                           0.0, np.sqrt(2 / _FAN)),
    "tf.keras HeNormal": (lambda: tf.keras.initializers.HeNormal(), (-2 * np.sqrt(2 / _FAN) / _TRUNC,
                          2 * np.sqrt(2 / _FAN) / _TRUNC), 0.0, np.sqrt(2 / _FAN)),
    "keras VarianceScaling untruncated": (
        lambda: __import__("keras").initializers.VarianceScaling(0.5, distribution="untruncated_normal"),
        (-np.inf, np.inf), 0.0, np.sqrt(0.5 / _FAN)),
}


@pytest.mark.parametrize("name", sorted(_TF_INITIALIZERS))
def test_tf_and_keras_initializers_give_rows_of_their_law(name):
    make, *law = _TF_INITIALIZERS[name]
    rows = _initial_rows(make(), dim=_FAN)
    if len(law) == 1:
        np.testing.assert_array_equal(rows, np.full_like(rows, law[0]))
        return
    (low, high), mean, std = law
    assert low <= rows.min() and rows.max() < high
    assert abs(rows.mean() - mean) < 0.01 * std and abs(rows.std() - std) < 0.01 * std, (rows.mean(), rows.std())
    if np.isfinite(high):                 # the whole range is used, not a narrower one
        assert rows.max() > high - 0.02 * (high - low) and rows.min() < low + 0.02 * (high - low)
    else:                                 # not truncated: beyond 2 stddev as often as a normal is (4.55%)
        assert abs(np.mean(np.abs(rows - mean) > 2 * std) - 0.0455) < 0.003


def test_an_initializers_seed_is_the_tables_seed():
    glorot = tf.keras.initializers.GlorotUniform
    seeded = _initial_rows(glorot(seed=7), ids=50)
    np.testing.assert_array_equal(seeded, _initial_rows(glorot(), ids=50, seed=7))
    np.testing.assert_array_equal(seeded, _initial_rows(glorot(seed=7), ids=50, seed=7))
    assert not np.allclose(seeded, _initial_rows(glorot(seed=8), ids=50))
    with tf.Graph().as_default(), pytest.raises(ModelError, match=r"DynamicEmbedding\('emb', seed=3\) and its "
                                                                  r"initializer's seed=7 differ"):
        dynamic.DynamicEmbedding("emb", 4, initializer=glorot(seed=7), seed=3)


def test_an_initializer_without_a_row_law_gets_one_line_naming_what_is_accepted():
    with tf.Graph().as_default(), pytest.raises(ModelError) as raised:
        dynamic.DynamicEmbedding("emb", 4, initializer=tf.keras.initializers.Orthogonal())
    assert str(raised.value) == (
        "DynamicEmbedding(initializer=tf_keras.Orthogonal): pass None, a number, a parallax_tf.dynamic initializer "
        "(uniform(scale), normal(stddev), constant(value)) or a TensorFlow/Keras initializer: zeros, ones, constant "
        "(a scalar), random uniform, random normal, truncated normal, or variance scaling (Glorot, He, LeCun; "
        "fan = dim); a row's initial value must depend on its id alone")
    with tf.Graph().as_default(), pytest.raises(ModelError, match=r"a table takes a scalar constant"):
        dynamic.DynamicEmbedding("emb", 2, initializer=tf.constant_initializer([1.0, 2.0]))


def test_mistakes_get_one_message_each():
    with tf.Graph().as_default():
        for kwargs, says in ((dict(name="a:b", dim=2), "without ':'"), (dict(name="a", dim=0), "dim=0"),
                             (dict(name="a", dim=2, admit_after=0), "admit_after=0"),
                             (dict(name="a", dim=2, capacity=-1), "capacity=-1"),
                             (dict(name="a", dim=2, initializer="zeros"), "initializer='zeros'")):
            with pytest.raises(ModelError, match=says):
                dynamic.DynamicEmbedding(**kwargs)
        table = dynamic.DynamicEmbedding("emb", 2)
        with pytest.raises(ModelError, match="two dynamic tables are named 'emb'"):
            dynamic.DynamicEmbedding("emb", 2)
        with pytest.raises(ModelError, match="combiner='max'"):
            table.lookup_sparse(tf.SparseTensor([[0, 0]], tf.constant([1], tf.int64), [1, 1]), "max")
        loss = tf.reduce_sum(table.lookup(tf.constant([1, 2], tf.int64)))
        with pytest.raises(ModelError, match="cannot train with RMSPropOptimizer"):
            dynamic.step(loss, tf.compat.v1.train.RMSPropOptimizer(0.1))


def test_the_plan_shows_each_table_and_a_strategy_without_them_refuses():
    model_fn = dynamic_models.model_fn("adagrad", admit_after=2, capacity=100)
    result = ptf.run(model_fn, lambda ctx: dynamic_models.batch(0, 0), plan_only=True, strategy="hybrid", np=2,
                     partitions=3, log_every=0)
    (table,) = result.plan.dynamic_tables
    assert (table.name, table.dim, table.shards, table.optimizer, table.admit_after, table.capacity) == \
        ("emb", dynamic_models.DIM, 3, "adagrad", 2, 100)
    assert "dynamic table emb: dim 3 float32, 3 shards by id, adagrad per row" in result.plan.table()
    assert ptf.Plan.from_json(result.plan.to_json()).dynamic_tables == [table]
    with pytest.raises(ConfigError, match="--strategy=stanza cannot train dynamic tables \\(emb\\); use one of"):
        ptf.run(model_fn, lambda ctx: dynamic_models.batch(0, 0), plan_only=True, strategy="stanza", np=2,
                log_every=0)


def test_a_row_rule_is_data_a_backend_can_read():
    from parallax_tf.dynamic.rules import rule_for
    ftrl = rule_for(tf.compat.v1.train.FtrlOptimizer(0.3, l1_regularization_strength=0.001,
                                                     initial_accumulator_value=0.2))
    assert (ftrl.kind, ftrl.slots) == ("ftrl", [("accum", 0.2), ("linear", 0.0)])
    assert (ftrl.hyper["learning_rate"], ftrl.hyper["l1"], ftrl.hyper["learning_rate_power"]) == (0.3, 0.001, -0.5)
    momentum = rule_for(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True))
    assert (momentum.kind, momentum.hyper, momentum.slots) == (
        "momentum", dict(learning_rate=0.1, momentum=0.9, nesterov=True), [("momentum", 0.0)])
    rows, grads = tf.constant([[1.0, 2.0]]), tf.constant([[0.5, -1.0]])
    moved, slots = momentum.apply(rows, {"momentum": tf.zeros_like(rows)}, grads, tf.constant(0, tf.int64))
    np.testing.assert_allclose(slots["momentum"].numpy(), [[0.5, -1.0]])
    np.testing.assert_allclose(moved.numpy(), [[1.0 - 0.05 - 0.045, 2.0 + 0.1 + 0.09]], rtol=1e-6)


def test_auto_places_each_table_where_its_step_is_predicted_faster_and_the_flag_decides_otherwise():
    """Few ids a step: replicated (no round trip to a server before the next read); many ids on a
    slow link: the servers (each rank would receive every other rank's push); a copy that could
    outgrow its share of a rank's memory, or nothing bounding it: the servers. --dynamic_tables
    overrides auto, and a table that cannot be replicated is refused in one line."""
    import dataclasses

    from parallax_tf.costmodel import REPLICA_MEMORY_SHARE, Cluster, replica_bytes
    from parallax_tf.inspect_graph import capture
    from parallax_tf.model import RunContext
    from parallax_tf.planner import PlanRequest, make_plan
    feed = dynamic_models.batch(0, 0)
    captured = capture(dynamic_models.model_fn("adagrad"), lambda ctx: feed, RunContext(), seed=0)
    (described,) = captured.dynamic_tables
    ids = len(np.unique(feed["ids"]))
    assert (described["ids_per_step"], described["compiles"], described["slots"]) == (ids, True, 1)
    # 100 steps of 8 ranks: rows of 3 values and 3 Adagrad slots, and 32 B an id
    assert replica_bytes(described, 100, 8) == 800 * ids * (4 * 3 * 2 + 32)

    def planned(captured, bandwidth, memory=2**34, steps=100, **given):
        cluster = Cluster(8, 1, bandwidth_bytes_per_s=bandwidth, memory_bytes=memory)
        (table,) = make_plan(PlanRequest(captured, "auto", 8, 8, cost_cluster=cluster, steps=steps,
                                         **given)).dynamic_tables
        return table

    fast = planned(captured, 1e9 / 8)
    assert (fast.route, fast.shards) == ("replicated", 1) and fast.reason.startswith("cost model: predicted step")
    assert "replicated on every rank (pushes allgathered) (cost model: predicted step" in fast.line()
    crowded = dataclasses.replace(captured, dynamic_tables=[dict(described, ids_per_step=200_000)])
    slow = planned(crowded, 10e6 / 8, steps=1)
    assert (slow.route, slow.shards) == ("servers", 8) and "; replicated " in slow.reason
    assert planned(crowded, 10e6 / 8, dynamic_tables="replicated").route == "replicated"     # whatever its size
    assert planned(captured, 1e9 / 8, dynamic_tables="servers").route == "servers"
    sharded = planned(captured, 1e9 / 8, partitions=3)         # as before replication: 3 shards on the servers
    assert (sharded.route, sharded.shards, sharded.reason) == ("servers", 3, "--partitions=3")
    unbounded = planned(captured, 1e9 / 8, steps=None)
    assert unbounded.route == "servers" and "nothing bounds a copy's rows" in unbounded.reason
    capped = dataclasses.replace(captured, dynamic_tables=[dict(described, capacity=1000)])
    assert planned(capped, 1e9 / 8, steps=None).route == "replicated"       # its capacity bounds it
    too_big = replica_bytes(described, 100, 8) / REPLICA_MEMORY_SHARE - 1   # the host's memory, one byte short
    assert planned(captured, 1e9 / 8, memory=too_big + 2).route == "replicated"
    past = planned(captured, 1e9 / 8, memory=too_big)
    assert past.route == "servers" and "past what a rank gives copies" in past.reason, past.reason
    unmeasured = dataclasses.replace(captured, dynamic_tables=[dict(described, ids_per_step=None)])
    assert planned(unmeasured, 1e9 / 8).route == "servers"
    normal = dataclasses.replace(captured, dynamic_tables=[dict(described, compiles=False)])
    with pytest.raises(ConfigError, match="--dynamic_tables=replicated: table 'emb' cannot be replicated"):
        planned(normal, 1e9 / 8, dynamic_tables="replicated")
    with pytest.raises(ConfigError, match="--dynamic_tables='ranks': use servers or replicated"):
        ptf.run(dynamic_models.model_fn("adagrad"), lambda ctx: feed, plan_only=True, dynamic_tables="ranks",
                log_every=0)
