"""Real text in: tokenizers, document sources cut into shards, packing into training windows,
the document-level validation split, and the evaluation units (nats per token, perplexity, bits
per byte). peer/data.py keeps the byte-level path of the standard library's sources; a manifest
that names a tokenizer or a row source (jsonl, parquet, hf-disk) is read through this package."""
