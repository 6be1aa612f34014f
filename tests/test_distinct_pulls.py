"""A lookup of a PS variable moves each distinct row once: 64 ids per batch, 4 distinct, cost
rank 1 (whose PS lives in rank 0's process) the bytes of 4 rows to pull and 4 rows + ids to push,
not 64 rows. (Equality with single-device training: tests/test_equivalence.py.)"""
import json
import os
import sys
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


def test_the_links_carry_distinct_rows_only():
    """Two emulated hosts, rows of 4 KB: host 1's link receives per step the 4 distinct rows it
    pulls (16 KB) plus its share of the dense AllReduce and the protocols' own bytes, not the
    64 looked-up rows (256 KB) a gather of every id would bring."""
    from tests.test_rig import _run
    from tools import netns
    out = tempfile.mkdtemp(prefix="ptf-pull-links-")
    proc = _run(["tools.cluster", "--hosts=2", "--", sys.executable, "tests/jobs/pull_bytes_job.py", out],
                env={"PULL_DIM": "1024", "PULL_STEPS": "10"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not netns.have_root():          # the documented fallback: loopback, said plainly
        assert "emulated hosts need root" in proc.stderr
        return
    host1 = json.load(open(os.path.join(out, "rank1.json")))
    row = 1024 * 4
    assert host1["bytes"]["ps_pull"] == job.DISTINCT * row
    received = host1["link_bytes"]["rx"] / host1["steps"]
    assert job.DISTINCT * row <= received <= 3 * job.DISTINCT * row, received      # 16 KB .. 48 KB, not 256 KB
    sent = host1["link_bytes"]["tx"] / host1["steps"]
    assert job.DISTINCT * (row + 8) <= sent <= 3 * job.DISTINCT * row, sent
