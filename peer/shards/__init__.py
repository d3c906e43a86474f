"""Drivers train disjoint data: the training corpus cut into shards that drivers lease through the
DHT (docs/data.md, "Shards and leases"). `source.py` is what a corpus must offer, `leases.py` the
pure decisions over a snapshot of the drivers' records, `leaser.py` the daemon's side."""
