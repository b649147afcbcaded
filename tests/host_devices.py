"""XLA_FLAGS for a child process that sees several CPU devices (tensor and expert parallelism)."""

from __future__ import annotations

import os


def xla_flags_with_devices(n: int) -> str:
    """This process's XLA_FLAGS (in a test session, conftest's -O0) with the host device count set to
    ``n``, put last: of a flag given twice, XLA keeps the last."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
