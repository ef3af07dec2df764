"""`LLM`: the offline Python API, mirroring vLLM's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from hyspec_server.config import DType, EngineArgs
from hyspec_server.engine import LLMEngine
from hyspec_server.outputs import RequestOutput
from hyspec_server.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """Generate from a local checkpoint.

    Example:
        llm = LLM(model="/path/to/ckpt", device="cpu")
        out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        print(out[0].outputs[0].text)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "cpu",
        dtype: DType = "auto",
        speculative_config: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        enforce_eager: bool = False,
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        seed: int = 0,
    ) -> None:
        from hyspec_server.builder import build_engine

        args = EngineArgs(
            model=model,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager,
            speculative_config=speculative_config,
            kv_cache_bytes=kv_cache_bytes,
            page_size=page_size,
            seed=seed,
        )
        self.engine = build_engine(args)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wraps an already built engine (tests use this with the toy runner)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; one output per prompt, in order.

        Args:
            prompts: a string, a `{"prompt_token_ids": [...]}` dict, or a list of either.
            sampling_params: one for all prompts, one per prompt, or None for the defaults.
        """
        items: list[PromptType] = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params: expected 1 or {len(items)} entries, got {len(params)}")
        eng = self.engine
        ids: list[str] = []
        try:
            for item, p in zip(items, params):
                ids.append(eng.add_request(_prompt_of(item), p))
            final: dict[str, RequestOutput] = {}
            while len(final) < len(ids):
                for out in eng.step():
                    if out.finished:
                        final[out.request_id] = out
                if not eng.has_unfinished() and len(final) < len(ids):
                    raise RuntimeError("engine went idle before every request finished")
        except BaseException:
            for rid in ids:
                eng.abort(rid)
            raise
        now = time.monotonic()
        for out in final.values():
            out.metrics.finished_time = out.metrics.finished_time or now
        return [final[rid] for rid in ids]

    def leak_check(self) -> None:
        self.engine.leak_check()


def _prompt_of(item: PromptType) -> str | list[int]:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("prompt_token_ids must be a list of ints")
            return ids
        if "prompt" in item and isinstance(item["prompt"], str):
            return str(item["prompt"])
    raise ValueError(f"prompts: expected a string or {{'prompt_token_ids': [...]}}, got {item!r}")
