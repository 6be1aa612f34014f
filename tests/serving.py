"""A SavedModel served the way its users serve it: in a process that never imports parallax_tf."""
import os
import subprocess
import sys
import tempfile

import numpy as np

# loads a SavedModel in a process that never imports parallax_tf, the way TF Serving does (a v1
# session with the signature's tensors) and the way TF2 code does (tf.saved_model.load); saves both
SERVE = """
import sys, numpy as np, tensorflow as tf
export_dir, inputs, out = sys.argv[1:]
feeds = dict(np.load(inputs, allow_pickle=True))
served = tf.saved_model.load(export_dir).signatures["serving_default"]
given = {k: tf.constant(v.astype(bytes) if v.dtype == object else v) for k, v in feeds.items()}
loaded = {"tf2:" + k: v.numpy() for k, v in served(**given).items()}
with tf.compat.v1.Session(graph=tf.Graph()) as sess:
    signature = tf.compat.v1.saved_model.loader.load(sess, ["serve"], export_dir).signature_def["serving_default"]
    fetch = {k: t.name for k, t in signature.outputs.items()}
    loaded.update({"v1:" + k: v for k, v in
                   sess.run(fetch, {signature.inputs[k].name: v for k, v in feeds.items()}).items()})
    ops = sorted({op.type for op in sess.graph.get_operations()})
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("parallax_tf", "rewriters"))
np.savez(out, ops=np.array(ops), imported=np.array(ours), **loaded)
"""


def serve(export_dir: str, feeds: dict) -> dict:
    """The exported model's outputs, computed in a plain-TF subprocess outside the project."""
    where = tempfile.mkdtemp(prefix="ptf-serve-")
    np.savez(os.path.join(where, "inputs.npz"), **feeds)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    proc = subprocess.run([sys.executable, "-c", SERVE, export_dir, os.path.join(where, "inputs.npz"),
                           os.path.join(where, "out.npz")], cwd=where, env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(os.path.join(where, "out.npz")))
