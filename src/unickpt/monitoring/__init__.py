"""Monitoring: per-rank, per-phase events of saves and loads, sinks and views."""

from .events import PHASES, Event, add_listener, clear_listeners, emit, phase, remove_listener

__all__ = ["PHASES", "Event", "add_listener", "clear_listeners", "emit", "phase", "remove_listener"]
