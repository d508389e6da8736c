"""The msgspec-over-ZeroMQ protocol to the GPU scheduler, its async client, and a simulated scheduler."""
