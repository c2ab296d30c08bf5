"""Speculative decoding (--speculative-config): proposers guess the next tokens, the target model verifies them
all in one forward pass inside the normal step, and exact rejection sampling keeps the output distribution.

The flag is SpeculativeConfig (tokenmill/config.py); ngram_proposer.py, suffix_proposer.py: the proposers;
speculator.py: which requests get drafts and the counters; adaptive.py: how many; rejection_sampler.py:
verification. The scheduler schedules a request with k drafts as k + 1 tokens, the runner computes logits at all
of them, and the engine keeps the accepted ones' K/V and frees the rest (kv_cache.KVCacheManager.keep_verified)."""
