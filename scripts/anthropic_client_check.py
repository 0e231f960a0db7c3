#!/usr/bin/env python3
"""Checks Anthropic's Messages API of `tandem serve` with the official `anthropic` package (what
Claude-style agents and SDK users run against llama-server's /v1/messages): a text answer whole
and streamed (the same text, usage and stop reason), a forced tool call as a `tool_use` block
(whole and streamed) whose input fits the tool's schema, the call and its result sent back,
count_tokens, and an image block refused as a 400 in Anthropic's error shape. Exits non-zero on
the first failure.

    python scripts/anthropic_client_check.py --base-url http://127.0.0.1:8080
"""

import argparse

import anthropic
from check_util import check

TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False}}
# the SDK has no sampling parameters any more; tandem reads llama-server's from the body
T0 = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    args = ap.parse_args()
    client = anthropic.Anthropic(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)

    whole = client.messages.create(model="any", max_tokens=8, extra_body=T0, messages=ASK, system="Be brief.")
    check(whole.type == "message" and whole.role == "assistant", f"message: {whole}")
    check([b.type for b in whole.content] == ["text"] and whole.content[0].text, f"content: {whole.content}")
    check(whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8, f"stop: {whole}")
    check(whole.usage.input_tokens > 0, f"usage: {whole.usage}")
    print(f"whole: {whole.content[0].text!r}, {whole.stop_reason}, {whole.usage.output_tokens} tokens")

    with client.messages.stream(model="any", max_tokens=8, extra_body=T0, messages=ASK, system="Be brief.") as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    check(text == whole.content[0].text, f"streamed {text!r}, whole {whole.content[0].text!r}")
    check(final.stop_reason == "max_tokens" and final.usage.output_tokens == 8, f"streamed final: {final}")
    print("streamed: the same text, stop reason and usage")

    forced = {"type": "tool", "name": "get_weather"}
    call = client.messages.create(model="any", max_tokens=128, extra_body=T0, messages=ASK, tools=[TOOL],
                                  tool_choice=forced)
    uses = [b for b in call.content if b.type == "tool_use"]
    check(call.stop_reason == "tool_use" and len(uses) == 1, f"tool call: {call}")
    use = uses[0]
    check(use.name == "get_weather" and isinstance(use.input.get("city"), str) and len(use.input["city"]) <= 12
          and set(use.input) == {"city"}, f"tool_use: {use}")
    # Anthropic's id spellings, which clients may match on.
    check(call.id.startswith("msg_") and use.id.startswith("toolu_"), f"ids: {call.id}, {use.id}")
    print(f"tool_use: {use.name}({use.input}), id {use.id}")

    with client.messages.stream(model="any", max_tokens=128, extra_body=T0, messages=ASK, tools=[TOOL],
                                tool_choice=forced) as s:
        final = s.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    check(final.stop_reason == "tool_use" and len(streamed) == 1 and streamed[0].input == use.input,
          f"streamed tool call: {final}")
    print("streamed tool_use: the same call")

    history = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                        "input": use.input}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "18 C and sunny"}]}]
    after = client.messages.create(model="any", max_tokens=8, extra_body=T0, messages=history, tools=[TOOL])
    check(after.stop_reason in ("max_tokens", "end_turn", "tool_use"), f"round trip: {after}")
    counted = client.messages.count_tokens(model="any", messages=history, tools=[TOOL])
    check(counted.input_tokens > 10, f"count_tokens: {counted}")
    print(f"round trip: answered ({after.stop_reason}); count_tokens {counted.input_tokens}")

    try:
        client.messages.create(model="any", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
        check(False, "an image block was taken")
    except anthropic.BadRequestError as e:
        check(e.status_code == 400 and "image" in str(e), f"image refused: {e}")
    print("an image block: 400 invalid_request_error")
    print("OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
