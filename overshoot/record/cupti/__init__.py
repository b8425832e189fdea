"""Kernel timing through CUPTI: a C shim receives CUPTI's activity buffers (no Python inside CUPTI's
callbacks), numpy parses them off the engine thread (records.py), and CuptiCollector hands kernel rows on the
host clock to the Recorder (record/kernel_timing.py drives it). docs/concepts.md says what it measures and
what it costs."""

from overshoot.record.cupti.collector import CuptiCollector, unavailable_reason

__all__ = ["CuptiCollector", "unavailable_reason"]
