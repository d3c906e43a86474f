"""A replica's training: the worker's compute thread, held commits, the inner optimiser, lookahead, the learning-rate schedule."""
