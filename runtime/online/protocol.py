"""OpenAI request bodies (the fields this server honours; unknown fields are ignored) and its error JSON."""

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, lt=2**31)  # 0 or -1: off
    seed: int | None = Field(None, ge=0, lt=2**63)  # torch.Generator's range
    stop: str | list[str | int] | None = None  # strings matched on the text; ints are stop token ids
    stop_token_ids: list[int] = []
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    bootstrap_room: int | None = Field(None, ge=0, lt=2**63)  # set by the PD router
    bootstrap_url: str | None = None  # the PD router: the prefill instance that owns bootstrap_room
    return_token_ids: bool = False  # each choice (and stream chunk) also carries its generated token ids

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if isinstance(s, str) and s]

    def all_stop_token_ids(self) -> tuple[int, ...]:
        stops = self.stop if isinstance(self.stop, list) else []
        return tuple(self.stop_token_ids) + tuple(s for s in stops if isinstance(s, int))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the chat template as given

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] = {}

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}},
            status_code=self.status,
        )
