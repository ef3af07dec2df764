"""Per-request memory of a hybrid model: typed index spaces, request table, paged KV pool, recurrent-state pools, verify scratch, commit math and pool sizing."""

__version__ = "0.1.0"
