"""What runs inside vLLM: the QuillCache KV connector (`connector.QuillCacheConnector`) and its pool client."""
