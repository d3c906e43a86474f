"""A stage's state: θ_global and its outer optimiser, state sync for joiners and re-syncs, backups held by
other stages, the replica's phase (which decides whether it serves the state), and the presence
record that announces the replica."""
