"""Per-layer hybrid routing (full attention, GDN, short conv), forward-mode metadata, and the single commit after verify."""

__version__ = "0.1.0"
