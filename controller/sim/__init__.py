"""The simulated edge: the real controller on a virtual clock (`goodput simulate`)."""
