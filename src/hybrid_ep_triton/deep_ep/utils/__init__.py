"""``deep_ep.utils``: the events (``deep_ep.utils.event``), where DeepEP's clients import them."""

from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
