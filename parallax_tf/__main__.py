"""`python -m parallax_tf check` (parallax_tf/check.py) and `python -m parallax_tf export`
(parallax_tf/export.py); `--help` lists them."""
import sys

USAGE = ("usage: python -m parallax_tf check [--ops_dir=DIR] [--no_ranks]\n"
         "       python -m parallax_tf export --model module:name --ckpt_dir DIR --export_dir DIR [model flags]")
HELP = f"""{USAGE}

  check   what was built and whether it works on this machine (run it first)
  export  a SavedModel for TF Serving from a run's checkpoint (export --help: its flags)"""
HELP_ARGUMENTS = (["--help"], ["-h"], ["help"])

if __name__ == "__main__":
    command = sys.argv[1:2]
    if command in HELP_ARGUMENTS:
        print(HELP)
        sys.exit(0)
    if command == ["check"]:
        from parallax_tf import check
        sys.exit(check.main(sys.argv[2:]))
    if command == ["export"]:
        from parallax_tf import export
        sys.exit(export.main(sys.argv[2:]))
    said = f"unknown command {command[0]!r}" if command else "no command"
    print(f"python -m parallax_tf: error: {said}; give check or export (--help shows how)", file=sys.stderr)
    sys.exit(2)
