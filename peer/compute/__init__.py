"""A replica's training: the stage worker (worker.py) and its parts: the compute thread and its rate,
the forward and backward passes, the gate and quota, the round tally, held commits, lookahead, an
overlapped round's mean in flight, the evaluation copy; the inner optimiser and the learning-rate
schedule."""
