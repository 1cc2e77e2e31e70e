"""The errors every call raises: :class:`Error` (or a subclass) carrying the C++ message."""

from ._core import Error, LayoutError, RefitNotCommitted, TransportError

__all__ = ["Error", "LayoutError", "TransportError", "RefitNotCommitted"]
