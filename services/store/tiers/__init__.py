"""A store node's tiers: DRAM (pooled buffers, LRU) in front of the crash-consistent LMDB SSD tier."""
