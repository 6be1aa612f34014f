"""A training script with one thing wrong, chosen by --case; run as a user would run it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402  (before TensorFlow, as the README asks)
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402
from tests import cases  # noqa: E402

flags.DEFINE_string("case", "ok", "what to get wrong")
flags.DEFINE_integer("die_at_step", -1, "rank 1 exits abruptly at this step (simulates a lost rank)")
flags.DEFINE_bool("rank1_skips_a_step", False, "rank 1 starts one step late, so it runs one step fewer than rank 0 "
                  "and the two end up waiting in different Horovod collectives (a runtime fault's effect)")
FLAGS = flags.FLAGS


def main(argv):
    model_fn = cases.build("mixed", "sgd")
    input_fn = cases.input_fn_for("mixed")
    if FLAGS.case == "missing_placeholder":
        input_fn = lambda ctx: {"ids": cases.batch("mixed", ctx.rank, ctx.step)["ids"]}  # no labels
    if FLAGS.case == "wrong_shape":      # one id per example fewer than the placeholder takes
        input_fn = lambda ctx: {**cases.batch("mixed", ctx.rank, ctx.step),  # noqa: E731
                                "ids": cases.batch("mixed", ctx.rank, ctx.step)["ids"][:, :2]}
    if FLAGS.case == "sign_of_sparse_gradient":    # signSGD on the embedding: not linear in the rows
        def model_fn():
            loss = cases._mixed_loss()
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            pairs = [(tf.IndexedSlices(tf.sign(g.values), g.indices, g.dense_shape)
                      if isinstance(g, tf.IndexedSlices) else g, v) for g, v in opt.compute_gradients(loss)]
            return ptf.Model(loss=loss, train_op=opt.apply_gradients(pairs))
    if FLAGS.die_at_step >= 0:
        inner = input_fn

        def input_fn(ctx):
            if ctx.rank == 1 and ctx.step == FLAGS.die_at_step:
                os._exit(17)
            return inner(ctx)
    if FLAGS.rank1_skips_a_step and os.environ.get("HOROVOD_RANK") == "1":
        from parallax_tf.runtime import session
        initialise = session.initialise
        session.initialise = lambda *args, **kwargs: initialise(*args, **kwargs) + 1
    result = ptf.run(model_fn, input_fn)
    print(f"trained global_step={result.global_step} loss={result.losses[-1]:.4f}", flush=True)


if __name__ == "__main__":
    app.run(main)
