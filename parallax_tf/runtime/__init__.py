"""Runtime: ranks, servers, sessions and the training loop. No graph rewriting here."""
