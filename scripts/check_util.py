"""What the client checks of `tandem serve` share: a failed condition ends the script with a
one-line reason, and the OpenAI client of a local server."""

import sys

import openai


def check(cond, what):
    """Exits with status 1 and `FAILED: what` on standard error unless `cond` holds."""
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def local_client(base_url, timeout=300):
    """The `openai` client of the server at `base_url` (no key, no retries)."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout)
