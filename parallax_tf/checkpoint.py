"""Checkpoints a plain single-device `tf.compat.v1.train.Saver` can restore.

Values arrive whole under single-device names (see values.py), so a checkpoint does not depend
on the number of ranks, servers or shards that wrote it. Each one is written into a fresh
directory that is renamed into place, then the `checkpoint` state file is replaced atomically:
a crash mid-write leaves at worst an unused temporary directory, never a checkpoint that
restores wrongly.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

_STEP_DIR = re.compile(r"^step-(\d+)$")
PREFIX = "model"          # files: step-N/model.index, step-N/model.data-00000-of-00001


class CheckpointStore:
    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.keep = max(1, keep)

    def save(self, values: Dict[str, np.ndarray], step: int) -> str:
        os.makedirs(self.directory, exist_ok=True)
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
        path = os.path.join(final, PREFIX)
        kept = self._step_dirs()[-self.keep:]
        tf.compat.v1.train.update_checkpoint_state(
            self.directory, path, all_model_checkpoint_paths=[os.path.join(self.directory, d, PREFIX) for d in kept])
        for stale in self._step_dirs()[:-self.keep]:
            shutil.rmtree(os.path.join(self.directory, stale), ignore_errors=True)
        return path

    def latest(self) -> Optional[str]:
        if not os.path.isdir(self.directory):
            return None
        return tf.train.latest_checkpoint(self.directory)

    @staticmethod
    def load(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, list]]:
        reader = tf.train.load_checkpoint(path)
        shapes = reader.get_variable_to_shape_map()
        return {k: reader.get_tensor(k) for k in shapes}, shapes

    def _step_dirs(self):
        found = [d for d in os.listdir(self.directory) if _STEP_DIR.match(d)]
        return sorted(found, key=lambda d: int(_STEP_DIR.match(d).group(1)))
