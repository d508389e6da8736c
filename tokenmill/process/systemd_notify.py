"""systemd's notify protocol (sd_notify), without libsystemd: one datagram per state change.

Under ``Type=notify`` the service says READY=1 once it can serve, STOPPING=1 when it
starts draining, and WATCHDOG=1 periodically when ``WatchdogSec=`` is set. The watchdog
is petted from the gateway's event loop, so a loop stalled past the deadline gets the
service restarted, which is exactly the failure an operator wants caught.
"""

from __future__ import annotations

import asyncio
import os
import socket


def notify(state: str, environ=os.environ) -> bool:
    """Send ``state`` (e.g. "READY=1") to $NOTIFY_SOCKET; False when not under systemd."""
    path = environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    try:
        # non-blocking: a busy or stuck reader must never stall the event loop; a dropped
        # WATCHDOG=1 is sent again at the next interval
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
            sock.connect(path)
            sock.send(state.encode())
        return True
    except OSError:  # including BlockingIOError when the reader's queue is full
        return False


def watchdog_interval(environ=os.environ) -> float | None:
    """Half of WatchdogSec (from WATCHDOG_USEC), if the watchdog is meant for this process."""
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def pet_watchdog(interval: float) -> None:
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
