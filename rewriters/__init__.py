"""One module per strategy, each with a single entry point `rewrite(build) -> DistributedGraph`."""
from rewriters import allreduce, hybrid, ps

REWRITERS = {"hybrid": hybrid.rewrite, "ps": ps.rewrite, "allreduce": allreduce.rewrite}
