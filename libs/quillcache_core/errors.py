"""Domain errors. Services map them to gRPC status codes and HTTP bodies in one place each."""


class QuillCacheError(Exception):
    """Base of every domain error."""


class InvalidArgument(QuillCacheError):
    """The caller sent something malformed or out of range."""


class NotFound(QuillCacheError):
    """The named block, engine, node or reservation does not exist."""


class CapacityExceeded(QuillCacheError):
    """A budget (bytes, blocks, request size) would be exceeded."""


class NodeUnavailable(QuillCacheError):
    """A node that should serve the call is down or unreachable."""


class Corrupt(QuillCacheError):
    """Stored bytes failed their checksum."""
