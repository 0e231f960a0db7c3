#!/usr/bin/env python3
"""Checks tandem's structured output with the clients people use: the official `openai` package with
`response_format` json_schema (an object with three typed fields, one an enum) at temperature 0.8,
N requests, every output parsed and validated with `jsonschema`; json_object; and llama-server's
`/completion` with a GBNF grammar for yes/no. Exits non-zero on the first failure.

    python scripts/structured_output_check.py --base-url http://127.0.0.1:8080 --requests 20
"""

import argparse
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
from check_util import check, local_client

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"type": "string", "enum": ["happy", "sad", "angry"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args()
    client = local_client(args.base_url, timeout=600)
    messages = [{"role": "user", "content": "Describe a person as JSON with their name, age and mood."}]

    def one(i):
        r = client.chat.completions.create(
            model="any", messages=messages, temperature=0.8, seed=i, max_tokens=96,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=4) as pool:
        outputs = list(pool.map(one, range(args.requests)))
    for text, finish in outputs:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            check(False, f"not JSON ({finish}): {text!r}: {e}")
        try:
            jsonschema.validate(value, SCHEMA)
        except jsonschema.ValidationError as e:
            check(False, f"does not validate: {text!r}: {e.message}")
    print(f"json_schema: {len(outputs)}/{args.requests} outputs parse and validate, e.g. {outputs[0][0]}")

    r = client.chat.completions.create(
        model="any", messages=messages, temperature=0.8, seed=1, max_tokens=96,
        response_format={"type": "json_object"},
    )
    value = json.loads(r.choices[0].message.content)
    check(isinstance(value, dict), f"json_object: {value!r}")
    print(f"json_object: {r.choices[0].message.content}")

    answers = set()
    for seed in range(8):
        body = json.dumps({"prompt": "Is the sky blue? Answer:", "grammar": 'root ::= "yes" | "no"',
                           "temperature": 1.0, "seed": seed, "n_predict": 8}).encode()
        req = urllib.request.Request(f"{args.base_url}/completion", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            content = json.loads(resp.read())["content"]
        check(content in ("yes", "no"), f"grammar yes|no gave {content!r}")
        answers.add(content)
    print(f"grammar: 8/8 answers in (yes, no): {sorted(answers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
