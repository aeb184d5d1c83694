"""QuillCache conductor service."""
