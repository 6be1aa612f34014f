"""Names for a TF2 step's variables: the single-device names results, plans and checkpoints use.

A Keras 3 variable is named by its path (`sequential/dense/kernel`), found through the Keras
objects the step reaches (its closure, its globals, the object a bound method belongs to); any
other variable by its own name (`dense/kernel` of tf_keras, `w` of a tf.Module); a slot by its
variable's name and its own (`dense/kernel/momentum`). Names are made unique in the order the
step captures its variables, the same in every build."""
from __future__ import annotations

import inspect
from typing import Dict, Optional

import tensorflow as tf


class VariableNames:
    def __init__(self, step, variables):
        paths = _keras_paths(step)
        self._names: Dict[int, str] = {}
        taken = set()
        for variable in variables:
            base = paths.get(id(variable)) or variable.name.split(":")[0]
            self._names[id(variable)] = _unique(base.replace(":", "_"), taken)
        self._taken = taken

    def of(self, variable, owner: Optional[tf.Variable] = None) -> str:
        """The variable's name; a slot's under its owner's."""
        name = self._names[id(variable)]
        if owner is None:
            return name
        key = ("slot", id(variable))
        if key not in self._names:
            short = name.rsplit("/", 1)[-1]
            self._names[key] = _unique(f"{self._names[id(owner)]}/{short}", self._taken)
        return self._names[key]


def _unique(name: str, taken: set) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    taken.add(candidate)
    return candidate


def _keras_paths(step) -> Dict[int, str]:
    """id(tf.Variable) -> its Keras 3 variable's path, for the Keras objects the step reaches."""
    found: Dict[int, str] = {}
    for owner in _reached(step):
        for variable in _keras_variables(owner):
            inner = getattr(variable, "value", None)
            path = getattr(variable, "path", None)
            if isinstance(inner, tf.Variable) and path:
                found.setdefault(id(inner), path)
    return found


def _reached(step) -> list:
    function = getattr(step, "python_function", step)
    reached = [getattr(function, "__self__", None)]
    function = getattr(function, "__func__", function)
    try:
        closure = inspect.getclosurevars(function)
        reached += list(closure.nonlocals.values()) + list(closure.globals.values())
    except (TypeError, ValueError):
        pass
    return [r for r in reached if r is not None]


def _keras_variables(owner) -> list:
    """The Keras 3 variables of a model, layer, metric or optimizer (and of a compiled model's
    optimizer and metrics)."""
    module = type(owner).__module__
    if not (module == "keras" or module.startswith("keras.")):
        return []
    found = list(getattr(owner, "variables", []) or [])
    optimizer = getattr(owner, "optimizer", None)
    if optimizer is not None and optimizer is not owner:
        found += list(getattr(optimizer, "variables", []) or [])
    return found
