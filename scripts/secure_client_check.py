#!/usr/bin/env python3
"""Checks `tandem serve --ssl-cert-file ... --api-key KEY` with the clients people use: grpcio over
TLS (health open without a key; GetModelInfo refused without one, answered with one; a streamed
Generate) and the official `openai` package over HTTPS (the key as its api_key; a wrong key is
an AuthenticationError). Exits non-zero on the first failure.

    python scripts/secure_client_check.py --grpc 127.0.0.1:50051 --https https://127.0.0.1:8080 \\
        --ca cert.pem --key KEY
"""

import argparse
import os
import sys
import tempfile

import ssl

import grpc
import openai

try:  # the HTTP client openai is built on: httpx2 in openai 3, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpc_client import load_stubs  # noqa: E402
from check_util import check


def check_grpc(addr, ca, key):
    creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
    with tempfile.TemporaryDirectory() as out, grpc.secure_channel(
        addr, creds, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as channel:
        pb, stubs = load_stubs(out)
        # grpc.health.v1.Health/Check by hand: an empty request; the answer's field 1 is the
        # status, SERVING = 1
        health = channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=lambda _: b"", response_deserializer=lambda b: b
        )(None, timeout=30)
        check(health == b"\x08\x01", f"health: {health!r}")
        client = stubs.InferenceServiceStub(channel)
        try:
            client.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            check(False, "GetModelInfo without a key was answered")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.UNAUTHENTICATED, f"GetModelInfo without a key: {e.code()}")
        auth = [("authorization", f"Bearer {key}")]
        info = client.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=auth)
        req = pb.GenerateRequest(text="Hello over TLS", options=pb.GenerationOptions(max_tokens=8, ignore_eos=True))
        ids = [t for m in client.Generate(req, timeout=60, metadata=auth) for t in m.token_ids]
        check(len(ids) == 8, f"Generate over TLS: {len(ids)} tokens")
        print(f"grpcio over TLS: health SERVING, no key UNAUTHENTICATED, {info.architecture} model, 8 tokens streamed")


def check_openai(base_url, ca, key):
    with httpx.Client(verify=ssl.create_default_context(cafile=ca)) as http:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, http_client=http, max_retries=0)
        chat = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
        )
        check(chat.usage.completion_tokens <= 8 and chat.choices[0].message.role == "assistant", f"chat: {chat}")
        wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-the-key", http_client=http, max_retries=0)
        try:
            wrong.models.list()
            check(False, "a wrong key was accepted")
        except openai.AuthenticationError as e:
            check(e.status_code == 401, f"wrong key: {e}")
    print(f"openai over HTTPS: chat {chat.choices[0].message.content!r}, a wrong key 401")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grpc", required=True, help="gRPC address (TLS)")
    ap.add_argument("--https", required=True, help="HTTPS base URL")
    ap.add_argument("--ca", required=True, help="PEM certificate to trust")
    ap.add_argument("--key", required=True, help="API key")
    args = ap.parse_args()
    check_grpc(args.grpc, args.ca, args.key)
    check_openai(args.https, args.ca, args.key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
