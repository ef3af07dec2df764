"""`LLM`: the offline Python API, mirroring vLLM's."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hyspec_runner.config import engine_args_from

from hyspec_server.engine import LLMEngine, parse_prompt
from hyspec_server.outputs import RequestMetrics, RequestOutput, SpecDecodeStats
from hyspec_server.sampling_params import RequestOutputKind, SamplingParams, derived_seed
from hyspec_server.tokenizer import ChatOptions, content_text

PromptType = str | dict[str, Any]


class LLM:
    """Generate from a local checkpoint.

    Example:
        llm = LLM(model="/path/to/ckpt", device="cpu")
        out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """Args:
        model: checkpoint directory, cached hub id, or None for the embedded demo model.
        **kwargs: engine arguments by vLLM's names (`EngineArgs`: device, dtype, max_model_len,
            max_num_seqs, gpu_memory_utilization, speculative_config, enable_prefix_caching, ...); a name
            hyspec does not have raises TypeError, saying why when vLLM has it.
        """
        from hyspec_server.builder import build_engine

        self._engine: LLMEngine | None = build_engine(engine_args_from(model, kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wraps an already built engine (tests use this with the toy runner)."""
        llm = cls.__new__(cls)
        llm._engine = engine
        return llm

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        return self._engine

    def close(self) -> None:
        """Frees the engine and its device memory (weights, KV cache and state pool, CUDA graphs, drafter),
        so that another `LLM` fits in this process; the LLM cannot be used afterwards. Idempotent; also run
        on leaving a `with LLM(...) as llm:` block."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        on_cuda = engine.runner.device.type == "cuda"
        del engine
        gc.collect()  # the runner's graphs, pool and model reference each other
        if on_cuda:
            import torch

            # cuBLAS keeps a workspace per stream the graphs were captured on, outside any tensor
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation-config defaults (what `sampling_params=None`
        uses), as vLLM's."""
        return SamplingParams(**self.engine.default_sampling)

    def get_tokenizer(self) -> Any:
        """The tokenizer: the transformers one for a checkpoint (as vLLM's `LLM.get_tokenizer`)."""
        tok = self.engine.tokenizer
        return getattr(tok, "hf_tokenizer", tok)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation (a list of `{"role", "content"}` messages) or
        to each of a list of conversations, through the tokenizer's chat template (as vLLM's `LLM.chat`;
        `chat_template_kwargs` reach the template, for example Qwen's `enable_thinking`; `chat_template`
        replaces the tokenizer's)."""
        if isinstance(messages, Mapping | str) or not messages:
            raise ValueError(
                "messages: expected a conversation (a list of {'role': ..., 'content': ...} dicts) or a list "
                f"of conversations, got {type(messages).__name__ if messages else 'nothing'}"
            )
        options = ChatOptions(
            add_generation_prompt, continue_final_message, chat_template_kwargs, chat_template
        )
        if tools is not None and (
            isinstance(tools, Mapping | str) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError(f"tools: expected a list of tool dicts (OpenAI's format), got {tools!r:.80}")
        convs: list[Sequence[Any]] = (
            [messages] if isinstance(messages[0], Mapping) else [list(c) for c in messages]
        )
        prompts: list[PromptType] = []
        for i, conv in enumerate(convs):
            if not conv or not all(_is_message(m) for m in conv):
                raise ValueError(
                    f"messages[{i}]: expected a list of {{'role': str, 'content': str or a list of parts}} "
                    "dicts (an assistant message may have tool_calls instead of content)"
                )
            # content parts become one string, as the HTTP server's (and vLLM's) chat does
            msgs = [
                {**m, "content": content_text(m["content"], where=f"messages[{i}][{j}].content")}
                if isinstance(m.get("content"), list | tuple)
                else dict(m)
                for j, m in enumerate(conv)
            ]
            ids = self.engine.tokenizer.apply_chat_template(msgs, tools=tools, options=options)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; one output per prompt, in order.

        Args:
            prompts: a string, a `{"prompt_token_ids": [...]}` or `{"prompt": "..."}` dict (optionally with
                a `"cache_salt"`; with both `prompt` and `prompt_token_ids` the ids are the prompt and the
                text is the output's `prompt`, as vLLM's TokensPrompt), or a list of those. Any other key is
                a ValueError (`engine.PROMPT_KEYS`).
            sampling_params: one for all prompts, one per prompt, or None for the defaults. With `n > 1` a
                prompt runs as n engine requests (sample i seeded `derived_seed(seed, i)`, as the HTTP
                server does) and its output's `outputs` holds the n completions, ordered by `index`.
            use_tqdm: a progress bar (requests done, tokens/s in and out) on stderr, as vLLM shows.
        """
        if isinstance(prompts, str | dict):
            items: list[PromptType] = [prompts]
        elif isinstance(prompts, Iterable) and not isinstance(prompts, bytes | Mapping):
            items = list(prompts)
        else:
            raise ValueError(
                f"prompts: expected a string, a prompt dict or a list of those, got {type(prompts).__name__}"
            )
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        elif isinstance(sampling_params, list | tuple) and all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(
                    f"sampling_params: a list of them needs one per prompt ({len(items)}), got "
                    f"{len(params)}; pass one SamplingParams to use it for every prompt"
                )
        else:
            raise ValueError(
                "sampling_params: expected a SamplingParams, a list of them or None, got "
                f"{type(sampling_params).__name__}"
            )
        eng = self.engine
        # per prompt, the engine request ids of its samples 0..n-1 and the id of the merged output
        groups: list[tuple[str, list[str]]] = []
        ids: list[str] = []
        try:
            for i, (item, p) in enumerate(zip(items, params)):
                try:
                    groups.append(self._add(item, p, ids))
                except ValueError as e:
                    if len(items) == 1:
                        raise
                    raise ValueError(f"prompts[{i}]: {e}") from e  # which prompt of the batch
            final: dict[str, RequestOutput] = {}
            bar = _progress(len(ids)) if use_tqdm else None
            while len(final) < len(ids):
                for out in eng.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.done(out)
                if not eng.has_unfinished() and len(final) < len(ids):
                    raise RuntimeError("engine went idle before every request finished")
        except BaseException:
            for rid in ids:
                eng.abort(rid)
            raise
        if bar is not None:
            bar.close()
        now = time.monotonic()
        for out in final.values():
            out.metrics.finished_time = out.metrics.finished_time or now
        return [
            final[sids[0]] if len(sids) == 1 and sids[0] == gid else _merge(gid, [final[r] for r in sids])
            for gid, sids in groups
        ]

    def _add(self, item: PromptType, p: SamplingParams, ids: list[str]) -> tuple[str, list[str]]:
        """Queues one prompt's engine requests (n of them), every id appended to `ids` as it is queued ->
        (the prompt's output id, its samples' request ids). Not bounded by `max_waiting`: an offline call
        queues all of its prompts; a request whose max_tokens runs past the context stops at its end (vLLM's
        `LLM`)."""
        eng = self.engine
        prompt, salt = parse_prompt(item)  # once, though n requests take it
        if p.output_kind is not RequestOutputKind.FINAL_ONLY:
            # `generate` returns final outputs only: the engine then builds none for the steps before
            p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
        if p.n == 1:
            rid = eng.add_request(prompt, p, cache_salt=salt, bounded=False, stop_at_context_end=True)
            ids.append(rid)
            return rid, [rid]
        base = eng.new_request_id()
        sample_ids: list[str] = []
        for j in range(p.n):
            # n=1 requests to the engine, seeded like the HTTP server's samples
            one = dataclasses.replace(p, n=1, seed=derived_seed(p.seed, j))
            sample_ids.append(
                eng.add_request(
                    prompt,
                    one,
                    request_id=f"{base}-{j}",
                    cache_salt=salt,
                    bounded=False,
                    stop_at_context_end=True,
                )
            )
            ids.append(sample_ids[-1])
        return base, sample_ids

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (as vLLM's); False when prefix caching is off."""
        return self.engine.reset_prefix_cache()

    def leak_check(self) -> None:
        self.engine.leak_check()


def _is_message(m: object) -> bool:
    """A chat message the templates can render: a str role and str / list content (an assistant's may be
    None beside its tool_calls)."""
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        return False
    content = m.get("content")
    return isinstance(content, str | list) or (content is None and bool(m.get("tool_calls")))


def _merge(request_id: str, samples: list[RequestOutput]) -> RequestOutput:
    """One prompt's finished samples as one output: completion i is sample i's, with `index` i."""
    first = samples[0]
    outputs = []
    for i, s in enumerate(samples):
        c = s.outputs[0]
        c.index = i
        outputs.append(c)
    firsts = [s.metrics.first_token_time for s in samples if s.metrics.first_token_time is not None]
    ends = [s.metrics.finished_time for s in samples if s.metrics.finished_time is not None]
    metrics = RequestMetrics(
        arrival_time=min(s.metrics.arrival_time for s in samples),
        first_token_time=min(firsts) if firsts else None,
        finished_time=max(ends) if ends else None,
        num_preemptions=sum(s.metrics.num_preemptions for s in samples),
    )
    stats = [s.spec_stats for s in samples if s.spec_stats is not None]
    spec = None
    if stats:
        spec = SpecDecodeStats(
            num_drafts=sum(st.num_drafts for st in stats),
            num_draft_tokens=sum(st.num_draft_tokens for st in stats),
            num_accepted_tokens=sum(st.num_accepted_tokens for st in stats),
        )
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=list(first.prompt_token_ids),
        outputs=outputs,
        finished=all(s.finished for s in samples),
        metrics=metrics,
        spec_stats=spec,
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=first.prompt_logprobs,  # the same prompt in every sample
    )


class _Progress:
    """tqdm over finished requests, with prompt and output tokens/s in its postfix."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.t0 = time.perf_counter()
        self.tokens_in = self.tokens_out = 0

    def done(self, out: RequestOutput) -> None:
        self.tokens_in += len(out.prompt_token_ids)
        self.tokens_out += len(out.outputs[0].token_ids)
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(
            f"input {self.tokens_in / dt:.1f} tok/s, output {self.tokens_out / dt:.1f} tok/s"
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _progress(total: int) -> _Progress | None:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return _Progress(tqdm(total=total, desc="Processed prompts", dynamic_ncols=True))
