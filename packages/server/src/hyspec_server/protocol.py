"""OpenAI request bodies (pydantic, strict types) and the OpenAI error body."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# re-exported: the HTTP server and `LLM.generate` share the cap and the per-sample seeds
from hyspec_server.sampling_params import MAX_LOGPROBS as MAX_LOGPROBS
from hyspec_server.sampling_params import MAX_N as MAX_N
from hyspec_server.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from hyspec_server.sampling_params import derived_seed as derived_seed
from hyspec_server.tokenizer import content_text
from hyspec_server.tool_calls import check_tools


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer (`APIError.body`), as declared in /openapi.json."""

    error: ErrorInfo


class _Strict(BaseModel):
    # strict: "5" is not an int and 1 is not a bool; unknown fields are ignored like OpenAI's SDK extras
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Strict):
    # optional, as in vLLM: None is the served model
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0  # vLLM extension
    # accepted for compatibility and not used
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM extension: the only token ids the request may generate
    allowed_token_ids: list[int] | None = None
    # vLLM extension: words the request may not generate
    bad_words: list[str] | None = None
    # vLLM extensions
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # hyspec extension (as in vLLM): return the generated token ids in each choice
    return_token_ids: bool = False
    # vLLM extension: tokens in `logprobs` named "token_id:<id>" (a token that is not valid UTF-8 alone,
    # part of a multi-byte character, is then still told apart)
    return_tokens_as_token_ids: bool = False
    # vLLM extension: logprobs of every prompt token (top-k per position), in the response (not streamed)
    prompt_logprobs: int | None = None
    # vLLM extension: requests with different salts share no prefix-cache entry
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM extension: keep only the prompt's last k tokens (-1: the last max_model_len)
    truncate_prompt_tokens: int | None = None
    # OpenAI's (vLLM takes it on completions too) and vLLM's extra field for the other constraints
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's earlier names for structured outputs' json / regex / choice / grammar (scripts still send them)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM fields that would change the output and that hyspec does not implement: refused (400), where
    # ignoring them would return output the request did not ask for
    logits_processors: Any = None
    use_beam_search: Any = None

    def guided(self) -> dict[str, Any]:
        """The `guided_*` fields given, by structured-output kind ("json", "regex", "choice", "grammar")."""
        given = (
            ("json", self.guided_json),
            ("regex", self.guided_regex),
            ("choice", self.guided_choice),
            ("grammar", self.guided_grammar),
        )
        return {kind: value for kind, value in given if value is not None}

    def structured(self) -> StructuredOutputsParams | None:
        """The request's constraint, from `response_format` or `structured_outputs` (not both); APIError 400
        naming the field when it is malformed."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.get("type", "text") != "text" and so is not None:
            raise APIError(
                400, "give response_format or structured_outputs, not both", param="structured_outputs"
            )
        guided = self.guided()
        if guided:
            param = f"guided_{next(iter(guided))}"
            if so is not None or (rf is not None and rf.get("type", "text") != "text"):
                raise APIError(
                    400, f"give {param} or structured_outputs / response_format, not both", param=param
                )
            try:
                return StructuredOutputsParams(**guided)
            except (TypeError, ValueError) as e:
                raise APIError(400, f"{param}: {e}", param=param) from e
        try:
            if so is not None:
                return StructuredOutputsParams(**so)
            if rf is None or rf.get("type", "text") == "text":
                return None
            kind = rf.get("type")
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True)
            if kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format.json_schema.schema: expected a JSON schema object")
                return StructuredOutputsParams(json=schema)
            raise ValueError(
                f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}"
            )
        except (TypeError, ValueError) as e:
            param = "structured_outputs" if so is not None else "response_format"
            raise APIError(400, f"{param}: {e}" if param not in str(e) else str(e), param=param) from e

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def check_common(self) -> None:
        """Raises APIError for values the server does not support (types were checked by pydantic)."""
        if not 1 <= self.num_choices <= MAX_N:
            raise APIError(400, f"n must be an int in [1, {MAX_N}], got {self.n}", param="n")
        for name in ("logits_processors", "use_beam_search"):
            value = getattr(self, name)
            if value is not None and value is not False and value != []:
                raise APIError(400, f"{name} is not supported by hyspec", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise APIError(
                    400, f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}]", param="prompt_logprobs"
                )
            if self.stream:
                raise APIError(400, "prompt_logprobs cannot be streamed, as in vLLM", param="prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: only together with include_usage (as vLLM's)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        seed: int | None,
        defaults: Mapping[str, Any] = MappingProxyType({}),
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the field. `seed` is this sample's (see `derived_seed`); `defaults` (the
        checkpoint's generation config) fill temperature, top_p, top_k, min_p and repetition_penalty when
        the request leaves them out. `prompt_logprobs`: completions' `echo` with `logprobs`."""

        def pick(name: str, value: Any, fallback: Any) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", self.temperature, 1.0),
            top_p=pick("top_p", self.top_p, 1.0),
            top_k=pick("top_k", self.top_k, -1),
            min_p=pick("min_p", self.min_p, 0.0),
            seed=seed,
            # empty stop strings match nowhere: "" and [""] both mean no stop string
            stop=([s for s in self.stop if s] or None)
            if isinstance(self.stop, list)
            else (self.stop or None),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty, 1.0),
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            min_tokens=self.min_tokens,
            structured_outputs=self.structured(),
            # a response that is not streamed is written once, from the final output: the engine builds
            # none for the steps before (and the reader is not woken per step)
            output_kind=RequestOutputKind.CUMULATIVE if self.stream else RequestOutputKind.FINAL_ONLY,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids; 400 naming the field when one is not an id."""
        if not self.logit_bias:
            return None
        # plain ASCII digits only: int() would also take "5_0", " 5" or other scripts' digits
        bad = next((k for k in self.logit_bias if not (k.isascii() and k.isdigit())), None)
        if bad is not None:
            raise APIError(400, f"logit_bias: keys must be token ids, got {bad!r}", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's: a text prompt is encoded with the tokenizer's own special tokens (its BOS) unless False (a
    # client that put them in the text already)
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string, one token-id list, or a list of either (at least one)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        out: list[str | list[int]] = []
        ids: list[int] = []
        for x in p:
            if isinstance(x, int):
                ids.append(x)
            else:
                out.append(x if isinstance(x, str) else list(x))
        # pydantic's union makes the list all ints, all strings or all lists
        return [ids] if ids else out


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # as `LLM.chat` takes them: only an assistant's message may carry tool_calls instead of content
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (an assistant message may have tool_calls instead)")
        return self

    def text(self) -> str:
        return content_text(self.content)


class ChatPromptFields(_Strict):
    """What renders a conversation into a prompt: `/v1/chat/completions` and `/tokenize` with `messages`
    share these fields and one renderer (`api_generate.render_chat_prompt`), so both give the same tokens
    and refuse the same input."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM extensions: how the chat template renders the conversation
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: only when the server trusts request templates (--trust-request-chat-template)
    chat_template: str | None = None

    def check_tools(self) -> list[str]:
        """Validates the tools; returns the function names a grammar must force (tool_choice "required" or
        named; empty for "auto" / "none"); 400 naming `tools` / `tool_choice`."""
        try:
            _, names = check_tools(self.tools, self.tool_choice)
        except ValueError as e:
            param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
            raise APIError(400, str(e), param=param) from e
        return names

    @property
    def parses_tools(self) -> bool:
        """Tool calls in the output become `tool_calls` (tools given, tool_choice not "none"); the tools
        reach the chat template only then."""
        return bool(self.tools) and self.tool_choice != "none"


class ChatCompletionRequest(_SamplingFields, ChatPromptFields):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool = True
    # vLLM extension: the reply starts with the last message's text when that message has the reply's role
    # (a continued assistant message: add_generation_prompt false, continue_final_message true)
    echo: bool = False

    @property
    def reply_role(self) -> str:
        """The reply's role, as vLLM's: "assistant" after a generation prompt, else the last message's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self) -> str:
        """What `echo` puts before each reply: the last message's text when it has the reply's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.reply_role else ""

    def check_forced(self, names: list[str]) -> None:
        """400 when a forced call (`names`, from `check_tools`) meets a response format (`response_format`,
        `structured_outputs` or a `guided_*` field): both are grammars, and one would silently replace the
        other."""
        if names and (
            self.structured_outputs is not None
            or (self.response_format or {}).get("type", "text") != "text"
            or self.guided()
        ):
            raise APIError(
                400,
                "tool_choice that forces a call cannot be combined with a response format",
                param="tool_choice",
            )


class TokenizeChatRequest(ChatPromptFields):
    """vLLM's `/tokenize` body with `messages` (its `TokenizeChatRequest`)."""

    model: str | None = None
    # vLLM's: special tokens on top of the template's own; hyspec renders chat as its chat completions do
    # (the template's tokens only), so only False is taken
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
