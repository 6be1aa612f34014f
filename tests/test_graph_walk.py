"""parallax_tf.graph_walk: the walks' results on tiny graphs, the op-type sets on the ops TF
really makes, and that no other module keeps its own copy of those sets."""
import ast
import os

import numpy as np
import tensorflow as tf

from parallax_tf import graph_walk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _names(ops) -> set:
    return {op.name for op in ops}


def _chain():
    """x -> a = x * 2 -> b = a + 1 -> c = b * 3, with `side` run before c by control only."""
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    a = tf.multiply(x, tf.constant(2.0, name="two"), name="a")
    b = tf.add(a, tf.constant(1.0, name="one"), name="b")
    side = tf.no_op(name="side")
    with tf.control_dependencies([side]):
        c = tf.multiply(b, tf.constant(3.0, name="three"), name="c")
    return x, a, b, c


def test_ancestors_data_and_control_data_only_and_a_stop_set():
    with tf.Graph().as_default():
        x, a, b, c = _chain()
        assert _names(graph_walk.ancestors(c)) == {"x", "two", "a", "one", "b", "side", "three", "c"}
        assert _names(graph_walk.ancestors(c.op, data_only=True)) == {"x", "two", "a", "one", "b", "three", "c"}
        # b is kept but not walked past: nothing below it
        assert _names(graph_walk.ancestors(c, data_only=True, stop={b.op})) == {"b", "three", "c"}
        assert _names(graph_walk.ancestors(c, stop=[b.op])) == {"b", "side", "three", "c"}
        assert graph_walk.needed_placeholders(c, a.op) == ["x"]


def test_descendants_inside_a_set_and_reachable_by_any_step():
    with tf.Graph().as_default():
        x, a, b, c = _chain()
        assert _names(graph_walk.descendants({a.op})) == {"a", "b", "c"}
        assert _names(graph_walk.descendants({x.op, a.op}, within={a.op, b.op})) == {"a", "b"}
        assert _names(graph_walk.reachable([c.op], lambda op: [t.op for t in op.inputs[:1]])) == {"c", "b", "a", "x"}


def test_walks_skip_pass_through_ops():
    with tf.Graph().as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        modulo = tf.math.floormod(ids, 3, name="modulo")
        passed = tf.reshape(tf.cast(tf.identity(modulo), tf.int32), [-1], name="passed")
        assert graph_walk.feeding_op(passed, graph_walk.VALUE_PASS_THROUGH_OPS) is modulo.op
        assert graph_walk.feeding_op(passed, graph_walk.HANDLE_PASS_THROUGH_OPS) is passed.op   # a Reshape stops it

        weight = tf.compat.v1.get_variable("w", [2, 2], use_resource=True)
        inputs = tf.compat.v1.placeholder(tf.float32, [None, 2], name="inputs")
        read = tf.identity(weight.read_value(), name="read")
        product = tf.matmul(inputs, read, name="product")
        reshape = tf.reshape(read, [2, 2], name="reshape")
        reshaped = tf.matmul(inputs, reshape, name="reshaped")
        users = graph_walk.users(weight.handle, graph_walk.VALUE_READ_OPS)
        assert product.op in users and reshape.op in users and reshaped.op not in users
        assert not any(op.type in graph_walk.VALUE_READ_OPS for op in users)
        weight_users = graph_walk.users(weight.handle, graph_walk.WEIGHT_PASS_THROUGH_OPS)
        assert reshaped.op in weight_users and reshape.op not in weight_users      # a Reshape looked through
        assert product.op not in graph_walk.users(weight.handle, graph_walk.VALUE_READ_OPS, max_depth=1)
        assert graph_walk.users(weight.handle, graph_walk.VALUE_READ_OPS,
                                within=graph_walk.ancestors(product)) == [product.op]
        pairs = {op.name: tensor.name for op, tensor in graph_walk.reads_of(weight.handle, graph_walk.VALUE_READ_OPS)}
        assert pairs["product"] == pairs["reshape"] == read.name


def test_input_ops_placeholders_and_tf_data_reads():
    with tf.Graph().as_default():
        fed = tf.compat.v1.placeholder(tf.float32, [None], name="fed")
        defaulted = tf.compat.v1.placeholder_with_default(1.0, [], name="defaulted")
        dataset = tf.compat.v1.data.Dataset.from_tensor_slices(np.arange(4, dtype=np.float32)).batch(2)
        iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
        batch = iterator.get_next()
        loss = tf.reduce_sum(batch * fed) * defaulted
        inputs = {op.type for op in graph_walk.ancestors(loss) if op.type in graph_walk.INPUT_OPS}
        assert inputs == {"Placeholder", "PlaceholderWithDefault", "IteratorGetNext"}
        fed_inputs = {op.type for op in graph_walk.ancestors(loss) if op.type in graph_walk.FED_INPUT_OPS}
        assert fed_inputs == {"Placeholder", "IteratorGetNext"}
        assert graph_walk.needed_placeholders(loss) == ["fed"]
        assert batch.op.type in graph_walk.ITERATOR_READ_OPS
        resource = batch.op.inputs[0]
        assert graph_walk.feeding_op(resource, graph_walk.HANDLE_PASS_THROUGH_OPS).type in graph_walk.ITERATOR_OPS
        copied = tf.raw_ops.IteratorGetNext(iterator=tf.identity(resource), output_types=[tf.float32],
                                            output_shapes=[tf.TensorShape([None])])[0]
        assert graph_walk.feeding_op(copied.op.inputs[0], graph_walk.HANDLE_PASS_THROUGH_OPS) is resource.op


def test_variable_ops_resource_and_ref():
    with tf.Graph().as_default():
        resource = tf.compat.v1.get_variable("resource", [1], use_resource=True)
        ref = tf.compat.v1.get_variable("ref", [1], use_resource=False)
        assert resource.op.type in graph_walk.RESOURCE_VARIABLE_OPS
        assert ref.op.type in graph_walk.REF_VARIABLE_OPS
        assert {resource.op.type, ref.op.type} <= graph_walk.VARIABLE_OPS
        assert tf.raw_ops.ReadVariableOp(resource=resource.handle, dtype=tf.float32).op.type \
            in graph_walk.RESOURCE_READ_OPS


# What only graph_walk.py may spell out: the op types of the graph's sources and of a variable's read.
_OWNED = (graph_walk.INPUT_OPS | graph_walk.ITERATOR_READ_OPS | graph_walk.ITERATOR_OPS
          | graph_walk.FEEDABLE_ITERATOR_OPS | graph_walk.VARIABLE_OPS | {"ReadVariableOp"})


def _own_op_sets(path: str) -> list:
    """(line, the owned op types) of each set, tuple or list literal in the file naming one."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            named = sorted(e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in _OWNED)
            if named:
                found.append((node.lineno, named))
    return found


def test_no_other_module_keeps_its_own_op_type_set():
    """The rule: in parallax_tf/ and rewriters/, only graph_walk.py writes a set, tuple or list of
    op types naming an input (placeholder, tf.data read), an iterator, a variable or a variable
    read; every other module uses graph_walk's named sets (a set of its own may extend one), so
    that two copies cannot disagree. (parallax_tf/compat's tables name TensorFlow's classes, such
    as iterator_ops.Iterator, not op types: not scanned.)"""
    owner = os.path.join(ROOT, "parallax_tf", "graph_walk.py")
    shims = os.path.join(ROOT, "parallax_tf", "compat")
    offenders, scanned = [], 0
    for package in ("parallax_tf", "rewriters"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path == owner or folder == shims:
                    continue
                scanned += 1
                offenders += [f"{os.path.relpath(path, ROOT)}:{line}: {named}" for line, named in _own_op_sets(path)]
    assert not offenders, "op-type sets outside parallax_tf/graph_walk.py:\n" + "\n".join(offenders)
    assert scanned > 40 and len(_own_op_sets(owner)) >= 5     # the scan sees the files and the literals
