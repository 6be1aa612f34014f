"""Reference models for parallax_tf: lm (sparse-heavy), cnn (dense FC-heavy), mlp (tiny, for tests),
recsys (wide & deep over feature columns) and criteo (Criteo's shape, DLRM).

Each module exposes make_model_fn(**kw) / make_input_fn(**kw) usable without absl flags, default
`model_fn` / `input_fn`, and a main() runnable as `python -m models.<name>`.
"""


def run_and_report(name: str, model_fn, input_fn):
    """ptf.run with the command-line flags; rank 0 of a real run prints the first and last loss as
    the progress line and the `done:` summary give them (the mean over ranks; ps_plus: rank 0's).

    With --np N outside a launcher ptf.run relaunches and exits, so nothing may follow it
    except printing."""
    import parallax_tf as ptf  # lazy: `import models` alone should not pull in TensorFlow
    from absl import flags
    result = ptf.run(model_fn, input_fn, steps=flags.FLAGS.steps)
    losses = result.mean_losses or result.losses
    if result.rank == 0 and losses and not flags.FLAGS.plan_only:
        print(f"{name}: first loss {losses[0]:.4f} last loss {losses[-1]:.4f}", flush=True)
    return result
