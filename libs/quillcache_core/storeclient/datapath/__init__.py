"""The block-data protocol's client side: framing (`protocol`), pooled connections
(`conn`), batched puts and gets (`put`, `batch`), blocking socket I/O (`sockets`)."""
