"""QuillCache gateway service."""
