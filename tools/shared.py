"""Flags and helpers shared by tools.bench, tools.bench_job, tools.simulate and tools.validate."""
from absl import flags

import models.cnn  # noqa: F401,E402  (the reference models' flags: --cnn_fc_units, --lm_vocab, ...)
import models.lm  # noqa: F401,E402
import models.mlp  # noqa: F401,E402

flags.DEFINE_string("model", "lm", "Reference model: lm | cnn | mlp.")
flags.DEFINE_integer("warmup", 5, "Steps left out of the timings.")


def model_and_input(name: str):
    """model_fn and input_fn of a reference model with the sizes its flags give (--cnn_fc_units, ...)."""
    module = __import__(f"models.{name}", fromlist=["from_flags"])
    return module.from_flags()
