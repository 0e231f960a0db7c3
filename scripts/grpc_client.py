#!/usr/bin/env python3
"""A Python client of `tandem serve`, generated from proto/tandem/v1/inference.proto with PyPI
grpcio-tools at run time (no generated code is committed): it prints the model, then streams one
generation token by token.

    pip install grpcio-tools
    python scripts/grpc_client.py --addr 127.0.0.1:50051 --prompt "Hello" --max-tokens 32

--check makes it a contract test (used by tests/serve_process.rs): every streamed message but
the last carries exactly one token, the last carries the finish, and usage counts them.
"""

import argparse
import importlib
import os
import sys
import tempfile

import grpc
from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO = "tandem/v1/inference.proto"


def load_stubs(out_dir: str):
    """Compiles the proto into out_dir and imports the generated modules."""
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO,
    ])
    if rc != 0:
        sys.exit(f"grpc_client.py: protoc failed on {PROTO} (exit {rc})")
    sys.path.insert(0, out_dir)
    pb = importlib.import_module("tandem.v1.inference_pb2")
    stubs = importlib.import_module("tandem.v1.inference_pb2_grpc")
    return pb, stubs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", default="127.0.0.1:50051", help="gRPC address of tandem serve")
    ap.add_argument("--prompt", default="Hello", help="prompt text")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="deadline of the call, seconds")
    ap.add_argument("--check", action="store_true", help="assert the streaming contract")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as out:
        pb, stubs = load_stubs(out)
        with grpc.insecure_channel(args.addr) as channel:
            client = stubs.InferenceServiceStub(channel)
            info = client.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
            print(f"model: {info.name} ({info.architecture}, vocab {info.vocab_size}, "
                  f"{info.parallel} slots of {info.context_per_slot} tokens, demo={info.demo})")
            req = pb.GenerateRequest(
                request_id="python-client",
                text=args.prompt,
                sampling=pb.SamplingParams(temperature=args.temperature),
                options=pb.GenerationOptions(max_tokens=args.max_tokens, ignore_eos=args.check),
            )
            ids, text, finish, messages = [], [], None, 0
            for msg in client.Generate(req, timeout=args.timeout):
                messages += 1
                if args.check:
                    assert msg.request_id == "python-client", msg
                    assert finish is None, "a message after the finish"
                    assert len(msg.token_ids) == (0 if msg.HasField("finish") else 1), msg
                ids.extend(msg.token_ids)
                text.append(msg.text)
                print(f"token {list(msg.token_ids)} {msg.text!r}", flush=True)
                if msg.HasField("finish"):
                    finish = msg.finish
            if finish is None:
                sys.exit("grpc_client.py: the stream ended without a finish message")
            reason = pb.FinishReason.Name(finish.reason)
            u, t = finish.usage, finish.timings
            print(f"text: {''.join(text)!r}")
            print(f"finish: {reason}; {u.completion_tokens} tokens after a prompt of {u.prompt_tokens} "
                  f"({u.cached_tokens} cached); time to first token {t.time_to_first_token_ms:.1f} ms, "
                  f"{t.decode_tokens_per_second:.1f} tokens/s")
            if args.check:
                assert u.completion_tokens == len(ids) == args.max_tokens, (u, len(ids))
                assert messages == len(ids) + 1, messages
                assert reason == "FINISH_REASON_LENGTH", reason
                print(f"check: ok, {len(ids)} tokens in {messages} messages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
