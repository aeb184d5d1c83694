"""Message shapes that cross a process boundary outside protobuf: packed plan hashes, the plan an engine receives, tier mapping to and from proto."""
