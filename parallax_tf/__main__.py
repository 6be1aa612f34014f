"""`python -m parallax_tf check`: see parallax_tf/check.py."""
import sys

from parallax_tf import check

if __name__ == "__main__":
    if sys.argv[1:2] != ["check"]:
        print("usage: python -m parallax_tf check [--ops_dir=DIR] [--no_ranks]", file=sys.stderr)
        sys.exit(2)
    sys.exit(check.main(sys.argv[2:]))
