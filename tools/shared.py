"""Flags and helpers shared by tools.bench, tools.bench_job, tools.simulate and tools.validate."""
from absl import flags

flags.DEFINE_string("model", "lm", "Reference model: lm | cnn | mlp.")
flags.DEFINE_integer("warmup", 5, "Steps left out of the timings.")


def model_and_input(name: str):
    """model_fn and input_fn of a reference model with its default sizes."""
    module = __import__(f"models.{name}", fromlist=["make_model_fn"])
    return module.make_model_fn(), module.make_input_fn()
