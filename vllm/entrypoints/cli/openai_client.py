"""What `vllm chat` and `vllm complete` share: a minimal OpenAI client over the standard library (streamed
requests to a running server), and their common flags (upstream's names)."""
from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://localhost:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model-name", default=None, help="the model to ask (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default: the server's)")


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.base = args.url.rstrip("/")
        key = args.api_key or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.model = args.model_name or self._first_model()
        self.max_tokens = args.max_tokens

    def _open(self, path: str, body: dict | None = None):
        request = urllib.request.Request(self.base + path, headers=self.headers,
                                         data=None if body is None else json.dumps(body).encode())
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise ValueError(f"{path}: HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise ValueError(f"cannot reach the server at {self.base}: {e.reason} (is `vllm serve` running? "
                             "point --url at it)") from None

    def _first_model(self) -> str:
        with self._open("/models") as r:
            return json.load(r)["data"][0]["id"]

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """The JSON events of a streamed request."""
        body = {"model": self.model, "stream": True, **body}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        with self._open(path, body) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise ValueError(f"{path}: {event['error']['message']}")
                yield event


def prompts(quick: str | None) -> Iterator[str]:
    """The one --quick input, or lines typed until end of input (Ctrl-D)."""
    if quick is not None:
        yield quick
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            print()
            return
