"""LangChain callbacks that `run_graph` adds: a GenAI span per chat-model call and per
tool call (children of the node's current span, under the attempt's), and the chat
model's reported usage recorded on the run (`ctx.record_usage`)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from ..runtime.context import current_context
from ._bridge import Usage, end_span, set_usage, start_genai_span

SYSTEM = "langchain"


class GenAICallbacks(BaseCallbackHandler):
    """Spans and usage of the chat models and tools a graph's nodes call."""

    run_inline = True  # in the node's thread and context: its span is the parent

    def __init__(self) -> None:
        self._spans: dict[UUID, Any] = {}

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[Any]], *,
                            run_id: UUID, metadata: dict[str, Any] | None = None,
                            **kwargs: Any) -> None:
        params = kwargs.get("invocation_params") or {}
        model = str((metadata or {}).get("ls_model_name") or params.get("model")
                    or params.get("model_name") or (serialized or {}).get("name") or "")
        system = str((metadata or {}).get("ls_provider") or SYSTEM)
        self._spans[run_id] = start_genai_span("chat", system=system, model=model)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        span = self._spans.pop(run_id, None)
        usage = _usage(response)
        if usage is not None:
            set_usage(span, usage)
            ctx = current_context()
            if ctx is not None:
                ctx.record_usage(input_tokens=usage.input_tokens,
                                 output_tokens=usage.output_tokens, model=usage.model)
        end_span(span)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        end_span(self._spans.pop(run_id, None), error)

    def on_tool_start(self, serialized: dict[str, Any], input_str: str, *, run_id: UUID,
                      **kwargs: Any) -> None:
        name = str((serialized or {}).get("name") or "tool")
        self._spans[run_id] = start_genai_span("execute_tool", system=SYSTEM, tool=name,
                                               call_id=str(kwargs.get("tool_call_id") or ""))

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        end_span(self._spans.pop(run_id, None))

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        end_span(self._spans.pop(run_id, None), error)


def _usage(response: Any) -> Usage | None:
    """The tokens the chat model reported (LangChain's `usage_metadata`), if it did."""
    for generations in getattr(response, "generations", None) or []:
        for generation in generations:
            message = getattr(generation, "message", None)
            metadata = getattr(message, "usage_metadata", None)
            if metadata:
                model = (getattr(message, "response_metadata", None) or {}).get("model_name")
                return Usage(input_tokens=int(metadata.get("input_tokens") or 0),
                             output_tokens=int(metadata.get("output_tokens") or 0),
                             model=str(model or ""))
    return None
