"""Monitoring: per-rank, per-phase events of saves and loads, delivered to a checkpointer's bus."""

from .events import NO_EVENTS, PHASES, Event, EventBus, Listener, Phase

__all__ = ["PHASES", "Event", "EventBus", "Listener", "Phase", "NO_EVENTS"]
