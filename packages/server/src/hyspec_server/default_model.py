"""The embedded default model: the trained Qwen3.5-architecture demo model shipped in `demo_models/`.

`demo_models/` holds small real models trained on Python source code by `tools/train_demo.py` (their
README says how, on which device, and how well they do):

- `qwen3_5`: Qwen3.5 architecture (Gated DeltaNet + gated attention) with one built-in MTP layer;
- `qwen3_5-eagle3`, `qwen3_5-dflash`: an EAGLE-3 and a DFlash drafter trained against it;
- `lfm2`: LFM2 architecture (short convolutions + attention), with `lfm2-eagle3`.

With no model argument, `LLM()`, `hyspec generate` and `hyspec serve` load `qwen3_5` with MTP speculation
(hyspec_runner's `config.DEFAULT_SPECULATIVE_CONFIG`) unless a speculative config is given. To run the demo
model without speculation, pass its directory (`default_model_dir()`) as the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

DEMO_MODELS: Final = Path(__file__).resolve().parent / "demo_models"
DEFAULT_NAME: Final = "qwen3_5"


def demo_model_dir(name: str) -> Path:
    """The directory of the shipped demo model `name` (qwen3_5, qwen3_5-eagle3, qwen3_5-dflash, lfm2, ...)."""
    path = DEMO_MODELS / name
    if not (path / "config.json").is_file():
        have = sorted(p.name for p in DEMO_MODELS.iterdir() if p.is_dir()) if DEMO_MODELS.is_dir() else []
        raise ValueError(f"name: no demo model {name!r} (shipped: {', '.join(have) or 'none'})")
    return path


def default_model_dir() -> Path:
    """The embedded default model's directory."""
    return demo_model_dir(DEFAULT_NAME)
