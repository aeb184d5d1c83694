"""Generated protobuf packages (quillcache.v1)."""
