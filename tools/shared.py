"""Flags and helpers shared by tools.bench, tools.bench_job, tools.simulate, tools.validate,
tools.sweep and tools.calibrate."""
import contextlib
from typing import Optional, Sequence

from absl import flags

import models.cnn  # noqa: F401,E402  (the reference models' flags: --cnn_fc_units, --lm_vocab, ...)
import models.criteo  # noqa: F401,E402
import models.lm  # noqa: F401,E402
import models.mlp  # noqa: F401,E402
import models.recsys  # noqa: F401,E402

# the sizes the sweep runs each model at, and calibration its smaller dense one (a 200k-weight CNN
# head: a step at 10 Mbit stays ~1 s)
SWEEP_MODEL_FLAGS = {"lm": [], "cnn": ["--cnn_fc_units=256,256"], "mlp": [], "recsys": [], "criteo": []}

flags.DEFINE_string("model", "lm", "Reference model: lm | cnn | mlp | recsys | criteo.")
flags.DEFINE_integer("warmup", 5, "Steps left out of the timings.")
FLAGS = flags.FLAGS


def model_and_input(name: str):
    """model_fn and input_fn of a reference model with the sizes its flags give (--cnn_fc_units, ...)."""
    module = __import__(f"models.{name}", fromlist=["from_flags"])
    return module.from_flags()


@contextlib.contextmanager
def flags_as_given(given_flags: Sequence[str]):
    """Inside the block, the flags as `given_flags` give them (["--cnn_fc_units=256,256"]); after
    it, as they were (so the flags a tool passes on to its jobs stay the user's, and each run of
    a job of several has its own)."""
    parsed = []
    for given in given_flags:
        name, _, value = given.lstrip("-").partition("=")
        if name not in FLAGS or not value:
            raise SystemExit(f"{given!r}: give a flag as --name=value (e.g. --cnn_fc_units=256,256)")
        parsed.append((name, value))
    saved = {name: (FLAGS[name].value, FLAGS[name].present) for name, _ in parsed}
    try:
        for name, value in parsed:
            try:
                FLAGS[name].parse(value)
            except flags.Error as err:
                raise SystemExit(f"--{name}={value}: {err}") from None
        yield
    finally:
        for name, (value, present) in saved.items():
            FLAGS[name].value, FLAGS[name].present = value, present


def capture_model(name: str, model_flags: Sequence[str] = (), for_strategy: Optional[str] = None):
    """The reference model `name` captured (parallax_tf.inspect_graph) at the sizes its flags and
    `model_flags` give, measured as `for_strategy` needs (None: nothing timed)."""
    from parallax_tf.inspect_graph import capture
    from parallax_tf.model import RunContext
    from parallax_tf.planner import measurements
    with flags_as_given(model_flags):
        return capture(*model_and_input(name), RunContext(), FLAGS.seed,
                       **(measurements(for_strategy) if for_strategy else {}))
