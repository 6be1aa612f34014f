"""The private names of TensorFlow, tf_keras and Horovod live in parallax_tf/compat/, one shim
per dependency: each pinned name still resolves on the installed version (a test per shim that
names what moved), and nothing else in parallax_tf/ or rewriters/ reaches a private name of
theirs."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("parallax_tf", "rewriters")
COMPAT = os.path.join(ROOT, "parallax_tf", "compat")
PRIVATE_MODULES = ("tensorflow.python", "tf_keras.src", "keras.src", "horovod.runner")
STANDARD_LIBRARY_PRIVATE = {("os", "_exit"), ("sys", "_getframe")}     # documented in Python's own manual


def _moved(shim, dependency, gone) -> str:
    return (f"{dependency.__name__} {dependency.__version__} has no {', '.join(gone)}: update "
            f"{os.path.relpath(shim.__file__, ROOT)} (and its PINNED) for where it lives now")


def test_every_pinned_tensorflow_name_exists():
    import tensorflow
    from parallax_tf.compat import tensorflow as shim
    gone = shim.missing()
    assert not gone, _moved(shim, tensorflow, gone)
    assert {name for _, name, _ in shim.PINNED} >= {"_GradientsHelper", "_get_save_slice_info", "_add_control_inputs"}


def test_every_pinned_tf_keras_name_exists():
    import tf_keras
    from parallax_tf.compat import tf_keras as shim
    gone = shim.missing()
    assert not gone, _moved(shim, tf_keras, gone)
    assert {name for _, name, _ in shim.PINNED} >= {"OptimizerV2", "swap_class", "_compile_config"}


def test_every_pinned_horovod_name_exists():
    import horovod
    from parallax_tf.compat import horovod as shim
    gone = shim.missing()
    assert not gone, _moved(shim, horovod, gone)
    assert {name for _, name, _ in shim.PINNED} >= {"launch_gloo", "execute", "get_common_interfaces"}


def test_a_moved_name_is_named():
    """missing() reports a name that does not resolve, as where.name."""
    from parallax_tf.compat import pins
    pinned = [("tensorflow.Operation", "_no_such_name", "a test"), ("no_such_module.Thing", "x", "a test"),
              ("tensorflow.Operation", "_add_control_inputs", "a test")]
    assert pins.unresolved(pinned, {}) == ["tensorflow.Operation._no_such_name", "no_such_module.Thing.x"]


def _files(inside_compat: bool) -> list:
    found = []
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            if (folder == COMPAT or folder.startswith(COMPAT + os.sep)) == inside_compat:
                found += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names() -> set:
    """The private names the toolkit defines itself: defs, classes, module- and class-level
    names, attributes it sets on self/cls or on a function of its own module."""
    own = set()
    for path in _files(False) + _files(True):
        tree = ast.parse(open(path).read())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Name):
                            own.add(part.id)
                        elif isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and \
                                part.value.id in {"self", "cls"} | functions:
                            own.add(part.attr)
    return {name for name in own if _private(name)}


def _pinned_private_names() -> set:
    from parallax_tf.compat import horovod, tensorflow, tf_keras
    return {name for shim in (tensorflow, tf_keras, horovod) for _, name, _ in shim.PINNED if _private(name)}


def _private_uses(path: str, own: set, pinned: set) -> list:
    """`path`'s lines that reach a dependency's private name (the rule: see the test below)."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        if any(m == p or m.startswith(p + ".") for m in modules for p in PRIVATE_MODULES):
            found.append((node.lineno, ast.unparse(node)))
        name, owner = None, None
        if isinstance(node, ast.Attribute):
            name, owner = node.attr, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1 and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name, owner = node.args[1].value, node.args[0]
        if name is None or not (_private(name) or name == "__internal__"):
            continue
        on_self = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
        standard = isinstance(owner, ast.Name) and (owner.id, name) in STANDARD_LIBRARY_PRIVATE
        if name == "__internal__" or name in pinned or not (on_self or standard or name in own):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_private_names_are_reached_through_the_shims_only():
    """Outside parallax_tf/compat/, no module of parallax_tf/ or rewriters/:
    - imports tensorflow.python, tf_keras.src, keras.src or horovod.runner;
    - reads `__internal__` of anything;
    - reads, sets or getattr/hasattr/setattr/delattr's a private name (`_x`, not `__x__`) of an
      object other than self/cls, unless the toolkit defines that name itself (a def, a class, a
      module- or class-level name, an attribute it sets on self/cls or on a function of its own
      module) or it is one of the standard library's documented private names (os._exit,
      sys._getframe);
    - uses a private name a shim pins, even on self."""
    own, pinned = _own_private_names(), _pinned_private_names()
    wrong = [f"{os.path.relpath(path, ROOT)}:{line}: {text}" for path in _files(False)
             for line, text in _private_uses(path, own, pinned)]
    assert not wrong, "private names of TensorFlow/tf_keras/Horovod outside parallax_tf/compat " \
                      "(add a function to the dependency's shim and call it):\n" + "\n".join(wrong)
    assert len(_files(False)) > 50 and not pinned & own


def test_the_scan_sees_private_names():
    """The rule finds what the shims hold: a parse change would make the scan pass vacuously."""
    own, pinned = _own_private_names(), _pinned_private_names()
    shims = {os.path.basename(p): {text for _, text in _private_uses(p, own, pinned)} for p in _files(True)}
    assert "from tensorflow.python.ops import gradients_util" in shims["tensorflow.py"]
    assert "op._add_control_inputs" in shims["tensorflow.py"]
    assert "tf.__internal__" in shims["tensorflow.py"]
    assert "getattr(model, '_is_graph_network', False)" in shims["tf_keras.py"]
    assert "launch._check_all_hosts_ssh_successful" in shims["horovod.py"]
