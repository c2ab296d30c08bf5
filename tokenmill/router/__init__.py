"""`tokenmill router`: an OpenAI-compatible gateway over several tokenmill (or vLLM) replicas, routing on the
engine's own KV block hashes (tokenmill/engine/block_hash.py) fed by each replica's KV events."""
