"""The layers point one way: the runtime never imports a rewriter, the core reaches the
rewriters only through api's registry, nothing under parallax_tf/ or rewriters/ imports the
tools, and no modules import each other in a cycle (lazy imports inside functions count). The
core names no strategy: each is one package under rewriters/."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("parallax_tf", "rewriters")


def _modules() -> dict:
    """Module name -> file, for the packages and the tools."""
    found = {}
    for package in PACKAGES + ("tools",):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module[:-len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


def _imports(module: str, path: str, known: dict) -> set:
    """The project modules `module` imports (`from a import b` names a.b when b is a module)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names}
    return {m for m in out if m in known and m != module}


def _graph() -> dict:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_the_runtime_imports_no_rewriter_and_the_core_only_through_api():
    graph = _graph()
    wrong = sorted((m, i) for m, deps in graph.items() if m.startswith("parallax_tf")
                   for i in deps if i.split(".")[0] == "rewriters" and m != "parallax_tf.api")
    assert not wrong, f"modules of parallax_tf importing a rewriter: {wrong}"


def test_the_toolkit_imports_no_tool():
    graph = _graph()
    wrong = sorted((m, i) for m, deps in graph.items() if m.split(".")[0] in PACKAGES
                   for i in deps if i.split(".")[0] == "tools")
    assert not wrong, f"parallax_tf/rewriters importing tools: {wrong}"


def test_no_import_cycle():
    graph = {m: {d for d in deps if d.split(".")[0] in PACKAGES}
             for m, deps in _graph().items() if m.split(".")[0] in PACKAGES}
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # a package's __init__ importing its own modules is not a cycle between modules
    cycles = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") or c[0].startswith(m + ".")
                                           for m in c)]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_the_imports():
    """The graph is not empty: a moved folder or a parse change would make the checks pass vacuously."""
    graph = _graph()
    assert "rewriters.shared.rebuild" in graph["rewriters.shared.sync"] and "rewriters" in graph["parallax_tf.api"]
    assert "parallax_tf.runtime.topology" in graph["parallax_tf.runtime.cluster"]


# strategy names that are no route's (a route named "ps" or "allreduce" is the plan's vocabulary)
_STRATEGY_WORDS = re.compile(r"\b(hybrid|slim_dp|slim-dp|ps_plus|ps\+|stanza|dsp)\b", re.IGNORECASE)


def test_the_core_names_no_strategy():
    """api, the planner and the runtime reach every strategy through parallax_tf.strategy."""
    core = [os.path.join(ROOT, "parallax_tf", name) for name in ("api.py", "planner.py")]
    runtime = os.path.join(ROOT, "parallax_tf", "runtime")
    core += [os.path.join(runtime, name) for name in sorted(os.listdir(runtime)) if name.endswith(".py")]
    named = [f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}" for path in core
             for number, line in enumerate(open(path), 1) if _STRATEGY_WORDS.search(line)]
    assert not named, "the core names a strategy:\n" + "\n".join(named)
    assert len(core) > 10


def _technique_packages() -> set:
    """The folders under rewriters/ but shared/: one technique each."""
    folder = os.path.join(ROOT, "rewriters")
    return {name for name in os.listdir(folder) if name != "shared" and not name.startswith("_")
            and os.path.isfile(os.path.join(folder, name, "__init__.py"))}


def test_each_strategy_is_one_package():
    from parallax_tf import strategy
    import rewriters
    packages = {type(s).__module__.split(".")[1] for s in rewriters.STRATEGIES}
    assert packages == _technique_packages() and len(packages) >= 5
    assert strategy.names() == ("hybrid", "ps", "allreduce", "collective", "auto", "slim_dp", "ps_plus", "stanza", "dsp")
    for each in rewriters.STRATEGIES:
        assert strategy.get(each.name) is each
        for measure in each.measures:      # inspection's extra work comes from the techniques
            assert type(measure).__module__.split(".")[0] == "rewriters"


def test_no_technique_imports_another():
    """What several techniques use lives in rewriters/shared; one technique reaches another only
    through the registry (parallax_tf.strategy.get)."""
    graph, packages = _graph(), _technique_packages()
    wrong = sorted((m, i) for m, deps in graph.items() if m.split(".")[:2][-1] in packages
                   and m.startswith("rewriters.") for i in deps if i.startswith("rewriters.")
                   and i.split(".")[1] in packages and i.split(".")[1] != m.split(".")[1])
    assert not wrong, f"technique packages importing each other: {wrong}"
    assert {"rewriters.shared.sync", "rewriters.shared.rules"} <= graph["rewriters.slim_dp"]


def test_either_package_can_be_imported_first():
    """parallax_tf and rewriters import each other (the registry): --strategy is defined whichever
    a program imports first."""
    import subprocess
    import sys
    for first in ("rewriters", "parallax_tf", "rewriters.ps_plus.runner"):
        code = f"import {first}; from absl import flags; print(flags.FLAGS['strategy'].parser.enum_values)"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "'hybrid', 'ps', 'allreduce', 'collective', 'auto', 'slim_dp', 'ps_plus', 'stanza', 'dsp'" in proc.stdout


def test_compat_is_the_bottom_layer():
    """parallax_tf/compat imports no other parallax_tf module; its Horovod shim imports none at
    all (the launcher, run as a script, loads it by path without importing parallax_tf)."""
    graph = _graph()
    compat = {m: deps for m, deps in graph.items() if m.startswith("parallax_tf.compat")}
    wrong = sorted((m, i) for m, deps in compat.items() for i in deps if not i.startswith("parallax_tf.compat"))
    assert not wrong, f"parallax_tf/compat importing the rest of the toolkit: {wrong}"
    assert not graph["parallax_tf.compat.horovod"]
    assert "parallax_tf.compat.pins" in graph["parallax_tf.compat.tensorflow"]


def test_a_route_is_named_only_where_it_is_defined():
    """The planner and the plan ask a route (parallax_tf.routes), never compare its name; a
    technique's route is spelled only inside its own package (elsewhere: the name it exports)."""
    import parallax_tf  # noqa: F401  (registers every technique and its routes)
    from parallax_tf import routes
    owners = {name: type(routes.get(name)).__module__.rsplit(".", 1)[0] for name in routes.names()}
    assert {"ps", "allreduce", "local", "alltoall", "significant", "async_ps", "fc_node", "stage"} <= set(owners)
    asking = {"parallax_tf.planner", "parallax_tf.plan", "parallax_tf.api", "parallax_tf.strategy"}
    spelled = []
    for module, path in _modules().items():
        if module.split(".")[0] not in PACKAGES:
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if not (isinstance(node, ast.Constant) and node.value in owners):
                continue
            owner = owners[node.value]
            if module in asking or owner != "parallax_tf" and not module.startswith(owner):
                spelled.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}")
    assert not spelled, "route names spelled outside their route's package:\n" + "\n".join(spelled)
