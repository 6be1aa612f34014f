"""One module per strategy, each with a single entry point `rewrite(build) -> DistributedGraph`."""
from rewriters import allreduce, dsp, hybrid, ps, ps_plus, slim_dp, stanza

# auto: the cost model picks PS or AllReduce per variable; the result is a hybrid plan.
REWRITERS = {"hybrid": hybrid.rewrite, "ps": ps.rewrite, "allreduce": allreduce.rewrite, "auto": hybrid.rewrite,
             "slim_dp": slim_dp.rewrite, "ps_plus": ps_plus.rewrite, "stanza": stanza.rewrite,
             "dsp": dsp.rewrite}
