"""Where a rank's ids of several compiled tables go, in one op each (ops/kv_route_ops.cc): the
ids split by owning shard into one message per server, the servers' flat answers back as each
entry's rows, and rows (a push's payload) spread the same way. An entry is one id vector and
the shards of the table it addresses: a lookup's distinct ids, or a table's pushed ids. A
server's message holds its parts, (entry, shard), entry after entry and shard after shard, the
order compiled.read_many and compiled.push take their shards in."""
from __future__ import annotations

from typing import Dict, List, Sequence

import tensorflow as tf

from parallax_tf import ops as compiled_ops


class Route:
    """Entries `shards[e]` (each entry's table's shards, on their servers' devices)."""

    def __init__(self, shards: Sequence[Sequence[object]]):
        self.entries = [list(entry) for entry in shards]
        self.devices = sorted({shard.device for entry in self.entries for shard in entry}, key=str)
        at = {device: h for h, device in enumerate(self.devices)}
        self._attrs = dict(hosts=len(self.devices), shards=[len(entry) for entry in self.entries],
                           servers=[at[shard.device] for entry in self.entries for shard in entry])

    def shards_on(self, device) -> list:
        """The shards of `device`'s message, part after part."""
        return [shard for entry in self.entries for shard in entry if shard.device == device]

    def messages(self, ids: List[tf.Tensor]) -> Dict[str, tf.Tensor]:
        """Per server device, its message of the entries' ids (counts, then ids)."""
        made = compiled_ops.load().parallax_kv_route(ids, **self._attrs)
        return dict(zip(self.devices, made))

    def spread(self, ids: List[tf.Tensor], rows: List[tf.Tensor]) -> Dict[str, tf.Tensor]:
        """Per server device, the entries' rows (aligned with `ids`) flattened in its message's order."""
        made = compiled_ops.load().parallax_kv_spread_rows(
            ids, [tf.cast(r, tf.float32) for r in rows], widths=[int(r.shape[1]) for r in rows], **self._attrs)
        return dict(zip(self.devices, made))

    def gather(self, ids: List[tf.Tensor], flats: Dict[str, tf.Tensor], widths: List[int]) -> List[tf.Tensor]:
        """Each entry's rows, [len(ids[e]), widths[e]], from the servers' flat answers."""
        placement = {k: v for k, v in self._attrs.items() if k != "hosts"}     # the answers' count
        return compiled_ops.load().parallax_kv_gather_rows(ids, [flats[d] for d in self.devices], widths=widths,
                                                           **placement)
