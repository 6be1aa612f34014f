"""Builds rank 1's hybrid graph of a model with two tables, each sharded over two servers, and
runs its lookups and pushes once on real TF servers in this process (a worker and a PS task per
host); prints, as JSON, the tensors TF's partitioner made cross between tasks in that run:
[[from task, to task, dtype, tensor name], ...]. (Rank 0's token is not needed for that.)"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tensorflow as tf  # noqa: E402

VOCAB, DIM = 100, 8


def model_fn(ctx=None):
    words = tf.compat.v1.placeholder(tf.int64, [None], name="words")
    tags = tf.compat.v1.placeholder(tf.int64, [None], name="tags")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    tables = [tf.compat.v1.get_variable(name, [VOCAB, DIM], initializer=tf.compat.v1.random_normal_initializer(seed=i))
              for i, name in enumerate(("words_emb", "tags_emb"))]
    features = tf.concat([tf.nn.embedding_lookup(t, ids) for t, ids in zip(tables, (words, tags))], 1)
    w = tf.compat.v1.get_variable("w", [2 * DIM, 3])
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.matmul(features, w)))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.AdagradOptimizer(0.1))


def input_fn(ctx):
    rng = np.random.RandomState(ctx.rank)
    return {"words": rng.randint(0, VOCAB, 16), "tags": rng.randint(0, VOCAB, 16), "labels": rng.randint(0, 3, 16)}


def main():
    import horovod.tensorflow as hvd
    from parallax_tf.inspect_graph import capture
    from parallax_tf.model import RunContext
    from parallax_tf.planner import PlanRequest, make_plan
    from parallax_tf.runtime import cluster as cluster_lib
    from parallax_tf import strategy
    from parallax_tf.runtime.topology import Topology
    hvd.init()        # one process: the graph's allreduce is built, never run here
    ports = cluster_lib.free_ports("localhost", 4, None)
    spec = {"worker": [f"localhost:{p}" for p in ports[:2]], "ps": [f"localhost:{p}" for p in ports[2:]]}
    servers = [tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=i, start=True)
               for job in ("worker", "ps") for i in range(2)]
    ctx = RunContext(1, 2, 0, 1, 0)
    plan = make_plan(PlanRequest(capture(model_fn, input_fn, ctx, 1), "hybrid", 2, 2, partitions=2))
    topo = Topology(rank=1, size=2, local_rank=0, local_size=1, host=1, ranks_per_host=[1, 1])
    graph = tf.Graph()
    with graph.as_default(), tf.device(topo.worker_device):
        dgraph = strategy.get("hybrid").rewrite(strategy.BuildRequest(model_fn, ctx, plan, topo, 1))
        pushes = [op for op in dgraph.train_op if op.type == "SparseAccumulatorApplyGradient"]   # step targets
    with tf.compat.v1.Session(servers[1].target, graph=graph) as sess:
        sess.run(dgraph.local_init)
        sess.run(dgraph.chief_init)
        feeds = {graph.get_tensor_by_name(f"{k}:0"): v for k, v in input_fn(ctx).items()}
        metadata = tf.compat.v1.RunMetadata()
        sess.run([dgraph.loss] + pushes, feeds, options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                 run_metadata=metadata)
    crossing = []
    for partition in metadata.partition_graphs:
        for node in partition.node:
            if node.op == "_Recv":
                source, dest = (node.attr[k].s.decode().split("/device")[0].replace("/replica:0", "")
                                for k in ("send_device", "recv_device"))
                if source != dest:
                    crossing.append([source, dest, tf.dtypes.as_dtype(node.attr["tensor_type"].type).name,
                                     node.attr["tensor_name"].s.decode()])
    print(json.dumps({"pushes": len(pushes), "crossing": crossing}))


if __name__ == "__main__":
    main()
