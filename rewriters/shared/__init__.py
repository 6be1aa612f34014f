"""Graph machinery every technique uses: model_fn rebuilt under a placement (rebuild), the
model's gradient transform rewired (transform), pruning, copies, collectives between unequal
graphs (exchange), the synchronous step's report (step_report)."""
