"""``deep_ep.buffers.legacy``: DeepEP V1's Buffer, Config and events, as DeepEP names them."""

from ..buffer import Buffer
from ..config import Config
from ..utils.event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
