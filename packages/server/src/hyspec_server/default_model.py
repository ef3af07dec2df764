"""The embedded default model: a tiny random checkpoint built on first use, until a trained demo ships.

It is built deterministically (`hyspec_models.tiny.build_tiny_checkpoint`, seed 0) into
`$HYSPEC_HOME/default-model-<arch>` (default `~/.cache/hyspec`). The build goes to a temporary folder that is
renamed into place, so concurrent first uses never see a half-written checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_ARCH = "lfm2"
DEFAULT_SEED = 0


def hyspec_home() -> Path:
    env = os.environ.get("HYSPEC_HOME")
    return Path(env) if env else Path.home() / ".cache" / "hyspec"


def default_model_dir(arch: str = DEFAULT_ARCH, *, home: Path | None = None) -> Path:
    """The default checkpoint's directory, built on first use."""
    root = home if home is not None else hyspec_home()
    target = root / f"default-model-{arch}-seed{DEFAULT_SEED}"
    if (target / "config.json").is_file():
        return target
    from hyspec_models.tiny import build_tiny_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build_tiny_checkpoint(tmp, arch, seed=DEFAULT_SEED)
        try:
            tmp.rename(target)
        except OSError:
            # another process won the race; its checkpoint is identical
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
