"""Adding a strategy is one class and one registry call, outside the toolkit: tests/toy_strategy.py's
(every variable on AllReduce; tables split between the PS and alltoall, through the shared
synchronous pipeline) train on 2 real ranks exactly as single-device TF, and no file of
parallax_tf/ or rewriters/ knows them."""
import os
import tempfile

import numpy as np

from tests import cases, launch, reference, toy_strategy

CASES = ("mixed_momentum", "sparse_only")      # dense and sparse gradients; Adam on the sparse one


def _trained_exactly(strategy: str, names) -> dict:
    """Trains each case on 2 ranks with `strategy`; checks every variable against single-device
    TF; returns each case's plan table."""
    out = tempfile.mkdtemp(prefix="ptf-toy-")
    proc = launch.run_ranks(2, ["tests/jobs/toy_strategy_job.py", out, strategy, *names])
    assert proc.returncode == 0, launch.tail(proc)
    tables = {}
    for name in names:
        _, model, optimizer, _ = cases.CASE_BY_NAME[name]
        want = reference.train_single_device(model, optimizer, 2)
        ranks = [np.load(os.path.join(out, f"{name}.rank{r}.npz")) for r in range(2)]
        tolerance = 1e-4 if optimizer.endswith("adam") else 1e-5
        assert sorted(k[4:] for k in ranks[0].files if k.startswith("var:")) == sorted(want)
        for var_name, value in want.items():
            error = reference.relative_error(ranks[0][f"var:{var_name}"], value)
            assert error <= tolerance, f"{name}/{var_name}: relative error {error:.2e} > {tolerance}"
            np.testing.assert_array_equal(ranks[1][f"var:{var_name}"], ranks[0][f"var:{var_name}"])
        assert all(int(r["global_step"]) == cases.STEPS for r in ranks)
        tables[name] = str(ranks[0]["table"])
    return tables


def test_a_strategy_registered_from_tests_trains_exactly():
    for table in _trained_exactly(toy_strategy.NAME, CASES).values():
        assert f"strategy={toy_strategy.NAME}" in table and " ps " not in table


def test_tables_on_the_ps_and_on_alltoall_in_one_plan_train_exactly():
    for table in _trained_exactly(toy_strategy.SPLIT_NAME, [c[0] for c in cases.SPLIT_CASES]).values():
        routes = {line.split()[0]: line.split()[5] for line in table.splitlines()
                  if line.split() and line.split()[0] in ("emb", "emb_b")}
        assert routes == {"emb": "ps", "emb_b": "alltoall"}, table


def test_the_toolkit_does_not_know_the_toy_strategy():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    knowing = [os.path.join(folder, name) for package in ("parallax_tf", "rewriters")
               for folder, _, files in os.walk(os.path.join(root, package)) for name in files
               if name.endswith(".py") and "toy" in open(os.path.join(folder, name)).read().lower()]
    assert not knowing, f"toolkit files naming the toy strategy: {knowing}"
