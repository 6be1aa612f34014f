"""A lookup of a PS variable moves each distinct row once: 64 ids per batch, 4 distinct, cost
rank 1 (whose PS lives in rank 0's process) the bytes of 4 rows to pull and 4 rows + ids to push,
not 64 rows. (Equality with single-device training: tests/test_equivalence.py.)"""
import json
import os
import tempfile

from tests import launch
from tests.jobs import pull_bytes_job as job


def test_pulls_and_pushes_move_distinct_rows():
    out = tempfile.mkdtemp(prefix="ptf-pulls-")
    proc = launch.run_ranks(2, ["tests/jobs/pull_bytes_job.py", out])
    assert proc.returncode == 0, launch.tail(proc)
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    assert ranks[0]["routes"]["emb"] == "ps"
    row = job.DIM * 4
    assert ranks[1]["bytes"]["ps_pull"] == job.DISTINCT * row           # 256 B, not 64 ids x 64 B
    assert ranks[1]["bytes"]["ps_push"] == job.DISTINCT * (row + 8)     # rows + int64 ids
    assert ranks[0]["bytes"]["ps_pull"] == 0 and ranks[0]["bytes"]["ps_push"] == 0   # its own server
