"""QuillCache transfer service."""
