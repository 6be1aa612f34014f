"""The compiled table shard (dynamic/compiled.py) against the standard-op one (dynamic/store.py),
step by step on the same ids: every read and every exported array equal to 1e-6, shard by shard
and as whole tables (string ids, two lookups a step, capacity), and each backend resuming the
other's checkpoint arrays."""
import threading

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf import dynamic
from parallax_tf.dynamic import compiled
from parallax_tf.dynamic import ids as id_lib
from parallax_tf.dynamic import initializers
from parallax_tf.dynamic import routes
from parallax_tf.dynamic import table as table_lib
from parallax_tf.dynamic.compiled import CompiledShard
from parallax_tf.dynamic.rules import rule_for
from parallax_tf.dynamic.state import DynamicState
from parallax_tf.dynamic.store import Shard, TableOptions

OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    "nesterov": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.2, initial_accumulator_value=0.3),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(0.3, l1_regularization_strength=0.001,
                                                     l2_regularization_strength=0.01),
    "ftrl_power": lambda: tf.compat.v1.train.FtrlOptimizer(0.3, learning_rate_power=-0.7,
                                                           l2_shrinkage_regularization_strength=0.02),
}
DIM, STEPS = 3, 6


def _run(shard_class, optimizer: str, admit_after: int, evict_after, steps: int = STEPS, vocabulary: int = 12):
    graph = tf.Graph()
    with graph.as_default():
        options = TableOptions(dim=DIM, dtype=tf.float32, initializer=id_lib.uniform(0.5), seed=7,
                               admit_after=admit_after, evict_after_steps=evict_after)
        shard = shard_class("t", 0, None, options)
        rule = rule_for(OPTIMIZERS[optimizer]())
        shard.with_slots(rule.slots)          # the compiled shard holds its slots in the row's entry
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        grads = tf.compat.v1.placeholder(tf.float32, [None, DIM])
        counts = tf.compat.v1.placeholder(tf.int64, [None])
        read = shard.read(ids)
        boundary = shard.boundary(ids, grads, counts, rule)
        exported = shard.export()
        counters = shard.counters()
        rng = np.random.RandomState(3)
        seen = []
        with tf.compat.v1.Session(graph=graph) as sess:
            for _ in range(steps):
                step_ids = np.unique(rng.randint(0, vocabulary, 5)).astype(np.int64)
                feed = {ids: step_ids, grads: rng.normal(size=(len(step_ids), DIM)).astype(np.float32),
                        counts: rng.randint(1, 3, len(step_ids))}
                seen.append(sess.run(read, {ids: np.arange(vocabulary + 2, dtype=np.int64)}))
                sess.run(boundary, feed)
                seen.append(sess.run(counters))      # live rows, boundaries, admitted, evicted
            seen.append(sess.run(read, {ids: np.arange(vocabulary + 2, dtype=np.int64)}))
            arrays = shard.unpack(sess.run(exported))
    return seen, _by_id(arrays, [s for s, _ in rule.slots])


def _by_id(arrays, slots):
    rows = np.argsort(arrays["ids"])
    tracked = np.argsort(arrays["seen_ids"])
    out = {k: arrays[k][rows] for k in ["ids", "values", *slots]}
    out.update({k: arrays[k][tracked] for k in ["seen_ids", "counts", "last_seen"]})
    out["clock"] = arrays["clock"]
    return out


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("admit_after, evict_after", [(1, None), (2, 2)])
def test_the_compiled_shard_trains_as_the_standard_one(optimizer, admit_after, evict_after):
    standard_reads, standard = _run(Shard, optimizer, admit_after, evict_after)
    compiled_reads, compiled = _run(CompiledShard, optimizer, admit_after, evict_after)
    for step, (want, got) in enumerate(zip(standard_reads, compiled_reads)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"read before boundary {step}")
    assert sorted(standard) == sorted(compiled)
    for key in standard:
        np.testing.assert_allclose(compiled[key], standard[key], rtol=1e-6, atol=1e-6, err_msg=key)
    assert len(standard["ids"]) > 3 and standard["clock"][0] == STEPS


@pytest.mark.parametrize("admit_after, evict_after, vocabulary", [(1, 4, 7), (2, 3, 9), (1, 1, 40)])
def test_eviction_over_many_boundaries_counts_and_drops_as_the_standard_shard(admit_after, evict_after, vocabulary):
    """The compiled shard evicts from its ids bucketed by the boundary that last saw them, and
    counts live rows as they change: over 30 boundaries (few ids seen again and again, so the
    buckets outgrow the entries and are rebuilt; or many ids, most soon evicted), every read,
    every counter and the last arrays equal the standard shard's scan of all entries."""
    standard_reads, standard = _run(Shard, "adagrad", admit_after, evict_after, steps=30, vocabulary=vocabulary)
    compiled_reads, compiled = _run(CompiledShard, "adagrad", admit_after, evict_after, steps=30,
                                    vocabulary=vocabulary)
    for step, (want, got) in enumerate(zip(standard_reads, compiled_reads)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"read or counters {step}")
    _assert_same(compiled, standard)
    live_by_step = [int(r[0]) for r in standard_reads[1::2]]
    assert standard["clock"][2] > 0 and min(live_by_step) < max(live_by_step), (standard["clock"], live_by_step)


def _train_table(monkeypatch, backend: str, optimizer: str, batches, start=None, **table_options):
    """A table of string ids read by two lookups a step (a sum-of-rows regression), on
    `backend`: (each step's rows of both lookups, the table's arrays after the last step).
    `start`: arrays (DynamicState.read) the table loads before the first step."""
    with monkeypatch.context() as patch:
        if backend == "standard":
            patch.setattr(table_lib.compiled, "holds", lambda options: False)
        graph = tf.Graph()
        with graph.as_default():
            words = tf.compat.v1.placeholder(tf.string, [None, 3])
            table = dynamic.DynamicEmbedding("emb", DIM, **table_options)
            assert isinstance(table.shards[0], CompiledShard if backend == "compiled" else Shard)
            first, second = table.lookup(words[:, :2]), table.lookup(words[:, 2:])
            target = tf.cast(tf.strings.length(words[:, 0]), tf.float32)
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(first, [1, 2]) + tf.reduce_sum(second, [1, 2]) - target))
            train = dynamic.step(loss, OPTIMIZERS[optimizer]())
            state = DynamicState([table])
            with tf.compat.v1.Session() as sess:
                if start is not None:
                    state.load(sess, start)
                seen = [sess.run([first, second, train], {words: batch})[:2] for batch in batches]
                return seen, state.read(sess)


def _word_batches(steps, seed):
    rng = np.random.RandomState(seed)
    return [np.array([[f"w{v}".encode() for v in row] for row in rng.randint(0, 30, (4, 3))]) for _ in range(steps)]


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("optimizer, options", [
    ("adam", dict(capacity=12)),
    ("ftrl", dict(admit_after=2, evict_after_steps=3)),
    ("momentum", dict(capacity=10, admit_after=2)),
])
def test_a_table_with_string_ids_and_two_lookups_trains_alike_on_either_backend(monkeypatch, optimizer, options):
    batches = _word_batches(8, seed=5)
    standard_reads, standard = _train_table(monkeypatch, "standard", optimizer, batches, **options)
    compiled_reads, compiled = _train_table(monkeypatch, "compiled", optimizer, batches, **options)
    for step, (want, got) in enumerate(zip(standard_reads, compiled_reads)):
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=f"step {step}")
    _assert_same(compiled, standard)
    evicted_or_capped = standard["emb/clock"][2]
    assert len(standard["emb/ids"]) >= 5 and evicted_or_capped > 0, standard["emb/clock"]


@pytest.mark.parametrize("saved_by, resumed_by", [("standard", "compiled"), ("compiled", "standard")])
@pytest.mark.parametrize("options", [dict(capacity=14, admit_after=2), dict(evict_after_steps=2)],
                         ids=["capacity", "eviction"])
def test_either_backend_resumes_the_others_checkpoint(monkeypatch, saved_by, resumed_by, options):
    batches = _word_batches(6, seed=9)
    _, whole = _train_table(monkeypatch, "standard", "adagrad", batches, **options)
    _, saved = _train_table(monkeypatch, saved_by, "adagrad", batches[:3], **options)
    _, resumed = _train_table(monkeypatch, resumed_by, "adagrad", batches[3:], start=saved, **options)
    _assert_same(resumed, whole)
    # rows left (evicted or over capacity) after the resume too
    assert resumed["emb/clock"][0] == 6 and whole["emb/clock"][2] > saved["emb/clock"][2], \
        (whole["emb/clock"], saved["emb/clock"])


def test_one_op_answers_a_messages_reads_as_each_shard_would():
    """compiled.read_many against each shard's own read, for shards of several tables and laws,
    admission on first use and after two occurrences, after some boundaries; in a container
    scope, as a run builds its graphs (the op finds the shards where their handles put them)."""
    laws = [(id_lib.uniform(), 1), (initializers.uniform_range(-0.3, 0.1), 1), (id_lib.constant(0.25), 1),
            (id_lib.uniform(0.05), 2)]
    graph = tf.Graph()
    with graph.as_default(), graph.container("run7"):
        shards = [CompiledShard(f"t{k}", k, None, TableOptions(dim=2 + k, dtype=tf.float32, initializer=law, seed=k,
                                                             admit_after=admit, evict_after_steps=None))
                  for k, (law, admit) in enumerate(laws)]
        assert compiled.fusable(shards) and not compiled.fusable(shards + [CompiledShard(
            "n", 9, None, TableOptions(dim=2, dtype=tf.float32, initializer=id_lib.normal(), seed=1, admit_after=1,
                                       evict_after_steps=None))])
        rule = rule_for(OPTIMIZERS["adagrad"]())
        ids = [tf.compat.v1.placeholder(tf.int64, [None]) for _ in shards]
        boundaries = [shard.boundary(i, tf.ones([tf.size(i), shard.options.dim]), tf.ones_like(i), rule)
                      for shard, i in zip(shards, ids)]
        each = tf.concat([tf.reshape(shard.read(i), [-1]) for shard, i in zip(shards, ids)], 0)
        message = tf.concat([tf.stack([tf.size(i, out_type=tf.int64) for i in ids])] + ids, 0)
        together = compiled.read_many(shards, message)
        rng = np.random.RandomState(4)
        with tf.compat.v1.Session(graph=graph) as sess:
            for step in range(4):
                feed = {i: np.unique(rng.randint(0, 20, 6)).astype(np.int64) for i in ids}
                want, got = sess.run([each, together], feed)
                np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
                sess.run(boundaries, feed)
        assert want.size > 40


def _two_rank_step_arrays(fused: bool, optimizer: str, pushes):
    """One shard's table after each step's pushes of two ranks (ids, [n, dim + 1] payloads):
    through compiled.push and boundary_many, or summed here and given to the standard shard."""
    graph = tf.Graph()
    with graph.as_default():
        options = TableOptions(dim=DIM, dtype=tf.float32, initializer=id_lib.uniform(0.3), seed=5, admit_after=2,
                               evict_after_steps=2)
        shard = (CompiledShard if fused else Shard)("t", 0, None, options)
        rule = rule_for(OPTIMIZERS[optimizer]())
        shard.with_slots(rule.slots)
        ids = [tf.compat.v1.placeholder(tf.int64, [None]) for _ in range(2)]
        payloads = [tf.compat.v1.placeholder(tf.float32, [None, DIM + 1]) for _ in range(2)]
        if fused:
            steps = [compiled.push([shard], compiled.message([i]), tf.reshape(p, [-1]), rank, 2)
                     for rank, (i, p) in enumerate(zip(ids, payloads))]
            steps.append(compiled.boundary_many([shard], [rule], 2))
        else:
            distinct, position = tf.unique(tf.concat(ids, 0), out_idx=tf.int32)
            summed = tf.math.unsorted_segment_sum(tf.concat(payloads, 0), position, tf.size(distinct))
            steps = [shard.boundary(distinct, summed[:, :-1] / 2.0, tf.cast(tf.round(summed[:, -1]), tf.int64), rule)]
        exported = shard.export()
        with tf.compat.v1.Session(graph=graph) as sess:
            for step in pushes:
                feed = {**dict(zip(ids, [ids_ for ids_, _ in step])), **dict(zip(payloads, [p for _, p in step]))}
                for op in steps:        # the ranks' pushes, then the boundary
                    sess.run(op, feed)
            return _by_id(shard.unpack(sess.run(exported)), [s for s, _ in rule.slots])


@pytest.mark.parametrize("optimizer", ["adagrad", "ftrl", "adam"])
def test_one_op_ends_a_step_of_every_ranks_pushes_as_the_standard_shard(optimizer):
    rng = np.random.RandomState(11)
    pushes = []
    for _ in range(5):
        step = []
        for _ in range(2):
            ids = np.unique(rng.randint(0, 10, 4)).astype(np.int64)
            payload = np.concatenate([rng.normal(size=(len(ids), DIM)), rng.randint(1, 3, (len(ids), 1))], 1)
            step.append((ids, payload.astype(np.float32)))
        pushes.append(step)
    want = _two_rank_step_arrays(False, optimizer, pushes)
    got = _two_rank_step_arrays(True, optimizer, pushes)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)
    assert len(want["ids"]) > 2 and want["clock"][2] > 0, want["clock"]


def test_a_boundary_whose_pushes_never_all_come_ends_at_the_steps_deadline():
    graph = tf.Graph()
    with graph.as_default():
        shard = CompiledShard("t", 0, None, TableOptions(dim=2, dtype=tf.float32, initializer=id_lib.uniform(),
                                                         seed=1, admit_after=1, evict_after_steps=None))
        pushed = compiled.push([shard], compiled.message([tf.constant([3], tf.int64)]), tf.constant([0.1, 0.2, 1.0]),
                               0, 2)
        boundary = compiled.boundary_many([shard], [rule_for(OPTIMIZERS["sgd"]())], 2)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(pushed)
            with pytest.raises((tf.errors.DeadlineExceededError, tf.errors.CancelledError)):
                sess.run(boundary, options=tf.compat.v1.RunOptions(timeout_in_ms=300))


def test_a_ranks_read_waits_for_the_boundary_of_its_push_and_then_reads_its_rows():
    """read_many with a rank waits, without holding the session's thread, until boundary_many
    applied that rank's last push; a read that no boundary releases ends at the step's deadline.
    A rank that has not pushed reads at once. The shard's export waits as the read of the rank
    that settled it (compiled.settle) does."""
    graph = tf.Graph()
    with graph.as_default():
        shard = CompiledShard("t", 0, "/cpu:0", TableOptions(dim=2, dtype=tf.float32, seed=1,
                                                             initializer=id_lib.constant(0.5), admit_after=1,
                                                             evict_after_steps=None))
        ids = compiled.message([tf.constant([3], tf.int64)])
        with tf.device("/cpu:0"):
            pushes = [compiled.push([shard], ids, tf.constant([0.2, 0.4, 1.0]), rank, 2) for rank in range(2)]
            boundary = compiled.boundary_many([shard], [rule_for(OPTIMIZERS["sgd"]())], 2)
            reads = [compiled.read_many([shard], ids, rank, 2) for rank in range(2)]
        compiled.settle([shard], 1, 2)
        shard.with_slots([])
        exported = shard.export()
        with tf.compat.v1.Session(graph=graph) as sess:
            np.testing.assert_allclose(sess.run(reads[1]), [0.5, 0.5])
            sess.run(pushes[1])
            np.testing.assert_allclose(sess.run(reads[0]), [0.5, 0.5])      # rank 0 has not pushed
            for waits in (reads[1], exported):
                with pytest.raises((tf.errors.DeadlineExceededError, tf.errors.CancelledError)):
                    sess.run(waits, options=tf.compat.v1.RunOptions(timeout_in_ms=300))
            done = []
            waiting = threading.Thread(target=lambda: done.append(sess.run(reads[1])))
            waiting.start()
            waiting.join(0.5)
            assert waiting.is_alive() and not done
            sess.run([pushes[0], boundary])
            waiting.join(30)
            # sgd 0.1 on the mean of the ranks' gradients (0.2, 0.4)
            np.testing.assert_allclose(done, [[0.5 - 0.1 * 0.2, 0.5 - 0.1 * 0.4]], rtol=1e-6)
            np.testing.assert_allclose(sess.run(exported)["values"], [[0.5 - 0.1 * 0.2, 0.5 - 0.1 * 0.4]], rtol=1e-6)


def test_one_op_routes_every_entrys_ids_to_their_servers_and_one_gathers_the_answers_back():
    """routes.Route against standard ops: each entry's ids split by owner (ids.owner) into one
    message per server, entry after entry and shard after shard (three shards on two servers,
    two entries on one table, an empty entry); rows spread the same way; the answers gathered
    back in each entry's order."""
    class Placed:
        def __init__(self, device):
            self.device = device

    servers = ["/job:ps/task:0", "/job:ps/task:1"]
    tables = [[Placed(servers[k % 2]) for k in range(3)], [Placed(servers[1])], [Placed(s) for s in servers]]
    entries = [tables[0], tables[1], tables[0], tables[2]]
    widths = [2, 3, 2, 1]
    rng = np.random.RandomState(3)
    given = [rng.randint(-2 ** 62, 2 ** 62, n).astype(np.int64) for n in (9, 4, 0, 7)]
    route = routes.Route(entries)
    assert route.devices == servers
    graph = tf.Graph()
    with graph.as_default():
        ids = [tf.constant(i, tf.int64) for i in given]
        rows = [tf.constant(rng.normal(size=(len(i), w)).astype(np.float32)) for i, w in zip(given, widths)]
        messages, flats = route.messages(ids), route.spread(ids, rows)
        owners = [id_lib.owner(i, len(entry)) for i, entry in zip(ids, entries)]
        with tf.compat.v1.Session(graph=graph) as sess:
            got_messages, got_flats, owner_of, want_rows = sess.run([messages, flats, owners, rows])
            back = sess.run(route.gather(ids, flats, widths))
    for server in servers:
        parts = [(e, k) for e, entry in enumerate(entries) for k, shard in enumerate(entry) if shard.device == server]
        counts = [int(np.sum(owner_of[e] == k)) for e, k in parts]
        want_ids = [given[e][owner_of[e] == k] for e, k in parts]
        np.testing.assert_array_equal(got_messages[server], np.concatenate([counts] + want_ids).astype(np.int64))
        want_flat = np.concatenate([want_rows[e][owner_of[e] == k].reshape(-1) for e, k in parts])
        np.testing.assert_array_equal(got_flats[server], want_flat)
    for e in range(len(entries)):
        np.testing.assert_array_equal(back[e], want_rows[e])
    assert sum(len(m) for m in got_messages.values()) == sum(len(i) for i in given) + 9     # a count a part
