"""The alltoall route: a sparse variable row-sharded over the data ranks themselves, no parameter
server (the way Sparse Operation Kit and DeepRec move embeddings). Row i lives on rank i % N.

Per step, on every rank (all through Horovod, the engine of the dense AllReduce):
  forward   each lookup's distinct ids, grouped by owner, go to their owners; each owner
            gathers their rows from its shard and sends them back; the rank expands them to the
            lookup's shape, as single-device TF's gather returns them.
  backward  the gradient per looked-up id is summed per distinct id and sent back along the same
            exchange, values only (the owner kept the ids); the owner sums what every rank sent
            per row, divides by N (the average over ranks, as AllReduce does) and its optimizer
            applies those rows to its shard (alltoall_route.py).
Every lookup of one dtype travels in one message per peer and direction, as the PS route packs
its requests (a collective costs Horovod a negotiation and gloo a round of its own, whatever
its size): three alltoalls a step in all. Each keeps one length from step to step (the rank's
message to itself padded: fixed_length_alltoall), so Horovod answers it from its response
cache instead of gathering every rank's request on rank 0 and broadcasting its plan. A rank
thus moves each distinct id once and its row twice, of which 1/N stays on the rank: the lower
bound of a sparse gradient's traffic. The shard
and its optimizer slots are the rank's own state (never broadcast); values.StateIO scatters
whole values into them and gathers them back.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from rewriters.shared.transform import rewire


def shard_rows(rows: int, num_ranks: int, rank: int) -> int:
    """Rows of a `rows`-row variable that rank `rank` of `num_ranks` holds (rows r, r+N, ...)."""
    return max(0, (rows - rank + num_ranks - 1) // num_ranks)


@dataclasses.dataclass
class Lookup:
    """One lookup in this step's exchange, kept for the gradient's way back."""
    pack: "Pack"
    index: int              # its place in the pack
    variable: object
    row_shape: List[int]
    position: tf.Tensor     # per looked-up id, its index among the distinct ids
    num_distinct: tf.Tensor
    order: tf.Tensor        # the distinct ids grouped by owner: distinct[order]
    counts: tf.Tensor       # how many of them each rank owns (int32, [N])
    sorted_ids: tf.Tensor = None      # the distinct ids in that order
    served: tf.Tensor = None          # rows of this rank's shard the ranks asked for, by source rank
    served_counts: tf.Tensor = None   # how many each rank asked for (int32, [N])
    away: tf.Tensor = None            # distinct ids another rank owns (int64)

    @property
    def row_elements(self) -> int:
        return math.prod(self.row_shape)


@dataclasses.dataclass
class Pack:
    """The lookups of one dtype, exchanged together."""
    tag: str                # the collectives' name stem, the same on every rank
    num_ranks: int
    rank: int
    lookups: List[Lookup] = dataclasses.field(default_factory=list)

    @property
    def dtype(self):
        return self.lookups[0].variable.dtype.base_dtype

    def send(self, per_lookup: List[tf.Tensor], counts: List[tf.Tensor], name: str, lookups=None) -> tf.Tensor:
        """Sends each lookup's rows (grouped by destination, `counts` per destination) to their
        ranks in one alltoall, and returns what arrived, flat, in source-rank order. `lookups`:
        the pack's lookups the rows are of (all of them by default), the same on every rank."""
        lookups = self.lookups if lookups is None else lookups
        pieces = [tf.split(tf.reshape(rows, [-1]), counts[k] * look.row_elements, num=self.num_ranks)
                  for k, (look, rows) in enumerate(zip(lookups, per_lookup))]
        flat = tf.concat([pieces[k][r] for r in range(self.num_ranks) for k in range(len(lookups))], 0)
        splits = tf.add_n([c * look.row_elements for c, look in zip(counts, lookups)])
        received, _ = fixed_length_alltoall(flat, splits, self.rank, f"{self.tag}_{name}")
        return received

    def unpack(self, received: tf.Tensor, counts: List[tf.Tensor], lookups=None) -> List[tf.Tensor]:
        """Per lookup, the rows `received` holds from every rank (`counts`: per lookup, how many
        each rank sent), concatenated in source-rank order."""
        lookups = self.lookups if lookups is None else lookups
        sizes = [c * look.row_elements for c, look in zip(counts, lookups)]
        blocks = tf.split(received, tf.add_n(sizes), num=self.num_ranks)
        per_source = [tf.split(blocks[s], [size[s] for size in sizes], num=len(lookups))
                      for s in range(self.num_ranks)]
        return [tf.reshape(tf.concat([per_source[s][k] for s in range(self.num_ranks)], 0), [-1] + look.row_shape)
                for k, look in enumerate(lookups)]


def fixed_length_alltoall(flat: tf.Tensor, splits: tf.Tensor, rank: int, name: str):
    """hvd.alltoall of the 1-D `flat` (`splits` elements to each rank, in rank order), returning
    (what arrived, in source-rank order; how much from each rank), as hvd.alltoall does.

    The tensor Horovod sees has a length that changes only when the step's need crosses a power
    of two: the rank's message to itself carries the padding (no link sees it) and the padding
    is cut from what arrives. Horovod's response cache keys a collective by its name and shape,
    so a steady length is a cache hit: each rank only raises its bit in the cycle's bit-vector
    AllReduce. A length that changes every step makes Horovod gather every rank's request on
    rank 0 and broadcast the response each time, the busiest link's largest cost after the
    data (recsys on 8 hosts at 10 Mbit: 21 of rank 0's 131 KB per step)."""
    import horovod.tensorflow as hvd
    need = tf.size(flat, out_type=tf.int32)
    padding = _next_power_of_two(tf.maximum(need, 64)) - need
    own = tf.one_hot(rank, tf.size(splits), dtype=tf.int32)             # [N]: 1 at this rank
    own_end = tf.reduce_sum(splits[:rank + 1])
    padded = tf.concat([flat[:own_end], tf.zeros([padding], flat.dtype), flat[own_end:]], 0)
    received, received_splits = hvd.alltoall(padded, splits=splits + padding * own, name=name)
    own_real_end = tf.reduce_sum(received_splits[:rank]) + splits[rank]   # this rank's message ends with the padding
    return (tf.concat([received[:own_real_end], received[own_real_end + padding:]], 0),
            received_splits - padding * own)


def _next_power_of_two(n: tf.Tensor) -> tf.Tensor:
    """The least power of two >= n (int32, 1 <= n <= 2^30)."""
    x = n - 1
    for shift in (1, 2, 4, 8, 16):
        x = tf.bitwise.bitwise_or(x, tf.bitwise.right_shift(x, shift))
    return x + 1


def exchange_lookups(variables, needed: set, num_ranks: int, rank: int):
    """Rewires each lookup of the shards `variables` that the loss needs to one exchange per
    dtype. Returns (new gather -> (the expansion, the lookup's ids, its Lookup), as
    rebuild.pull_distinct_rows returns its expansions (the gradient is taken per looked-up id);
    the exchanges)."""
    packs: Dict[str, Pack] = {}
    found = []
    for variable in variables:
        lookups = sorted((op for op in variable.handle.consumers() if op in needed), key=lambda o: o.name)
        other = [op for op in lookups if op.type != "ResourceGather" or op.get_attr("batch_dims") != 0]
        if other:
            raise ModelError(f"variable {variable.op.name!r} is read by {other[0].name!r} ({other[0].type}), not "
                             "only by lookups (tf.nn.embedding_lookup, tf.gather); the alltoall route serves "
                             "lookups alone. Use --strategy=hybrid (its PS route reads any way), or look its rows up")
        dtype = variable.dtype.base_dtype
        pack = packs.setdefault(dtype.name, Pack(f"parallax_a2a_{dtype.name}", num_ranks, rank))
        for op in lookups:
            found.append((pack, variable, op))
    expansions = {}
    for pack in packs.values():
        ops = [(variable, op) for p, variable, op in found if p is pack]
        expansions.update(_exchange(pack, ops, num_ranks, rank))
    return expansions, list(packs.values())


def _exchange(pack: Pack, ops, num_ranks: int, rank: int) -> dict:
    for k, (variable, op) in enumerate(ops):
        distinct, position = tf.unique(tf.cast(tf.reshape(op.inputs[1], [-1]), tf.int64))
        owner = tf.math.floormod(distinct, num_ranks)
        order = tf.argsort(owner, stable=True)
        counts = tf.math.bincount(tf.cast(owner, tf.int32), minlength=num_ranks, maxlength=num_ranks,
                                  dtype=tf.int32)
        look = Lookup(pack, k, variable, variable.shape[1:].as_list(), position, tf.size(distinct), order, counts)
        look.away = tf.reduce_sum(tf.cast(tf.not_equal(owner, rank), tf.int64))
        look.sorted_ids = tf.gather(distinct, order)
        pack.lookups.append(look)
    lookups, K = pack.lookups, len(pack.lookups)
    # ids: to each rank, how many ids of each lookup it gets, then those ids
    counts = tf.stack([look.counts for look in lookups])                       # [K, N]
    id_pieces = [tf.split(look.sorted_ids, look.counts, num=num_ranks) for look in lookups]
    message = tf.concat([part for r in range(num_ranks)
                         for part in [tf.cast(counts[:, r], tf.int64)] + [id_pieces[k][r] for k in range(K)]], 0)
    asked, asked_splits = fixed_length_alltoall(message, K + tf.reduce_sum(counts, 0), rank, f"{pack.tag}_ids")
    blocks = tf.split(asked, asked_splits, num=num_ranks)
    heads = [tf.cast(block[:K], tf.int32) for block in blocks]                 # per source: [K]
    bodies = [tf.split(block[K:], head, num=K) for block, head in zip(blocks, heads)]
    expansions, served_rows = {}, []
    for k, look in enumerate(lookups):
        look.served_counts = tf.stack([head[k] for head in heads])
        look.served = tf.math.floordiv(tf.concat([body[k] for body in bodies], 0), num_ranks)
        op = ops[k][1]
        rows = tf_shim.resource_gather(look.variable.handle, look.served, dtype=op.outputs[0].dtype,
                                       name=op.name + "_served")
        served_rows.append(rows)
    returned = pack.unpack(pack.send(served_rows, [look.served_counts for look in lookups], "rows"),
                           [look.counts for look in lookups])
    for k, look in enumerate(lookups):
        ids, looked_up = ops[k][1].inputs[1], ops[k][1].outputs[0]
        distinct_rows = tf.gather(returned[k], tf.math.invert_permutation(look.order))
        expanded = tf.reshape(tf.gather(distinct_rows, look.position),
                              tf.concat([tf.shape(ids), tf.constant(look.row_shape, tf.int32)], 0))
        expanded.set_shape(looked_up.shape)
        rewire(looked_up, expanded, set(looked_up.consumers()))
        expansions[served_rows[k].op] = (expanded, ids, look)
    return expansions
