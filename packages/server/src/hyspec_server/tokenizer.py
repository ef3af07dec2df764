"""The tokenizer seam: what the engine and the HTTP server need from a tokenizer, and the HF adapter."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


def content_text(content: object, *, where: str = "messages") -> str:
    """A chat message's content as the templates take it: a string as is, None as "", a list of OpenAI
    content parts as their texts joined (`LLM.chat` and the HTTP server alike, as vLLM); ValueError
    naming `where` for a part that is not text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content if isinstance(content, list | tuple) else [content]:
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ValueError(f"{where}: only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a chat template renders a conversation (vLLM's request fields).

    Args:
        add_generation_prompt: end ready for the assistant's turn.
        continue_final_message: leave the last message open for the model to continue (not with the above).
        template_kwargs: extra template variables (Qwen's `enable_thinking`).
        chat_template: a Jinja template to render with instead of the tokenizer's (vLLM's `chat_template`).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        template = self.chat_template
        if template is not None and (not isinstance(template, str) or not template):
            raise ValueError("chat_template: expected a non-empty Jinja template string")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message cannot both be true; set "
                "add_generation_prompt=False to continue the final message"
            )
        kwargs = self.template_kwargs
        if kwargs is not None and (
            not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)
        ):
            raise ValueError(
                "chat_template_kwargs: expected a dict of template variables by name, got "
                f"{type(kwargs).__name__}"
            )
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(self.template_kwargs or {}))
        if clash:
            raise ValueError(
                f"chat_template_kwargs: {clash} are the request's own fields or the renderer's arguments, "
                "not template variables; set them as request fields"
            )


# keyword arguments `apply_chat_template` takes itself: a template variable of the same name would clash
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


DEFAULT_CHAT_OPTIONS = ChatOptions()  # frozen: one shared default

# a rendered conversation may hold at most this many characters per character of its messages, tools and
# template variables, plus RENDER_CHARS_EXTRA (the template's own text): beyond that it is refused before
# it is tokenized (a template like "{{ 'a' * 10**8 }}" would hold a worker for minutes)
RENDER_CHARS_PER_INPUT_CHAR = 4
RENDER_CHARS_EXTRA = 1 << 20


def _chars(*parts: object) -> int:
    """Characters of the JSON of a conversation's parts (what a template may render)."""
    return sum(len(json.dumps(p, default=str, ensure_ascii=False)) for p in parts if p is not None)


class Tokenizer(Protocol):
    """Text <-> token ids. `eos_token_ids` end generation unless `ignore_eos`."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def stop_eos_token_ids(self) -> frozenset[int]:
        """The EOS ids beyond the tokenizer's own (a checkpoint's generation_config.json / config.json): as
        vLLM's, they end a request as its stop token ids do, and a request one ends names it as its
        `stop_reason` (the tokenizer's own EOS: None)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; with `add_special_tokens` the tokenizer's own (BOS where it adds one), as
        vLLM encodes completions prompts. Rendered chat templates pass False: they hold theirs already."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT_OPTIONS,
    ) -> list[int]:
        """The prompt of a conversation (`tools`: what the assistant may call), rendered as `options` say."""
        ...


def _eos_ids(value: object) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


class HFTokenizer:
    """Wraps `transformers.AutoTokenizer` loaded offline from a checkpoint directory.

    EOS ids are the union of the tokenizer's `eos_token_id` and `eos_token_id` in `generation_config.json` and
    `config.json`, as transformers' `generate` would stop on any of them.
    """

    def __init__(self, model_dir: str | Path, *, tokenizer: str | Path | None = None) -> None:
        """`tokenizer`: a directory holding another tokenizer (vLLM's `tokenizer` argument); EOS ids still
        come from the model's configs too."""
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        source = self.model_dir if tokenizer is None else Path(tokenizer).expanduser()
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        except OSError as e:
            raise ValueError(f"tokenizer: cannot load a tokenizer from {str(source)!r}: {e}") from None
        own = frozenset(_eos_ids(self._tok.eos_token_id))
        eos = set(own)
        vocab: object = None
        for name in ("generation_config.json", "config.json"):
            path = self.model_dir / name
            if path.is_file():
                cfg = json.loads(path.read_text())
                eos |= _eos_ids(cfg.get("eos_token_id"))
                eos |= _eos_ids(cfg.get("text_config", {}).get("eos_token_id"))
                if name == "config.json":
                    vocab = cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size"))
        self._eos = frozenset(eos)
        self._stop_eos = frozenset(eos - own)
        # the model's embedding rows (may exceed the tokenizer's length); the HTTP server rejects token-id
        # prompts outside [0, vocab_size) instead of failing the whole batch's step
        self.vocab_size: int = vocab if isinstance(vocab, int) and vocab > 0 else len(self._tok)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def stop_eos_token_ids(self) -> frozenset[int]:
        return self._stop_eos

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer (structured outputs build their vocabulary tables from it)."""
        return self._tok

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT_OPTIONS,
    ) -> list[int]:
        import jinja2  # transformers renders chat templates with it

        if options.chat_template is None and getattr(self._tok, "chat_template", None) is None:
            raise ValueError(f"the tokenizer in {self.model_dir} has no chat template; pass chat_template")
        try:
            text = self._tok.apply_chat_template(
                list(messages),
                chat_template=options.chat_template,
                tools=tools,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                **dict(options.template_kwargs or {}),
            )
        except RecursionError as e:
            raise ValueError("the chat template's input is nested too deeply to render") from e
        except jinja2.TemplateError as e:  # a request's template that does not parse, or an undefined name
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
        except TypeError as e:  # a template variable of the wrong type, or an unexpected argument
            raise ValueError(f"the chat template could not render this conversation: {e}") from e
        except Exception as e:  # anything a template's own code raises (1/0, the sandbox's range limit)
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
        text = str(text)
        # a template may multiply strings: its text is tokenized only when it is of the conversation's order
        budget = (
            RENDER_CHARS_PER_INPUT_CHAR * _chars(messages, tools, options.template_kwargs)
            + RENDER_CHARS_EXTRA
        )
        if len(text) > budget:
            raise ValueError(
                f"the chat template failed: it rendered {len(text)} characters from this conversation, more "
                f"than the {budget} it may (a template that repeats its input)"
            )
        return self.encode(text, add_special_tokens=False)
