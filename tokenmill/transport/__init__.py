"""The bottom layer's links: the gateway-worker socket pair, ZeroMQ served by an event loop, CURVE keys."""
