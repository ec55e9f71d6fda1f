"""Step schedules over several calls: a group's prompt once across its micro-batches (``prefix_once``)."""

from .prefix_once import PrefixOnceStats, last_stats, prefix_once_step

__all__ = ["PrefixOnceStats", "last_stats", "prefix_once_step"]
