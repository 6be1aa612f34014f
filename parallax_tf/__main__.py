"""`python -m parallax_tf check` (parallax_tf/check.py) and `python -m parallax_tf export`
(parallax_tf/export.py)."""
import sys

USAGE = ("usage: python -m parallax_tf check [--ops_dir=DIR] [--no_ranks]\n"
         "       python -m parallax_tf export --model module:name --ckpt_dir DIR --export_dir DIR [model flags]")

if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["check"]:
        from parallax_tf import check
        sys.exit(check.main(sys.argv[2:]))
    if command == ["export"]:
        from parallax_tf import export
        sys.exit(export.main(sys.argv[2:]))
    print(USAGE, file=sys.stderr)
    sys.exit(2)
