"""QuillCache store service."""
