"""Checkpoints a plain single-device `tf.compat.v1.train.Saver` can restore.

Values arrive whole under single-device names (see values.py), so a checkpoint does not depend
on the number of ranks, servers or shards that wrote it. Each one is written into a fresh
directory that is renamed into place, then the `checkpoint` state file is replaced atomically:
a crash mid-write leaves at worst an unused temporary directory, never a checkpoint that
restores wrongly.

Everything in a checkpoint directory is relative to it, so a copied or moved directory goes on
from its own checkpoints. The newest checkpoint is its highest `step-N` directory (as the
launcher counts them); the `checkpoint` index, written with paths relative to the directory,
serves plain TF (`tf.train.latest_checkpoint(DIR)`) and is never followed here: a directory
written with absolute paths in its index is still found by its own `step-N` directories, and
its index is rewritten relative at the next save.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from parallax_tf.errors import ConfigError

_STEP_DIR = re.compile(r"^step-(\d+)$")
PREFIX = "model"          # files: step-N/model.index, step-N/model.data-00000-of-00001


def step_of(path: str) -> int:
    """The step of a checkpoint path DIR/step-N/model."""
    return int(_STEP_DIR.match(os.path.basename(os.path.dirname(path))).group(1))


def _in_directory(step: int) -> str:
    """A checkpoint's path relative to its directory."""
    return os.path.join(f"step-{step}", PREFIX)


class CheckpointStore:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.keep = max(1, keep)

    def save(self, values: Dict[str, np.ndarray], step: int) -> str:
        os.makedirs(self.directory, exist_ok=True)
        newer = [s for s in self.steps() if s > step]
        if newer:
            # keeping only the newest `keep` would delete this run's checkpoint and leave theirs
            raise ConfigError(f"checkpoint directory {self.directory} holds step-{newer[-1]}, newer than step {step} "
                              "this run is saving: another run writes into it; give each run its own --ckpt_dir")
        final = os.path.join(self.directory, f"step-{step}")
        staging = os.path.join(self.directory, f".staging-step-{step}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        keys = sorted(values)
        tensors = [tf.constant(values[k]) for k in keys]
        tf.raw_ops.SaveV2(prefix=os.path.join(staging, PREFIX), tensor_names=keys,
                          shape_and_slices=[""] * len(keys), tensors=tensors)
        if os.path.exists(final):          # a re-run of the same step replaces it
            shutil.rmtree(final)
        os.rename(staging, final)
        kept = self.steps()[-self.keep:]
        tf.compat.v1.train.update_checkpoint_state(
            self.directory, _in_directory(step), all_model_checkpoint_paths=[_in_directory(s) for s in kept])
        for stale in self.steps()[:-self.keep]:
            shutil.rmtree(os.path.join(self.directory, f"step-{stale}"), ignore_errors=True)
        return os.path.join(final, PREFIX)

    def latest(self) -> Optional[str]:
        """The path of the newest checkpoint in this directory, None if it holds none. A newest
        step-N directory without a complete checkpoint is refused rather than passed over: a run
        from an older one would later overwrite it."""
        steps = self.steps()
        if not steps:
            return None
        path = os.path.join(self.directory, _in_directory(steps[-1]))
        if not tf.io.gfile.exists(path + ".index"):
            older = f"go on from step-{steps[-2]}" if len(steps) > 1 else "start afresh"
            raise ConfigError(f"checkpoint directory {self.directory}: step-{steps[-1]} holds no complete checkpoint "
                              f"({PREFIX}.index is missing); delete {os.path.dirname(path)} to {older}")
        return path

    def steps(self) -> List[int]:
        """The steps of this directory's step-N directories, ascending."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, names)
                      if m and os.path.isdir(os.path.join(self.directory, m.group(0))))

    @staticmethod
    def newest(stores: Iterable[Optional["CheckpointStore"]]) -> Optional[str]:
        """The newest checkpoint of several stores (a disk checkpoint, an in-memory commit), by step."""
        paths = [p for p in (s.latest() for s in stores if s is not None) if p]
        return max(paths, key=step_of, default=None)

    @staticmethod
    def load(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, list]]:
        try:
            reader = tf.train.load_checkpoint(path)
            shapes = reader.get_variable_to_shape_map()
            return {k: reader.get_tensor(k) for k in shapes}, shapes
        except tf.errors.OpError as error:
            first = (error.message or type(error).__name__).strip().splitlines()[0][:200]
            raise ConfigError(f"checkpoint {path} cannot be read ({first}); delete {os.path.dirname(path)} to go on "
                              "from the checkpoint before it") from None
