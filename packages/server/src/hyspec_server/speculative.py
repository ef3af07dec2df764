"""The one place speculative decoding plugs into the server.

hyspec_spec_workers will turn a vLLM-style `speculative_config` dict into a drafter and verifier here, and
the engine builder will pass the result to the model runner. Until then only None (plain decoding) is valid.
"""

from __future__ import annotations

import json
from typing import Any


def parse_speculative_config(config: dict[str, Any] | str | None) -> None:
    """Validates `speculative_config` (a dict, or its JSON text from the CLI). Returns the parsed config.

    Raises ValueError for anything but None (or "null"/"" from the CLI) while speculation is not wired in.
    """
    if isinstance(config, str):
        text = config.strip()
        if text in ("", "null", "none", "None"):
            return None
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg})") from e
    if config is None:
        return None
    raise ValueError(
        f"speculative_config: speculative decoding is not available in this build yet "
        f"(hyspec_spec_workers is not wired into the server); pass None, got {config!r}"
    )
