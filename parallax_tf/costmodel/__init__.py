"""A cost model: predicted step time of a plan on a cluster, and the per-variable choice that
--strategy=auto makes with it. By concern:

- `cluster.py`: the cluster described (hosts, ranks, links, calibrated constants), link units;
- `traffic.py`: what a plan moves over each host's link, per variable and kind (ring AllReduce,
  allgather, PS, alltoall), and the graph runs a server host handles;
- `cpu.py`: a rank's CPU per step, term by calibrated term;
- `prediction.py`: how links, round trips, servers and CPU add up to a step;
- `selection.py`: auto's choice of route and shard count per variable, and the loads it weighs.

Callers import every name from here (`from parallax_tf import costmodel`)."""
from parallax_tf.costmodel.cluster import PORT_QUEUE_S, Cluster, parse_delay, parse_rate
from parallax_tf.costmodel.traffic import (EXCHANGE, GATHER, INDEX_BYTES, POINT, RING, Choice, Load,
                                           allgathered_bytes, host_traffic, received_bytes, runs_through_master,
                                           shard_hosts)
from parallax_tf.costmodel.cpu import CPU_TERMS, host_cpu_s, host_cpu_terms, received_cpu_s
from parallax_tf.costmodel.prediction import Prediction, predict
from parallax_tf.costmodel.selection import (CHOICE_MARGIN, REPLICA_MEMORY_SHARE, candidates, choose, loads_from,
                                             replica_bytes, table_load_name, table_loads)

__all__ = ["PORT_QUEUE_S", "Cluster", "parse_delay", "parse_rate", "EXCHANGE", "GATHER", "INDEX_BYTES", "POINT",
           "RING", "Choice", "Load", "allgathered_bytes", "host_traffic", "received_bytes", "runs_through_master",
           "shard_hosts", "CPU_TERMS", "host_cpu_s", "host_cpu_terms", "received_cpu_s", "Prediction", "predict",
           "CHOICE_MARGIN", "REPLICA_MEMORY_SHARE", "candidates", "choose", "loads_from", "replica_bytes", "table_load_name",
           "table_loads"]
