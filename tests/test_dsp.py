"""DSP (--strategy dsp) on real ranks: K stages, one per rank, end with the same parameters as a
single-process reference of the tick rule (below, plain TF); K = 1 is ordinary training; the
planner balances measured compute; bad configurations get one message; a lost stage is named;
a checkpoint is taken with the pipeline drained and a resumed run continues exactly."""
import functools
import json
import os
import re
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf.errors import ConfigError
from parallax_tf.inspect_graph import capture
from parallax_tf.model import RunContext
from parallax_tf.plan import Plan
from parallax_tf.planner import PlanRequest, make_plan, measurements
from rewriters.dsp import cut as pipeline_cut
from tests import dsp_models, launch, reference as ref_lib

NAMES = ["mlp_sgd", "mlp_momentum", "cnn_momentum", "keras_mlp"]


CUTS = "--dsp_cuts=concat:0,hidden2/Tanh:0"     # the checkpoint tests' (the measured balance may vary)
# the runs that share one job per rank count: ranks -> {run: (names, flags, steps)}
SHARED = {
    2: {"stages": (NAMES, (), dsp_models.BATCHES)},
    3: {"stages": (NAMES, (), dsp_models.BATCHES),
        "locked": (("mlp_momentum", "cnn_momentum"), ("--dsp_schedule=locked",), dsp_models.BATCHES),
        "scaled": (("mlp_momentum",), ("--dsp_grad_scale=0.5",), dsp_models.BATCHES),
        "drained": (("mlp_sgd",), ("--ckpt_dir={ckpt}", "--ckpt_every=4", CUTS), 8),
        "whole": (("mlp_sgd",), ("--ckpt_dir={fresh}", "--ckpt_every=4", CUTS), 12)},
    4: {"stages": (NAMES, (), dsp_models.BATCHES),
        "pipelines": (("mlp_sgd", "mlp_momentum"), ("--stages=2", "--dsp_replicas=2"), dsp_models.BATCHES)},
}


@functools.lru_cache(maxsize=None)
def checkpoint_dir() -> str:
    """The drained run's checkpoints, which the resumed run continues from."""
    return tempfile.mkdtemp(prefix="ptf-dsp-ckpt-")


@functools.lru_cache(maxsize=None)
def shared_job(ranks: int) -> dict:
    """Runs every run of SHARED[ranks] in one job of `ranks` ranks; returns run -> its output dir."""
    outs = {run: tempfile.mkdtemp(prefix=f"ptf-dsp-{ranks}-{run}-") for run in SHARED[ranks]}
    return _job(ranks, {run: (outs[run], *spec) for run, spec in SHARED[ranks].items()})


def run_job(ranks: int, names: tuple, *flags: str, steps: int = dsp_models.BATCHES) -> str:
    """A job of its own for one run; returns its output dir."""
    out = tempfile.mkdtemp(prefix=f"ptf-dsp-{ranks}-")
    return _job(ranks, {"run": (out, names, flags, steps)})["run"]


def _job(ranks: int, runs: dict) -> dict:
    given = [{"out": out, "names": list(names), "steps": steps,
              "flags": [f.format(ckpt=checkpoint_dir(), fresh=tempfile.mkdtemp()) for f in flags]}
             for out, names, flags, steps in runs.values()]
    proc = launch.run_ranks(ranks, ["tests/jobs/dsp_job.py", f"--runs={json.dumps(given)}"])
    assert proc.returncode == 0, f"dsp job failed:\n{launch.tail(proc)}"
    return {run: spec[0] for run, spec in runs.items()}


def results(out: str, name: str, ranks: int):
    return [np.load(os.path.join(out, f"{name}.rank{r}.npz")) for r in range(ranks)]


# ---- the single-process reference of the rule -------------------------------------------
def reference(name: str, plan: Plan, steps: int = dsp_models.BATCHES, segment: int = 0):
    """Variables after `steps` batches under DSP's tick rule, in one process: at tick t stage k
    forwards batch t - k with its current variables and then updates with batch
    t - 2(K-1) + k, recomputing its forward on that batch's stored input; with several pipelines
    each stage averages its gradients on the pipelines' batches; the pipeline drains every
    `segment` batches (0: only at the end). Returns (variables, per pipeline the losses in batch
    order)."""
    model_fn, input_fn, kind_rate = dsp_models.MODELS[name]
    pipe = plan.section
    count, scale = len(pipe.stages), pipe.grad_scale
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        loss = model_fn().loss
        by_name = {v.op.name: v for v in tf.compat.v1.trainable_variables()}
        cuts = [graph.get_tensor_by_name(s.input) if s.input else None for s in pipe.stages]
        outputs = cuts[1:] + [loss]
        stages = []
        for k, stage in enumerate(pipe.stages):
            xs = [by_name[v] for v in stage.variables]
            dy = tf.compat.v1.placeholder(outputs[k].dtype, outputs[k].shape) if k < count - 1 else None
            grads = tf.gradients(outputs[k], xs + ([cuts[k]] if k else []), grad_ys=dy)
            fed = [(tf.compat.v1.placeholder(tf.float32, None), tf.compat.v1.placeholder(tf.int64, None))
                   if isinstance(g, tf.IndexedSlices) else tf.compat.v1.placeholder(g.dtype, g.shape)
                   for g in grads[:len(xs)]]
            pairs = [(tf.IndexedSlices(f[0], f[1], tf.constant(x.shape.as_list(), tf.int64)) if isinstance(f, tuple)
                      else f, x) for f, x in zip(fed, xs)]
            apply = dsp_models.optimizer(kind_rate).apply_gradients(pairs)
            stages.append((xs, dy, grads, fed, apply))
        init = tf.compat.v1.global_variables_initializer()
    pipelines = pipe.replicas
    feeds_of = lambda b, p: {graph.get_tensor_by_name(k + ":0"): v
                             for k, v in input_fn(RunContext(rank=p, size=pipelines, step=b)).items()}
    losses = {}
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)

        def update(k, feeds_per_pipeline):
            """The stage's gradient on each pipeline's batch, averaged over pipelines and applied;
            per pipeline (input gradient, loss)."""
            xs, dy, grads, fed, apply = stages[k]
            got = [sess.run(grads + ([loss] if k == count - 1 else [tf.constant(0.0)]), f) for f in feeds_per_pipeline]
            factor = (scale if k < count - 1 else 1.0) / pipelines
            apply_feeds = {}
            for i, f in enumerate(fed):
                if isinstance(f, tuple):
                    apply_feeds.update({f[0]: np.concatenate([g[i].values for g in got]) * factor,
                                        f[1]: np.concatenate([g[i].indices for g in got])})
                else:
                    apply_feeds[f] = sum(g[i] for g in got) * factor
            sess.run(apply, apply_feeds)
            return [(g[len(xs)] if k else None, g[-1]) for g in got]

        bounds = list(range(0, steps, segment or steps)) + [steps]
        for first, end in zip(bounds, bounds[1:]):
            arrived, gradient, stored = {}, {}, {}
            for t in range(end - first + 2 * (count - 1)):
                for k in range(count):
                    batch = first + t - k
                    if first <= batch < end:
                        all_feeds = []
                        for p in range(pipelines):
                            feeds = feeds_of(batch, p)
                            if k:
                                feeds[cuts[k]] = arrived.pop((k, batch, p))
                            if k < count - 1:
                                arrived[(k + 1, batch, p)] = sess.run(outputs[k], feeds)
                                stored[(k, batch, p)] = feeds
                            all_feeds.append(feeds)
                        if k == count - 1:
                            for p, (dx, batch_loss) in enumerate(update(k, all_feeds)):
                                losses[(batch, p)] = batch_loss
                                if k:
                                    gradient[(k - 1, batch, p)] = (dx, batch_loss)
                    late = first + t - k - 2 * (count - 1 - k)
                    if k < count - 1 and first <= late < end:
                        all_feeds = []
                        for p in range(pipelines):
                            feeds = stored.pop((k, late, p))
                            feeds[stages[k][1]] = gradient[(k, late, p)][0]
                            all_feeds.append(feeds)
                        for p, (dx, _) in enumerate(update(k, all_feeds)):
                            batch_loss = gradient.pop((k, late, p))[1]
                            if k:
                                gradient[(k - 1, late, p)] = (dx, batch_loss)
            assert not arrived and not gradient and not stored
        values = sess.run({n: v for n, v in by_name.items()})
    return values, {p: [losses[(b, p)] for b in range(steps)] for p in range(pipelines)}


def check_against_reference(out: str, name: str, ranks: int, steps: int = dsp_models.BATCHES, segment: int = 0):
    got = results(out, name, ranks)
    plan = Plan.from_json(str(got[0]["plan"]))
    assert len(plan.section.stages) * plan.section.replicas == ranks
    want, want_losses = reference(name, plan, steps, segment)
    for var, value in want.items():
        error = ref_lib.relative_error(got[0][f"var:{var}"], value)
        assert error <= 1e-5, (name, var, error)
        for other in got[1:]:               # every stage hands back the same whole values
            np.testing.assert_array_equal(other[f"var:{var}"], got[0][f"var:{var}"])
    for rank, r in enumerate(got):          # each stage saw its pipeline's losses, in batch order
        np.testing.assert_allclose(r["losses"], want_losses[plan.section.pipeline_of(rank)], rtol=1e-5)
        assert int(r["global_step"]) == steps
    return got, want


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", NAMES)
def test_stages_end_where_the_reference_does(stages, name):
    out = shared_job(stages)["stages"]
    got, want = check_against_reference(out, name, stages)
    # staleness matters: the result differs from plain synchronous training on the same batches
    plain, _ = reference(name, dataclass_single_stage(Plan.from_json(str(got[0]["plan"]))))
    assert max(ref_lib.relative_error(want[v], plain[v]) for v in want) > 1e-4


def dataclass_single_stage(plan: Plan) -> Plan:
    """The plan with one stage holding every variable: ordinary training."""
    from rewriters.dsp.pipeline import Pipeline, Stage
    everything = sorted(v for s in plan.section.stages for v in s.variables)
    plan.section = Pipeline([Stage(0, [0], everything, 1.0)], 1, plan.section.grad_scale)
    return plan


def test_one_stage_is_ordinary_training():
    out = run_job(1, ("mlp_momentum",))
    got = results(out, "mlp_momentum", 1)[0]
    model_fn, input_fn, _ = dsp_models.MODELS["mlp_momentum"]
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        model = model_fn()
        step = model.optimizer.minimize(model.loss)
        graph = tf.compat.v1.get_default_graph()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for b in range(dsp_models.BATCHES):
                sess.run(step, {graph.get_tensor_by_name(k + ":0"): v for k, v in input_fn(RunContext(step=b)).items()})
            want = sess.run({v.op.name: v for v in tf.compat.v1.trainable_variables()})
    for var, value in want.items():
        assert ref_lib.relative_error(got[f"var:{var}"], value) <= 1e-5, var


@pytest.mark.parametrize("name", ["mlp_sgd", "mlp_momentum"])
def test_two_pipelines_average_each_stages_gradients(name):
    out = shared_job(4)["pipelines"]
    check_against_reference(out, name, 4)


def test_locked_schedule_is_plain_backprop():
    out = shared_job(3)["locked"]
    for name in ("mlp_momentum", "cnn_momentum"):
        got = results(out, name, 3)
        want, losses = reference(name, dataclass_single_stage(Plan.from_json(str(got[0]["plan"]))))
        for var, value in want.items():
            assert ref_lib.relative_error(got[2][f"var:{var}"], value) <= 1e-5, (name, var)
        np.testing.assert_allclose(got[0]["losses"], losses[0], rtol=1e-5)


def test_gradient_scale_on_stale_stages():
    out = shared_job(3)["scaled"]
    check_against_reference(out, "mlp_momentum", 3)


def test_a_checkpoint_drains_the_pipeline_and_resume_continues_exactly():
    first, whole = shared_job(3)["drained"], shared_job(3)["whole"]
    resumed = run_job(3, ("mlp_sgd",), f"--ckpt_dir={checkpoint_dir()}", "--ckpt_every=4", CUTS, steps=12)
    assert int(results(resumed, "mlp_sgd", 3)[0]["start_step"]) == 8
    assert int(results(first, "mlp_sgd", 3)[0]["global_step"]) == 8
    got, _ = check_against_reference(whole, "mlp_sgd", 3, steps=12, segment=4)
    for r in results(resumed, "mlp_sgd", 3):
        for key in got[0].files:
            if key.startswith("var:"):
                np.testing.assert_allclose(r[key], got[0][key], rtol=1e-6, atol=1e-7)


def test_a_killed_stage_restarts_from_the_drained_checkpoint_and_ends_exactly():
    """Stage 1 dies at batch 6 under --max_restarts: every stage restarts from step 4's
    checkpoint (the pipeline drained there) and the job ends as the reference that drains every
    4 batches."""
    ckpt, out = tempfile.mkdtemp(prefix="ptf-dsp-ckpt-"), tempfile.mkdtemp(prefix="ptf-dsp-restart-")
    proc = launch.run_ranks(1, ["tests/jobs/dsp_job.py", out, "mlp_sgd", "--np=3", "--die=1:6", f"--ckpt_dir={ckpt}",
                                "--ckpt_every=4", "--dsp_cuts=concat:0,hidden2/Tanh:0", "--max_restarts=1"],
                            launcher="python", env={"DSP_JOB_STEPS": "12"}, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert "1 restart(s): rank 1 exited with status 137, resumed at step 4" in output, launch.tail(proc)
    got = results(out, "mlp_sgd", 3)
    want, _ = reference("mlp_sgd", Plan.from_json(str(got[0]["plan"])), 12, segment=4)
    for r in got:
        assert int(r["global_step"]) == 12 and int(r["start_step"]) == 4
        for var, value in want.items():
            assert ref_lib.relative_error(r[f"var:{var}"], value) <= 1e-5, var


def test_a_killed_stage_is_named():
    out = tempfile.mkdtemp(prefix="ptf-dsp-kill-")
    proc = launch.run_ranks(3, ["tests/jobs/dsp_job.py", out, "mlp_sgd", "--die=1:5", "--timeout_s=30"],
                            env={"DSP_JOB_STEPS": "400"})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"parallax_tf rank [02]: .*lost: rank 1 \(", output), launch.tail(proc)


# ---- the planner ----------------------------------------------------------------------------
def _layer(x, name: str, units: int, activation=tf.tanh):
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable("kernel", [int(x.shape[-1]), units],
                                           initializer=tf.compat.v1.glorot_uniform_initializer(seed=len(name)))
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.compat.v1.zeros_initializer())
        y = tf.nn.bias_add(tf.matmul(x, kernel), bias)
        return activation(y) if activation else y


def _capture(model_fn, input_fn):
    return capture(model_fn, input_fn, RunContext(), 0, **measurements("dsp"))


def _uneven():
    """An MLP whose second hidden layer holds almost all the compute (1024 x 1024)."""
    from models import mlp
    import parallax_tf as ptf

    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None, 8], name="features")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="labels")
        for i, units in enumerate([32, 1024, 32, 8]):
            x = _layer(x, f"layer{i}", units)
        out = _layer(x, "out", 1, activation=None)
        loss = tf.reduce_mean(tf.square(tf.squeeze(out, 1) - y))
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    return model_fn, mlp.make_input_fn(features=8, vocab=0, batch=256)


def test_planner_balances_measured_compute():
    import itertools
    captured = _capture(*_uneven())
    plan = make_plan(PlanRequest(captured, "dsp", 3, 1, options={"stages": 3}))
    stages = [set(s.variables) for s in plan.section.stages]
    # the two big layers (32x1024 and 1024x32) are never in one stage
    assert not any({"layer1/kernel", "layer2/kernel"} <= s for s in stages), stages
    # no other pair of nested cuts has a faster slowest stage (the same measurements)
    points = captured.measured["pipeline"].points
    chosen = [p for p in points if p.name in {s.input for s in plan.section.stages}]
    best = min(max(pipeline_cut.stage_costs(captured.measured["pipeline"], [a, b])) for a, b in itertools.combinations(points, 2)
               if set(a.below_ops) < set(b.below_ops) and set(b.variables) - set(a.variables)
               and set(captured.measured["pipeline"].variables) - set(b.variables))
    assert max(pipeline_cut.stage_costs(captured.measured["pipeline"], chosen)) <= best * pipeline_cut.BALANCE_SLACK + 1e-12
    assert "stage 1 on rank(s) [1]" in plan.table()


def test_balanced_prefers_fewer_bytes_among_balanced_cuts():
    points = [pipeline_cut.CutPoint(n, [b // 4], "float32", b, ops, vs, f, 2 * f) for n, b, ops, vs, f in [
        ("wide:0", 4000, ["a"], ["v1"], 1.0), ("narrow:0", 40, ["a", "b"], ["v1"], 1.02),
        ("late:0", 40, ["a", "b", "c"], ["v1", "v2"], 3.0)]]
    cuts = pipeline_cut.PipelineCuts(points, ["v1", "v2"], 2.0, 4.0, {})
    assert [p.name for p in pipeline_cut.balanced(cuts, 2)] == ["narrow:0"]
    with pytest.raises(ValueError, match="at most 2 stage"):
        pipeline_cut.balanced(cuts, 3)


def test_more_stages_than_layers_is_refused():
    from models import mlp
    captured = _capture(mlp.make_model_fn(depth=1, vocab=0), mlp.make_input_fn(vocab=0))
    with pytest.raises(ConfigError, match=r"--stages=4: the model can be cut into at most 2 stage\(s\)"):
        make_plan(PlanRequest(captured, "dsp", 4, 1, options={"stages": 4}))


def test_stages_times_replicas_must_be_the_ranks():
    from models import mlp
    captured = _capture(mlp.make_model_fn(depth=3, vocab=0), mlp.make_input_fn(vocab=0))
    with pytest.raises(ConfigError, match=r"--stages=3 x --dsp_replicas=2 = 6 rank\(s\), but the job has 4"):
        make_plan(PlanRequest(captured, "dsp", 4, 1, options={"stages": 3, "replicas": 2}))


def test_named_cuts_must_separate_the_graph():
    from models import mlp
    captured = _capture(mlp.make_model_fn(depth=3, vocab=0), mlp.make_input_fn(vocab=0))
    with pytest.raises(ConfigError, match=r"'labels:0' cannot begin a stage: it is not an activation"):
        make_plan(PlanRequest(captured, "dsp", 2, 1, options={"cuts": ["labels"]}))
    with pytest.raises(ConfigError, match=r"does not come after 'hidden2/Tanh:0'"):
        make_plan(PlanRequest(captured, "dsp", 3, 1, options={"cuts": ["hidden2/Tanh", "hidden/Tanh"]}))
    plan = make_plan(PlanRequest(captured, "dsp", 2, 1, options={"cuts": ["hidden2/Tanh:0"]}))
    assert plan.section.stages[1].input == "hidden2/Tanh:0"
    assert plan.section.stages[1].variables == ["hidden3/bias", "hidden3/kernel", "out/bias", "out/kernel"]
    assert Plan.from_json(plan.to_json()) == plan       # the pipeline travels with the plan


def test_a_skip_connection_is_not_a_cut():
    import parallax_tf as ptf

    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="features")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="labels")
        h = _layer(x, "a", 4)
        g = _layer(h, "b", 4)
        out = _layer(g + h, "out", 1, activation=None)        # h skips b
        return ptf.Model(loss=tf.reduce_mean(tf.square(tf.squeeze(out, 1) - y)),
                         optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    from models import mlp
    captured = _capture(model_fn, mlp.make_input_fn(vocab=0))
    with pytest.raises(ConfigError, match=r"'b/Tanh:0' cannot begin a stage: .*also reads 'a/Tanh:0'.*skip connection"):
        make_plan(PlanRequest(captured, "dsp", 2, 1, options={"cuts": ["b/Tanh"]}))


def test_the_tick_schedule_is_data_a_test_can_walk():
    """Stage k forwards batch t - k and updates with batch t - 2(K-1) + k (the table in
    rewriters/dsp/schedule.py); every batch is forwarded and updated once per stage, and a
    stage's update of a batch follows its forward by 2(K-1-k) ticks (its staleness)."""
    from rewriters.dsp.schedule import segments, ticks
    stages, batches = 3, 3
    table = [list(ticks(k, stages, 0, batches)) for k in range(stages)]
    assert table[0] == [(0, None), (1, None), (2, None), (None, None), (None, 0), (None, 1), (None, 2)]
    assert table[2][2:5] == [(0, 0), (1, 1), (2, 2)]
    for k, row in enumerate(table):
        forwards = {b: t for t, (f, _) in enumerate(row) for b in [f] if b is not None}
        updates = {b: t for t, (_, u) in enumerate(row) for b in [u] if b is not None}
        assert sorted(forwards) == sorted(updates) == list(range(batches))
        assert all(updates[b] - forwards[b] == 2 * (stages - 1 - k) for b in range(batches))
    assert list(ticks(1, stages, 4, 6, locked=True)) == [(4, 4), (5, 5)]

    class SavesAt:
        def saves_at(self, step):
            return step % 4 == 0
    assert segments(1, 10, [SavesAt()]) == [(1, 4), (4, 8), (8, 10)]
