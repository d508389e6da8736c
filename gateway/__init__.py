"""The HTTP gateway: a uvloop event loop that only moves bytes between clients, workers and the scheduler."""
