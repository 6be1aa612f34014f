"""Stanza's section of the plan: who trains what, and the tensors where the FC head begins.
It prints below the plan's table and travels with it as JSON (Strategy.Section)."""
from __future__ import annotations

import dataclasses
from typing import List

from parallax_tf import routes
from parallax_tf.plan import human_bytes


@dataclasses.dataclass
class CutTensor:
    """A tensor where the FC head begins (Stanza): computed on the conv nodes, sent to an FC node."""
    name: str                   # the tensor in the single-device graph, e.g. "Reshape:0"
    shape: List[int]            # per example (the batch dimension left out); whole for "replicated"
    dtype: str
    bytes_per_example: int      # for "replicated": its bytes per step
    kind: str                   # activation (its gradient goes back) | data (labels) | replicated


@dataclasses.dataclass
class LayerSplit:
    """Stanza: who trains what. The last ranks are FC nodes; each serves a group of conv nodes."""
    conv_ranks: List[int]
    fc_ranks: List[int]
    groups: List[List[int]]     # per FC node, in fc_ranks order: the conv ranks it serves
    cut: List[CutTensor]
    microbatches: int = 1       # each conv node's batch crosses the cut in this many pieces
    # conv nodes send their activations one at a time (one collective per position in a group),
    # so an FC node's port never takes a whole group's at once (TCP incast)
    staggered: bool = False
    sends_reason: str = ""      # why together or staggered

    def group_of(self, rank: int) -> List[int]:
        """The conv ranks of the group `rank` belongs to, its FC node last."""
        for fc, group in zip(self.fc_ranks, self.groups):
            if rank == fc or rank in group:
                return group + [fc]
        raise ValueError(f"rank {rank} is in no group of {self.groups}")

    def lines(self) -> List[str]:
        """What the plan's table shows of the split, below the totals."""
        lines = [f"FC nodes {self.fc_ranks}, conv nodes {self.conv_ranks}; "
                 + "; ".join(f"rank {fc} serves {group}" for fc, group in zip(self.fc_ranks, self.groups))
                 + (f"; {self.microbatches} micro-batches per step" if self.microbatches > 1 else "")
                 + ("; conv nodes send one at a time (staggered)" if self.staggered else "")]
        if self.sends_reason:
            lines.append(f"sends: {self.sends_reason}")
        for t in self.cut:
            per = "per step, sent by one conv node" if t.kind == "replicated" else "per example"
            lines.append(f"cut: {t.name} [{'x'.join(map(str, t.shape)) or 'scalar'}] {t.dtype} "
                         f"{human_bytes(t.bytes_per_example)} {per} ({t.kind})")
        return lines

    @classmethod
    def from_dict(cls, raw: dict) -> "LayerSplit":
        raw = dict(raw)
        return cls(cut=[CutTensor(**t) for t in raw.pop("cut")], **raw)


class FCNode(routes.Route):
    name = "fc_node"
    summary = ("Stanza: a variable of the FC head, trained on the FC nodes from the conv nodes' activations "
               "(params['ranks']: the FC nodes); the plan's section says who serves whom")


ROUTE_FC_NODE = routes.register(FCNode()).name
