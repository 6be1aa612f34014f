"""The script's own arguments and the toolkit's flags on one command line.

`python train.py --np 2 --strategy ps -- --my_arg 5`: the toolkit's flags come before `--`, the
script's own after it. The toolkit parses the command line as given; the script's own parser
reads sys.argv without that `--` (separate_script_arguments)."""
from __future__ import annotations

import os
import sys
import sysconfig
from typing import List, Optional

# The command line as given, when `import parallax_tf` took its `--` out of sys.argv, and sys.argv
# as that left it (separate_script_arguments).
_GIVEN: Optional[List[str]] = None
_LEFT: Optional[List[str]] = None


def separate_script_arguments() -> None:
    """Takes the first `--` out of a user's program's sys.argv, so that the script's own parser
    reads the arguments behind it as it would without parallax_tf (argparse's parse_known_args
    takes everything after a `--` as positional, so it would drop `-- --my_arg 5`). The
    toolkit's flags are still parsed from the command line as given (toolkit_argv)."""
    global _GIVEN, _LEFT
    if not users_program() or "--" not in sys.argv[1:]:
        return
    at = sys.argv.index("--", 1)
    _GIVEN, _LEFT = list(sys.argv), sys.argv[:at] + sys.argv[at + 1:]
    sys.argv = list(_LEFT)


def toolkit_argv(argv) -> list:
    """What the toolkit parses for `argv`: the command line as given while the script left
    sys.argv as separate_script_arguments made it (a script that rewrote sys.argv gets its own)."""
    return list(_GIVEN) if _GIVEN is not None and list(argv) == _LEFT else list(argv)


def users_program() -> bool:
    """Whether the running program is a script or module of the user's (not an installed tool's)."""
    main = sys.modules.get("__main__")
    path = os.path.abspath(getattr(main, "__file__", "") or "")
    if sys.flags.interactive or not path.endswith(".py"):
        return False
    installed = {sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib", "scripts")}
    return not any(path.startswith(os.path.join(folder, "")) for folder in installed)
