"""Engine with continuous batching, OpenAI-compatible HTTP server, CLI and Python API."""

__version__ = "0.1.0"
