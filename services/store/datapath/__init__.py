"""The block-data path: raw TCP block bytes between stores and from clients (framing, the port, pulls, puts, pooled connections)."""
