#!/usr/bin/env python3
"""Checks OpenAI tool calling through the official `openai` package against `tandem serve`: a
request with `tools` whose answer holds a Hermes-style `<tool_call>` (forced with llama-server's
`grammar`, passed as extra_body, since a tiny test model will not call tools by itself) comes back
as a parsed `tool_calls` entry with finish_reason "tool_calls", streamed and not; then the call
and its result go back in the conversation and render through the template. Exits non-zero on
the first failure. Last, `tool_choice` "required" and a named function force a call with no
grammar from the client: the tiny model's call parses and its arguments fit the tool's schema.

    python scripts/tool_call_check.py --base-url http://127.0.0.1:8080
"""

import argparse
import json
import sys
import urllib.request

import openai
from check_util import check, local_client

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
BOUNDED = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
FORCED = ('root ::= "I will check. " "<tool_call>" "\\n" '
          '"{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}" "\\n" "</tool_call>"')


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    args = ap.parse_args()
    client = local_client(args.base_url)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=256,
                                       temperature=0, extra_body={"grammar": FORCED})
    choice = r.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}: {r}")
    calls = choice.message.tool_calls or []
    check(len(calls) == 1 and calls[0].function.name == "get_weather", f"tool_calls: {calls}")
    check(json.loads(calls[0].function.arguments) == {"city": "Paris"}, f"arguments: {calls[0].function.arguments}")
    check(r.id.startswith("chatcmpl-") and calls[0].id.startswith("call_"), f"ids: {r.id}, {calls[0].id}")  # OpenAI's
    check(choice.message.content == "I will check.", f"content: {choice.message.content!r}")
    print(f"tool_calls: {calls[0].function.name}({calls[0].function.arguments}), content {choice.message.content!r}")

    stream = client.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=256,
                                            temperature=0, stream=True, extra_body={"grammar": FORCED})
    content, streamed, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        streamed += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    check(finish == "tool_calls" and len(streamed) == 1, f"streamed: {finish}, {streamed}")
    check(streamed[0].function.name == "get_weather" and json.loads(streamed[0].function.arguments) == {"city": "Paris"},
          f"streamed call: {streamed[0]}")
    check(content.strip() == "I will check." and "<tool_call>" not in content, f"streamed content: {content!r}")
    print(f"streamed: content {content.strip()!r}, then the call as one delta")

    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C and sunny"},
    ]
    r2 = client.chat.completions.create(model="any", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    check(r2.choices[0].finish_reason in ("stop", "length"), f"round trip: {r2}")
    body = json.dumps({"messages": history, "tools": TOOLS}).encode()
    req = urllib.request.Request(f"{args.base_url}/apply-template", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        prompt = json.loads(resp.read())["prompt"]
    check("18 C and sunny" in prompt and "get_weather" in prompt, f"rendered: {prompt!r}")
    print("round trip: the call and its result render through the template")

    def fits(call):
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            return set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12
        return call.function.name == "get_time" and args == {"zone": args.get("zone")} and args["zone"] in ("UTC", "CET")

    for seed in range(3):
        r = client.chat.completions.create(model="any", messages=messages, tools=BOUNDED, tool_choice="required",
                                           max_tokens=300, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls or []
        check(r.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and fits(calls[0]),
              f"tool_choice required: {r}")
        print(f"tool_choice required (seed {seed}): {calls[0].function.name}({calls[0].function.arguments})")
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(model="any", messages=messages, tools=BOUNDED, tool_choice=named,
                                            max_tokens=300, temperature=1.0, stream=True)
    streamed, finish = [], None
    for chunk in stream:
        streamed += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    check(finish == "tool_calls" and len(streamed) == 1 and streamed[0].function.name == "get_time"
          and fits(streamed[0]), f"named tool_choice, streamed: {finish} {streamed}")
    print(f"tool_choice get_time, streamed: get_time({streamed[0].function.arguments})")
    try:
        client.chat.completions.create(model="any", messages=messages, tools=BOUNDED, tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=8)
        check(False, "tool_choice required with response_format was taken")
    except openai.BadRequestError as e:
        print(f"tool_choice required with response_format: 400 {e.body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
