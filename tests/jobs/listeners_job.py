"""Trains briefly, then reports where this rank's TF servers listen and whether they answer on
another of this host's addresses. usage: listeners_job.py OTHER_ADDRESS|-"""
import os
import socket
import subprocess
import sys


def _note_tensorflow_import(event, args):
    """Whether this rank imports TensorFlow before or after it re-executed itself with the shim."""
    if event == "import" and args[0] == "tensorflow":
        print(f"IMPORTS TENSORFLOW reexecuted={os.environ.get('PARALLAX_BIND_REEXEC', '0')}", flush=True)


sys.addaudithook(_note_tensorflow_import)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from parallax_tf.runtime import cluster  # noqa: E402
from tests import cases  # noqa: E402

# with the tf_ps baseline's separate ps server on rank 0 too; ptf.run reuses this cluster
spec = cluster.start_cluster(None, None, host_job="ps").spec
ptf.run(cases.build("mixed", "sgd"), cases.input_fn_for("mixed"), steps=2, log_every=0)
rank = os.environ.get("HOROVOD_RANK", "0")
mine = [spec["worker"][int(rank)]] + [a for a in spec.get("ps", []) if int(rank) == 0]
for address in mine:
    port = address.rsplit(":", 1)[1]
    listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
    print(f"LISTEN rank={rank} port={port} local={listening[3] if len(listening) > 3 else '?'}", flush=True)
    if sys.argv[1] != "-":
        try:
            socket.create_connection((sys.argv[1], int(port)), timeout=2).close()
            print(f"REACHABLE rank={rank} via={sys.argv[1]} port={port}", flush=True)
        except OSError:
            print(f"REFUSED rank={rank} via={sys.argv[1]} port={port}", flush=True)
