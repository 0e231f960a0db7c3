#!/usr/bin/env python3
"""Checks tandem's HTTP API with the clients people already use: the official `openai` package
(chat streaming and non-streaming, completions, a prompt list with n, n streamed, logit_bias, models list) and
an aiohttp batch client sending
concurrent llama-server `/completion` requests. Exits non-zero on the first failure.

    python scripts/http_client_check.py --base-url http://127.0.0.1:8080 --concurrent 50
"""

import argparse
import asyncio
import json
import sys
import urllib.request

import aiohttp
from check_util import check, local_client


def check_openai(base_url):
    client = local_client(base_url)
    models = client.models.list()
    check(len(models.data) == 1 and models.data[0].id, f"models list: {models}")
    model = models.data[0].id
    print(f"models: {model!r}")

    messages = [{"role": "user", "content": "Hello, who are you?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, seed=1)
    choice = chat.choices[0]
    check(choice.message.role == "assistant" and isinstance(choice.message.content, str), f"chat: {chat}")
    check(choice.finish_reason in ("stop", "length"), f"chat finish_reason: {choice.finish_reason}")
    check(chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 0, f"chat usage: {chat.usage}")
    print(f"chat: {choice.message.content!r} ({chat.usage.completion_tokens} tokens, {choice.finish_reason})")

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, seed=1, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    check(text == choice.message.content, f"streamed chat {text!r} != {choice.message.content!r}")
    check(finish == choice.finish_reason, f"streamed finish_reason {finish}")
    check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, f"stream usage: {usage}")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    check(cached is not None and cached > 0, f"the repeated prompt comes from the cache: {usage}")
    print(f"chat stream: {text!r}, usage {usage.prompt_tokens}+{usage.completion_tokens} tokens, {cached} cached")

    comp = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0)
    check(isinstance(comp.choices[0].text, str) and comp.usage.completion_tokens <= 6, f"completion: {comp}")
    print(f"completion: {comp.choices[0].text!r}")
    parts = list(client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                           stream=True))
    streamed = "".join(p.choices[0].text for p in parts if p.choices)
    check(streamed == comp.choices[0].text, f"streamed completion {streamed!r} != {comp.choices[0].text!r}")

    two = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=4, temperature=0.8, seed=5)
    check([c.index for c in two.choices] == [0, 1], f"chat n=2: {two}")
    print(f"chat n=2: {[c.message.content for c in two.choices]!r}")
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=4, temperature=0.8,
                                                seed=5, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    check(texts == [c.message.content for c in two.choices], f"chat n=2 streamed {texts!r}: {two}")
    print(f"chat n=2 streamed: the same {texts!r}")

    # a batch: a prompt list with n = 2, seeded, and logit_bias, as the client types them
    prompts = ["The quick brown fox", "Once upon a time"]
    batch = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=4, temperature=0.8, seed=3)
    check([c.index for c in batch.choices] == [0, 1, 2, 3], f"batch indexes: {batch}")
    again = client.completions.create(model=model, prompt=prompts[1], max_tokens=4, temperature=0.8, seed=4)
    check(batch.choices[3].text == again.choices[0].text, f"choice 3 is prompt 1 with seed 4: {batch} {again}")
    check(batch.usage.completion_tokens <= 16, f"batch usage: {batch.usage}")
    print(f"batch: {[c.text for c in batch.choices]!r}")
    def post(path, body):
        req = urllib.request.Request(f"{base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req) as r:
            return json.load(r)

    zebra = post("/tokenize", {"content": " zebra"})["tokens"][-1]
    piece = post("/detokenize", {"tokens": [zebra]})["content"]
    lifted = client.completions.create(model=model, prompt=prompts[0], max_tokens=2, temperature=0,
                                       logit_bias={str(zebra): 100})
    check(lifted.choices[0].text == piece * 2, f"logit_bias +100 on {piece!r}: {lifted}")
    print(f"logit_bias: {lifted.choices[0].text!r}")


async def check_batch(base_url, n):
    async def one(session, i):
        body = {"prompt": f"Request number {i}: once upon a time", "n_predict": 4, "temperature": 0.7, "seed": i,
                "cache_prompt": True}
        async with session.post(f"{base_url}/completion", json=body) as r:
            data = await r.json()
            ok = r.status == 200 and isinstance(data.get("content"), str) and data.get("stop") is True
            ok = ok and 0 < data["tokens_predicted"] <= 4 and data["tokens_evaluated"] > 0 and "timings" in data
            if not ok:
                print(f"request {i}: {r.status} {data}", file=sys.stderr)
            return ok

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*(one(session, i) for i in range(n)))
    good = sum(results)
    print(f"{good}/{n} /completion requests succeeded")
    check(good == n, f"{n - good} of {n} concurrent /completion requests failed")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080")
    p.add_argument("--concurrent", type=int, default=50)
    args = p.parse_args()
    check_openai(args.base_url)
    asyncio.run(check_batch(args.base_url, args.concurrent))
    print("OK")


if __name__ == "__main__":
    main()
