"""Monitoring: per-rank, per-phase events of saves and loads, delivered to a checkpointer's bus;
sinks (JSON-lines files, a log line per checkpoint) and ``report`` (heat map, trace, stragglers)."""

from .events import NO_EVENTS, PHASES, Event, EventBus, Listener, Phase
from .sinks import JsonlSink, Record, SummaryLogger

__all__ = ["PHASES", "Event", "EventBus", "Listener", "Phase", "NO_EVENTS", "JsonlSink", "SummaryLogger", "Record"]
