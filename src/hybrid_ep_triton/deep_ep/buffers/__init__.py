"""``deep_ep.buffers``: where DeepEP keeps its V1 Buffer (``deep_ep.buffers.legacy``)."""

from . import legacy

__all__ = ["legacy"]
