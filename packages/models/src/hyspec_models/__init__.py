"""Qwen3-Next, Qwen3.5 (dense, MoE), LFM2, LFM2-MoE and their MTP drafts; HF-format checkpoint loading."""

__version__ = "0.1.0"
