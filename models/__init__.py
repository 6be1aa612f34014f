"""Reference models for parallax_tf: lm (sparse-heavy), cnn (dense FC-heavy), mlp (tiny, for tests),
recsys (wide & deep over feature columns) and criteo (Criteo's shape, DLRM).

Each module exposes make_model_fn(**kw) / make_input_fn(**kw) usable without absl flags, default
`model_fn` / `input_fn`, and a main() runnable as `python -m models.<name>`.
"""
import os

_RANK_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")   # set by the launchers


def run_and_report(name: str, model_fn, input_fn):
    """ptf.run with the command-line flags; rank 0 of a real run prints first and last loss.

    With --np N outside a launcher ptf.run relaunches and exits, so nothing may follow it
    except printing."""
    import parallax_tf as ptf  # lazy: `import models` alone should not pull in TensorFlow
    from absl import flags
    result = ptf.run(model_fn, input_fn, steps=flags.FLAGS.steps)
    rank = next((int(os.environ[k]) for k in _RANK_ENV if k in os.environ), 0)
    if rank == 0 and result.losses and not flags.FLAGS.plan_only:
        print(f"{name}: first loss {result.losses[0]:.4f} last loss {result.losses[-1]:.4f}", flush=True)
    return result
