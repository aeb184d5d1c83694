"""Block identity: the one place that turns a request into block keys (tokenizing, chat rendering, the identity digest, chained block hashes)."""
