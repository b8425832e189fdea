"""Errors of the recording stage that cross module lines."""


class KernelTimingError(Exception):
    """Kernel timing cannot run here; the message is one line meant for the user."""
