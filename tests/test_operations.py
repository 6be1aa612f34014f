"""Watching and stopping a run: NaN stop, TensorBoard, traces, progress, launch failures."""
import glob
import io
import json
import os
import re
import socket
import subprocess
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf.runtime.hooks import Progress, StepStats
from tests import launch


def test_nan_loss_stops_every_rank_and_keeps_the_last_good_checkpoint():
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    proc = launch.run_ranks(2, ["tests/jobs/train_case.py", "--case=sparse_only", f"--out={out}", "--steps=10",
                                "--log_every=0", "--nan_at_step=3", f"--ckpt_dir={ckpt}", "--ckpt_every=2"],
                            timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # rank 1 fed the NaN into step 4 (1-based, as the progress line counts); the mean over ranks
    # makes both ranks stop at that step, each with one line
    assert output.count("parallax_tf: error: the loss (mean over ranks) is nan at step 4;") == 2, launch.tail(proc)
    assert not re.search(r"^\[\d\]<stderr>:Traceback", output, re.M), launch.tail(proc)   # (horovodrun's own may follow)
    assert sorted(os.listdir(ckpt)) == ["checkpoint", "step-2"]
    reader = tf.train.load_checkpoint(os.path.join(ckpt, "step-2", "model"))
    assert np.isfinite(reader.get_tensor("emb")).all() and reader.get_tensor("parallax_global_step") == 2


def test_tensorboard_events_and_timelines():
    logdir, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    trace = os.path.join(out, "trace.json")
    proc = launch.run_ranks(2, ["tests/jobs/train_case.py", "--case=mixed_adam", f"--out={out}", "--steps=6",
                                "--log_every=0", f"--logdir={logdir}", f"--timeline_file={trace}",
                                "--timeline_steps=3,4", "--measure_every=2"], timeout=180)
    assert proc.returncode == 0, launch.tail(proc)
    scalars = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4, 5, 6]
    for tag in ("examples_per_second", "step_seconds"):
        assert len(scalars[tag]) == 6 and all(v > 0 for _, v in scalars[tag]), tag
    # bytes are counted in the first step and every --measure_every after it (steps 0, 2, 4)
    assert [s for s, v in scalars["bytes_per_step/allreduce"] if v > 0] == [1, 3, 5], scalars["bytes_per_step/allreduce"]
    # rank 0 serves this host's PS shards in its own process: its PS traffic crosses no process
    for tag in ("bytes_per_step/ps_push", "bytes_per_step/ps_pull"):
        assert [v for _, v in scalars[tag]] == [0.0] * 3, tag
    # ...while the cluster's, summed over ranks in the next step's report, show rank 1's pulls
    pulls = scalars["cluster_bytes_per_step/ps_pull"]
    assert [s for s, _ in pulls] == [2, 4, 6] and all(v > 0 for _, v in pulls), pulls
    losses = np.load(os.path.join(out, "mixed_adam.rank0.npz"))["losses"]
    assert abs(scalars["loss"][0][1] - losses[0]) < 5    # a mean over ranks, near rank 0's own
    events = json.load(open(trace))["traceEvents"]
    assert {e["args"]["step"] for e in events if "args" in e} == {3, 4}
    assert any("MatMul" in e.get("name", "") or "MatMul" in json.dumps(e.get("args", {})) for e in events)
    horovod = open(trace + ".horovod.json").read()
    assert "ALLREDUCE" in horovod or "NEGOTIATE_ALLREDUCE" in horovod


def test_progress_draws_a_bar_on_a_terminal_and_lines_otherwise():
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    stats = StepStats()
    for _ in range(3):     # rank 0's own bytes, and the whole cluster's from the step's report
        stats.add(0.5, {"ps_push": 2048}, examples=8, cluster_moved={"ps_push": 4096, "allreduce": 0})
    term, plain = Terminal(), io.StringIO()
    for stream in (term, plain):
        ends = iter([10.0, 10.5, 11.0])    # each step ends 0.5 s after the one before
        progress = Progress(total=4, every=2, ranks=2, stream=stream, clock=lambda: next(ends))
        for step in (1, 2, 3):
            progress.after_step(step, 1.25, stats)
    assert plain.getvalue().splitlines() == [     # per rank, as the plan estimates it
        "step 2/4 loss 1.2500 16 ex/s step 500.0ms eta 1.0s bytes/step/rank ps_push=2.0KB"]
    assert "\r\x1b[2K[#######" in term.getvalue() and "step 3/4 loss 1.2500" in term.getvalue()


_SLOW_INPUT_JOB = """
import time
import numpy as np
import parallax_tf as ptf
import tensorflow as tf


def model_fn():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
    w = tf.compat.v1.get_variable("w", [2, 1])
    return ptf.Model(loss=tf.reduce_mean(tf.matmul(x, w)), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


def slow_input(ctx):
    time.sleep(0.08)
    return {"x": np.ones([16, 2], np.float32)}


ptf.run(model_fn, slow_input, steps=25, log_every=5)
"""


def test_progress_summary_and_eta_agree_on_a_job_with_slow_input():
    """examples/s on the progress line covers the whole step the script waits for (here mostly a
    slow input_fn), as the summary's does, and the ETA follows it."""
    from tests.test_surface import _run
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "slow_input.py")
        with open(path, "w") as f:
            f.write(_SLOW_INPUT_JOB)
        proc = _run([path])
    assert proc.returncode == 0, launch.tail(proc)
    progress = {int(m.group(1)): (float(m.group(2).replace(",", "")), float(m.group(3)))
                for m in re.finditer(r"^step (\d+)/25 .* ([\d,]+) ex/s step [\d.]+ms eta ([\d.]+)s", proc.stdout, re.M)}
    summary = float(re.search(r"^done: .* ([\d,.]+) examples/s", proc.stdout, re.M).group(1).replace(",", ""))
    assert sorted(progress) == [5, 10, 15, 20, 25], proc.stdout
    assert summary < 16 / 0.08         # the input's sleep bounds what was done
    for step, (rate, eta) in progress.items():
        # step 5's window is the steps right after start-up, whose first runs are slower than the
        # run's mean; a rate of the session alone would be ~20x the summary's
        within = 0.25 if step == 5 else 0.1
        assert rate == pytest.approx(summary, rel=within), (step, rate, summary)
        assert eta == pytest.approx((25 - step) * 16 / summary, rel=within, abs=0.05), (step, eta)


def test_busy_port_range_is_named():
    held = []
    try:
        first = None
        while first is None:     # 16 consecutive free ports, all held by this test
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                start = probe.getsockname()[1]
            if start + 16 >= 65535:
                continue
            try:
                for port in range(start, start + 16):
                    s = socket.socket()
                    s.bind(("127.0.0.1", port))
                    held.append(s)
                first = start
            except OSError:
                for s in held:
                    s.close()
                held = []
        proc = launch.run_ranks(1, ["tests/jobs/train_case.py", f"--port={first}", "--steps=1"],
                                launcher="python", timeout=120)
    finally:
        for s in held:
            s.close()
    assert proc.returncode != 0
    assert f"in {first}..{first + 15} (from --port={first}); pass another --port" in proc.stderr


def test_horovod_not_built_is_named():
    shadow = tempfile.mkdtemp()
    os.makedirs(os.path.join(shadow, "horovod"))
    with open(os.path.join(shadow, "horovod", "__init__.py"), "w") as f:
        f.write("raise ImportError('horovod was not built here')\n")
    proc = launch.run_ranks(1, ["tests/jobs/train_case.py", "--steps=1"], launcher="python", timeout=120,
                            env={"PYTHONPATH": f"{shadow}:{launch.ROOT}"})
    assert proc.returncode != 0
    assert "Horovod's TensorFlow binding cannot be imported" in proc.stderr and "make setup" in proc.stderr


def _other_address():
    """A non-loopback IPv4 address of this host, if it has one."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return next((a for a in out if "." in a and not a.startswith("127.")), None)


def test_servers_listen_on_the_launcher_interface_only():
    other = _other_address()
    # no preload: each rank must re-execute itself with the shim, as under a plain horovodrun
    proc = launch.run_ranks(2, ["tests/jobs/listeners_job.py", other or "-"], timeout=180, preload=False)
    assert proc.returncode == 0, launch.tail(proc)
    # at `import parallax_tf`: TensorFlow is imported once per rank, after the re-execution
    assert re.findall(r"IMPORTS TENSORFLOW reexecuted=(\d)", proc.stdout) == ["1", "1"], launch.tail(proc)
    listens = re.findall(r"LISTEN rank=(\d) port=(\d+) local=(\S+)", proc.stdout)
    assert len(listens) == 3      # two workers and the tf_ps baseline's ps server on rank 0
    for _, port, local in listens:
        assert local in (f"127.0.0.1:{port}", f"[::ffff:127.0.0.1]:{port}"), local
    if other:                     # and nobody gets in through another interface
        assert len(re.findall(r"REFUSED rank=\d", proc.stdout)) == 3 and "REACHABLE" not in proc.stdout


def test_step_report_sums_byte_counts_exactly_even_in_float32():
    """The report rides in a float32 gradient allreduce when there is one: byte counts cross as
    base-2^16 pieces, so a sum over ranks stays exact past float32's 2^24."""
    from rewriters.shared.step_report import StepReport
    with tf.Graph().as_default():
        report = StepReport(tf.constant(0.75, tf.float64), 1)
        # what a float32 allreduce over 3 ranks with the same counts would hand back
        ridden = tf.cast(tf.cast(report.local, tf.float32) * 3, tf.float32)
        alone, summed = report.summed(), report.summed(ridden)
        counts = [5_000_000_123.0, 0.0, 16_777_217.0]
        with tf.compat.v1.Session() as sess:
            got_alone, got_summed = sess.run([alone, summed], {report.previous_bytes: counts,
                                                               report.checkpoint_request: 1.0})
    assert got_alone.tolist() == [0.75, 1.0] + counts
    assert got_summed.tolist() == [2.25, 3.0] + [3 * c for c in counts]


def test_a_lost_peer_is_named_with_the_cause_line_of_tf2s_error_message():
    """TF 2's message begins with "Graph execution error:" and where the op was defined; the
    one-line error names the cause, not that header."""
    from parallax_tf.runtime import session
    message = ("Graph execution error:\n\nDetected at node 'pull' defined at (most recent call last):\n"
               "    File \"train.py\", line 5, in <module>\nNode: 'pull'\nSocket closed\n\t [[{{node pull}}]]")
    with pytest.raises(session.PeerLost, match=r"^parallax_tf rank 2: reading: a server became unreachable "
                                               r"\(Socket closed\)$"):
        with session.cross_rank_errors("reading", timeout_s=0, rank=2):
            raise tf.errors.UnavailableError(None, None, message)
    with pytest.raises(session.PeerLost, match=r"unreachable \(connection refused\)$"):
        with session.cross_rank_errors("reading", timeout_s=0, rank=2):
            raise tf.errors.UnavailableError(None, None, "Graph execution error:\n\nconnection refused")


def test_a_rank_alone_runs_in_its_own_process_with_its_placements_dropped():
    """A graph placed on this rank's worker (a while loop's body in a function included) runs in
    a session of the process when nothing else is involved; with a PS it goes through the master."""
    from parallax_tf.runtime import session
    assert session.alone([], rank=0, size=1)
    assert not session.alone(["/job:ps"], rank=0, size=1)
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:worker/task:3"):
        weight = tf.compat.v1.get_variable("w", initializer=2.0, use_resource=True)
        _, total = tf.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * weight), [0, tf.constant(1.0)])
        grad = tf.gradients(total, weight)[0]
    graph.finalize()
    sess = session.open_session("grpc://unused:1", graph, rank=3, timeout_s=10, remote=[], in_process=True)
    sess.run(weight.initializer)
    assert sess.run([total, grad]) == [8.0, 12.0]      # w^3 and 3 w^2 at w = 2
    assert all(op.device == "" for op in graph.get_operations())


def test_ps_state_moves_onto_the_first_rank_of_its_host():
    """Rewriters place a host's PS state on /job:ps/task:<host>; the runtime moves it onto that
    host's first rank's worker (inside the graph's functions too), which is then the task the
    other ranks' sessions reach."""
    from parallax_tf.runtime import placement, session
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:ps/task:1"):
            table = tf.compat.v1.get_variable("table", [2], use_resource=True)

        @tf.function
        def doubled(x):
            with tf.device("/job:ps/task:1"):
                return x * 2.0
        with tf.device("/job:worker/task:0"):
            doubled(table.read_value())
    placement.settle(graph, server_ranks=[0, 2])     # hosts of 2 ranks each
    assert graph.get_operation_by_name("table").device == "/job:worker/task:2/device:CPU:0"
    body = [node for f in graph.as_graph_def().library.function for node in f.node_def if node.op == "Mul"]
    assert [node.device for node in body] == ["/job:worker/task:2/device:CPU:0"]
    assert not any("/job:ps" in op.device for op in graph.get_operations())
    assert session.remote_tasks(graph, rank=0) == ["/job:worker/task:2"]
    assert session.remote_tasks(graph, rank=2) == ["/job:worker/task:0"]
