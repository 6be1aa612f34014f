"""A script's flags under absl's `app.run`, parsed as parallax_tf parses them.

`app.run(main)` parses the command line with absl's `parse_flags_with_usage`, which prints a
two-line "FATAL Flags parsing error" and exits with status 1 on every rank. A script that
imports parallax_tf gets parallax_tf.flags.parse_command_line instead: a misspelled flag or a bad
value is a ConfigError, so the program ends with one line and status 2 (runtime/exit.py), which
parallax_tf's launcher prints once for the job. A flags_parser the script passes itself is kept.
absl's own --help and --helpfull end with status 1; parse_command_line prints the help and ends
with 0."""
from __future__ import annotations

import functools


def install() -> None:
    from absl import app
    if getattr(app.run, "_parallax", False):
        return
    absl_run, absl_parser = app.run, app.parse_flags_with_usage

    @functools.wraps(absl_run)
    def run(main, argv=None, flags_parser=absl_parser):
        if flags_parser is absl_parser:
            from parallax_tf.flags import parse_command_line
            flags_parser = parse_command_line
        return absl_run(main, argv, flags_parser=flags_parser)

    run._parallax = True
    app.run = run

