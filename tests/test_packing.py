"""A rank's lookups on one parameter server share one message each way per step: two tables
sharded over two servers, and TF's own partitioner (real servers, one process) makes rank 1
send each server one tensor of ids and one of summed rows, and get one tensor of rows back,
where it used to be one per table each way. (Equality with single-device training of sharded
tables packed this way: tests/test_equivalence.py.)"""
import collections
import json

from tests import launch


def test_lookups_on_one_server_share_one_message_each_way():
    proc = launch.run_ranks(1, ["tests/jobs/packing_job.py"], launcher="python", timeout=300)
    assert proc.returncode == 0, launch.tail(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pushes"] == 4                       # 2 tables x 2 shards, each into its accumulator
    kinds = collections.Counter((source, dest, dtype) for source, dest, dtype, _ in out["crossing"])
    worker = "/job:worker/task:1"
    expected = {}
    for server in ("/job:ps/task:0", "/job:ps/task:1"):
        expected[(worker, server, "int64")] = 1       # the distinct ids of both tables' lookups
        expected[(worker, server, "float32")] = 1     # both tables' summed rows: the push
        expected[(server, worker, "float32")] = 1     # both tables' rows: the pull
    assert dict(kinds) == expected, out["crossing"]
