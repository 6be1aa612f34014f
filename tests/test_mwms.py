"""The tf_mwms baseline (tools/baselines_mwms.py): TF's MultiWorkerMirroredStrategy on 2 emulated
hosts, as tools.bench runs it, on tiny forms of the lm and recsys reference models."""
import json
import os
import sys
import tempfile

import numpy as np

from tests import launch
from tools import netns

STEPS, WARMUP = 5, 1
TINY = {"recsys": dict(user_buckets=500, item_buckets=200, buckets=50, hidden=[16, 8], ftrl_rate=0.3,
                       learning_rate=0.1),
        "lm": dict(vocab=500, dim=16, hidden=16, num_steps=4, num_sampled=16, learning_rate=0.5)}
BATCH = {"recsys": 16, "lm": 8}


def _flags(model: str) -> list:
    sizes = dict(TINY[model], batch=BATCH[model])
    return [f"--{model}_{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in sizes.items()]


def _train(model: str) -> list:
    """Each rank's figures from one tools.bench_job run of tf_mwms on 2 emulated hosts."""
    out = tempfile.mkdtemp()
    job = [sys.executable, "-m", "tools.bench_job", f"--model={model}", "--bench_strategy=tf_mwms",
           f"--steps={STEPS}", f"--warmup={WARMUP}", f"--out={out}", "--log_every=0", *_flags(model)]
    proc = launch.on_emulated_hosts(job, timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["rank0.json", "rank1.json"]           # every rank wrote its figures
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    for record in ranks:
        assert record["step_s"] > 0 and record["cpu_s_per_step"] > 0
        assert record["examples_per_step"] == 2 * BATCH[model]              # the global batch
        assert len(record["losses"]) == STEPS + WARMUP and np.all(np.isfinite(record["losses"]))
        if netns.have_root():         # the host's link carried the collectives
            assert record["link_bytes_per_step"]["tx"] > 0
    assert ranks[0]["losses"] == ranks[1]["losses"]                            # the global batch's loss
    return ranks


def test_tf_mwms_recsys_equals_one_device_over_the_global_batch():
    from models import recsys
    from tools import baselines_mwms, bench
    ranks = _train("recsys")
    sizes = {k: v for k, v in TINY["recsys"].items() if k in ("user_buckets", "item_buckets", "buckets")}
    input_fn = recsys.make_input_fn(batch=BATCH["recsys"], seed=0, **sizes)
    expected = baselines_mwms.one_device_losses("recsys", TINY["recsys"], input_fn, STEPS + WARMUP, ranks=2)
    np.testing.assert_allclose(ranks[0]["losses"], expected, rtol=2e-5)
    assert expected[-1] != expected[0]          # it trained: the optimizers' applies changed the loss
    # tools.bench shows it as one more row, and as a baseline the others are compared to
    table = bench.table({"tf_mwms": bench.summarise(ranks)})
    assert table.splitlines()[0].split()[-2:] == ["vs", "tf_mwms"]
    assert table.splitlines()[1].split()[0] == "tf_mwms" and table.splitlines()[1].endswith("1.00x")


def test_tf_mwms_lm_trains():
    losses = _train("lm")[0]["losses"]
    assert np.mean(losses[-2:]) < losses[0] - 0.05, losses
