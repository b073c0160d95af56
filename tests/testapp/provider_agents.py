"""Agents that call a model through the real `openai` client, pointed at the scripted
provider (tests/fakeprovider.py): tests/test_scripted_provider.py."""

from __future__ import annotations

import os
from typing import Any

from django_agentruns import RunContext, agent


@agent("tests.openai_chat", max_requeues=3)
def openai_chat(ctx: RunContext) -> dict[str, Any]:
    """One streamed chat completion of model input["model"]: each text delta goes to
    `ctx.stream`, the final usage chunk to `ctx.record_usage`. The client does not retry
    (max_retries=0): retrying is the engine's job."""
    import openai

    client = openai.OpenAI(base_url=os.environ["FAKE_PROVIDER_URL"], api_key="sk-test",
                           max_retries=0, timeout=float(ctx.input.get("timeout", 10)))
    stream = client.chat.completions.create(
        model=ctx.input["model"], messages=[{"role": "user", "content": "hello"}],
        stream=True, stream_options={"include_usage": True})
    parts: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            ctx.stream(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "the provider sent no usage chunk"
    ctx.record_usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                     model=ctx.input["model"])
    return {"text": "".join(parts), "attempt": ctx.attempt}
