"""Errors a user can cause. Each message names what was wrong and how to fix it."""


class ParallaxError(Exception):
    """Base class: the run cannot go on; the message says why and what to change."""


class UserError(ParallaxError):
    """Caused by the user's model, input or options: on the command line the program ends with
    the message on one line and exit status 2 (parallax_tf.runtime.exit)."""


class ModelError(UserError):
    """model_fn built something the toolkit cannot train."""


class InputError(UserError):
    """input_fn did not provide what the graph needs."""


class ConfigError(UserError):
    """A flag or keyword argument is out of range or unknown."""


class ClusterError(ParallaxError):
    """A rank, server or port problem: a peer died, a wait timed out, a port is busy."""


class Diverged(ParallaxError):
    """The loss became NaN or Inf. `after_report`, when set, runs once the error is printed and
    before the process exits (runtime/exit.py): ranks that diverge together wait there for each
    other, so no rank's exit cuts off another's report."""
    after_report = None
