"""Chats the HTTP cluster tests send: a few conversations (half share a long system prompt)
and OpenAI-client calls to a served app."""

from __future__ import annotations

from typing import TYPE_CHECKING

import openai

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

MAX_TOKENS = 12
SHARED_SYSTEM = ("You are a careful assistant. Answer briefly and cite the section you used. "
                 "Section one covers billing; section two covers shipping; section three covers "
                 "returns, refunds and exchanges for every region we serve. ") * 3
QUESTIONS = ["Hi", "How do refunds work?", "Where is my parcel?", "Explain billing cycles.",
             "Can I exchange a gift?", "Summarise section two.", "Is shipping free?", "Ok"]


def conversations() -> list[list[dict[str, str]]]:
    convs = []
    for i, question in enumerate(QUESTIONS):
        if i % 2:  # half share a long system prompt (prefix reuse), half are short
            convs.append([{"role": "system", "content": SHARED_SYSTEM},
                          {"role": "user", "content": question}])
        else:
            convs.append([{"role": "user", "content": question * (1 + i)}])
    return convs


def client(apps: ServedApps, app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{apps.url(app)}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat(apps: ServedApps, app: str, conv: list[dict[str, str]],
         stream: bool) -> tuple[str, object]:
    c = client(apps, app)
    kwargs = dict(model="tiny", messages=conv, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    if not stream:
        resp = c.chat.completions.create(**kwargs)
        return resp.choices[0].message.content or "", resp.usage
    text, usage = "", None
    for chunk in c.chat.completions.create(**kwargs, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage
