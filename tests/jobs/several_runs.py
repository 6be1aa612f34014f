"""A job of several runs, one after another in the same ranks (they start once): `--runs=JSON`,
a list of runs, each with "flags" (parallax_tf's and the models') that hold for that run alone."""
import json


def take(argv: list):
    """(the runs --runs gives, or None; argv without it)."""
    runs = [a for a in argv if a.startswith("--runs=")]
    rest = [a for a in argv if not a.startswith("--runs=")]
    return (json.loads(runs[0].split("=", 1)[1]) if runs else None), rest


def each(runs: list):
    """Yields each run with its flags set over the command line's, which are parsed first."""
    from parallax_tf import flags as ptf_flags
    from tools.shared import flags_as_given
    ptf_flags.resolve()
    for run in runs:
        with flags_as_given(run.get("flags", [])):
            yield run

