"""Request bodies, as OpenAI, vLLM, shortfin and Anthropic define them (pydantic models FastAPI validates).

Fields a server may not know are ignored, as vLLM does; fields Kiln knows but cannot
honour (tools, beam search...) are rejected by the routes with a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage comes at the end


class DiffusionFields(BaseModel):
    """A diffusion LM's options (refused for an autoregressive model), with dfastllm's and
    dlmserve's spellings as aliases: num_denoising_steps is steps, confidence_threshold is
    threshold, and parallel_decoding turns the threshold rule on (at 0.9 unless given)."""

    model_config = ConfigDict(extra="ignore")

    steps: int | None = None
    num_denoising_steps: int | None = None
    block_length: int | None = None
    remasking: str | None = None
    confidence: str | None = None
    threshold: float | None = None
    confidence_threshold: float | None = None
    parallel_decoding: bool | None = None
    cache: str | None = None
    cfg_scale: float | None = None
    apd_mixture_weight: float | None = None
    apd_kv_window: int | None = None
    apd_max_lookahead: int | None = None


class ResponseFormat(BaseModel):
    """OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}."""

    model_config = ConfigDict(extra="allow")

    type: str = "text"
    json_schema: dict[str, Any] | None = None


class OpenAISampling(DiffusionFields):
    """What /v1/completions and /v1/chat/completions share, with vLLM's extra sampling fields."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    speculative: bool = True  # False: no speculative decoding for this request
    # vLLM's beam search: best_of beams (n when not given), the best n returned.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    # Structured output: OpenAI's response_format, and vLLM's guided_* and structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; Kiln has one engine
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id... reach the template

    # Any role, as vLLM takes it: a chat template may have its own (Llama 3's `ipython`).
    role: str
    content: str | list[Any] | None = None
    name: str | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    # vLLM's extras for the template: continue_final_message leaves the last (assistant) message
    # open for the model to go on with, instead of starting a new one.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    include_reasoning: bool = True  # vLLM's: false leaves reasoning_content out (with --reasoning-parser)


# -- OpenAI's Responses API (/v1/responses) ------------------------------------------------------
# Lists come before strings in the unions below: a list with a bad item then fails on that item
# (`input.0.role: ...`), not on "should be a valid string".

class ResponsesContentPart(BaseModel):
    """Text in an input message: `input_text`, or `output_text` from an earlier reply."""

    model_config = ConfigDict(extra="ignore")  # an earlier reply's annotations and logprobs

    type: Literal["input_text", "output_text"]
    text: str


class ResponsesInputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # an earlier reply's message id and status

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ResponsesContentPart] | str


class ResponsesTextFormat(BaseModel):
    """text.format: {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)  # description: echoed back

    type: str = "text"
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity: a hosted model's option

    format: ResponsesTextFormat = Field(default_factory=ResponsesTextFormat)


class ResponsesRequest(BaseModel):
    """What /v1/responses reads. Nothing is stored, so the fields that refer to stored
    responses or conversations, and function tools, are refused by the route."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: list[ResponsesInputMessage] | str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    store: bool | None = None  # accepted; nothing is stored either way
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    text: ResponsesText | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_reasoning_items(cls, data: Any) -> Any:
        """An earlier reply's `reasoning` items, which OpenAI's clients send back with the
        conversation, are accepted and left out: chat templates drop earlier turns' thinking."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            kept = [item for item in data["input"] if not (isinstance(item, dict) and item.get("type") == "reasoning")]
            if len(kept) != len(data["input"]):
                data = {**data, "input": kept}
        return data


# -- Anthropic's Messages API (/v1/messages) -------------------------------------------------------
# Content blocks by their `type`; fields a block may carry that change nothing here (cache_control,
# citations) are ignored. Blocks that need what a text model cannot read (images, documents) or a
# hosted tool's output are refused by name, so the client learns which block is at fault.

class AnthropicText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class AnthropicToolUse(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResult(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: list[AnthropicText] | str = ""
    is_error: bool = False


class AnthropicThinking(BaseModel):
    """An earlier reply's thinking, which clients send back; chat templates leave it out."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


AnthropicBlock = Annotated[AnthropicText | AnthropicToolUse | AnthropicToolResult | AnthropicThinking,
                           Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: list[AnthropicBlock] | str

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_a_text_model_cannot_read(cls, data: Any) -> Any:
        blocks = data.get("content") if isinstance(data, dict) else None
        for index, block in enumerate(blocks if isinstance(blocks, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("image", "document", "search_result", "container_upload"):
                raise ValueError(f"content.{index}: {kind} blocks are not supported: the model reads text")
        return data


class AnthropicTool(BaseModel):
    """A client tool (Anthropic's `custom`, the default type); hosted tools carry other types and
    no `input_schema`, which is checked once the type is known, so that they are refused by name."""

    model_config = ConfigDict(extra="ignore")

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class AnthropicOutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # effort: a hosted model's option

    format: AnthropicOutputFormat | None = None


class AnthropicMetadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = None


class AnthropicCountTokensRequest(BaseModel):
    """What /v1/messages/count_tokens reads: the prompt's part of a Messages request."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: list[AnthropicText] | str | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None  # the structured-outputs beta's place for it
    service_tier: str | None = None  # accepted; one tier here


# -- llama.cpp's /infill ------------------------------------------------------------------------

class InfillChunk(BaseModel):
    """Another file of the repository, as context for the fill."""

    model_config = ConfigDict(extra="ignore")

    filename: str = "tmp"
    text: str = ""


class InfillRequest(BaseModel):
    """What llama.cpp's /infill reads (as editor plug-ins send it), with llama.cpp's defaults."""

    model_config = ConfigDict(extra="ignore")  # cache_prompt, samplers, response_fields...

    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = Field(default_factory=list)
    prompt: str = ""  # typed at the cursor: goes after the prefix
    n_predict: int = -1  # -1: the rest of the context
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    t_max_predict_ms: int = 0  # 0: none; else the fill stops this long after it began, once it holds a newline


# -- shortfin's /generate (shortfin_apps/llm/components/io_struct.py) -----------------------

class ShortfinSamplingParams(DiffusionFields):
    model_config = ConfigDict(extra="ignore")

    n: int | None = None
    max_completion_tokens: int | None = None
    max_new_tokens: int | None = None  # SGLang's name
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    num_beams: int | None = None
    use_beam_search: bool = False  # with num_beams: a beam search; without, num_beams independent samples
    length_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True
    # SGLang's structured output fields.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: ShortfinSamplingParams | list[ShortfinSamplingParams] = Field(
        default_factory=ShortfinSamplingParams
    )
    rid: str | list[str] | None = None
    return_input_ids: bool = False
    stream: bool = False
    # Accepted as shortfin does; its responses carry text only.
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False


# -- the WebSocket route's messages ------------------------------------------------------------

class SocketGenerate(OpenAISampling):
    """{"type": "generate", "id": ..., "prompt" | "input_ids" | "messages": ..., sampling fields}."""

    type: Literal["generate"]
    id: str | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    logprobs: int | None = None
    add_special_tokens: bool | None = None


class SocketCancel(BaseModel):
    type: Literal["cancel"]
    id: str


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# -- embeddings and scores -------------------------------------------------------------------

class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings, with vLLM's extras (add_special_tokens, truncate_prompt_tokens,
    priority)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True
    # Keep only each input's last k tokens (-1: as many as the context holds); None: refuse a longer one.
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreRequest(BaseModel):
    """vLLM's /score: text_1 against each of text_2 (or pair by pair), by the cosine of their embeddings."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(BaseModel):
    """Jina's and Cohere's /rerank, as vLLM serves it: documents ranked by their score against the query."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0
