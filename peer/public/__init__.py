"""Public runs: a run named by its manifest's `run_id` and bound to its owner's key
(docs/public-runs.md). `run_name` and `signed_manifest` are pure; `directory` reads and writes the
DHT; `resolve` turns `--run NAME[@FINGERPRINT]` into a verified manifest."""
