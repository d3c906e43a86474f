"""Microbatches through the stages: the stage server, the downstream sender, the driver and its loop, routing, the adaptive window."""
