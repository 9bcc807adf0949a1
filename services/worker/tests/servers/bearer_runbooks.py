"""The example runbook server over streamable HTTP behind a bearer token.

The worker's MCP tests run it to see what a worker sends for `bearer_token_env`. It
serves the tools of examples/mcp/runbooks.py (the official Python SDK,
`pip install mcp==2.3.0`) on loopback and, before the MCP server sees a request:

- appends the request's Authorization header to the file `--record` names, one line per
  request (`-` when there is none), so the test reads what the worker sent;
- refuses the request with 401 unless the header is `Bearer <token>`, the token being
  the text of the file `--token-file` names, read for every request (the test changes it
  to make the server refuse the worker). The refusal carries a `WWW-Authenticate:
  Bearer` challenge, as the MCP authorization spec has it; with `--quote-refused` it
  carries none and quotes the refused header in its body instead, as a careless server
  might;
- with `--quote-accepted`, quotes the header of a request it lets through in the
  answers to it: every runbook has a `served_to` field holding it.

It prints `listening on <url>` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import pathlib
import socket
import sys

# The example server is imported, not copied; importing it leaves no bytecode behind.
sys.dont_write_bytecode = True
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4] / "examples" / "mcp"))
import runbooks  # noqa: E402


class BearerGate:
    """ASGI middleware: records every request's Authorization header and lets through
    only those that present the expected bearer token."""

    def __init__(
        self,
        app,
        token_file: pathlib.Path,
        record: pathlib.Path,
        quote_refused: bool,
        quote_accepted: bool,
    ) -> None:
        self.app = app
        self.token_file = token_file
        self.record = record
        self.quote_refused = quote_refused
        self.quote_accepted = quote_accepted

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = b""
        for name, value in scope["headers"]:
            if name.lower() == b"authorization":
                presented = value
        with self.record.open("ab") as record:
            record.write((presented or b"-") + b"\n")
        expected = b"Bearer " + self.token_file.read_text().strip().encode()
        if hmac.compare_digest(presented, expected):
            if self.quote_accepted:
                for runbook in runbooks.RUNBOOKS.values():
                    runbook["served_to"] = presented.decode("latin-1")
            await self.app(scope, receive, send)
            return
        if self.quote_refused:
            why = "not accepted: " + presented.decode("latin-1")
            challenge = []
        else:
            why = "the bearer token is not accepted"
            challenge = [(b"www-authenticate", b'Bearer realm="runbooks", error="invalid_token"')]
        body = json.dumps({"error": "invalid_token", "error_description": why}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *challenge,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def serve(
    token_file: pathlib.Path, record: pathlib.Path, quote_refused: bool, quote_accepted: bool
) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    app = runbooks.SERVER.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    server = uvicorn.Server(
        uvicorn.Config(
            BearerGate(app, token_file, record, quote_refused, quote_accepted),
            log_level="warning",
        )
    )
    print(f"listening on {url}", flush=True)
    await server.serve(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--token-file", type=pathlib.Path, required=True,
                        help="the file holding the one token the server accepts")
    parser.add_argument("--record", type=pathlib.Path, required=True,
                        help="the file the Authorization header of every request is appended to")
    parser.add_argument("--quote-refused", action="store_true",
                        help="refuse without a challenge, quoting the refused header")
    parser.add_argument("--quote-accepted", action="store_true",
                        help="quote the header of an accepted request in its answers")
    args = parser.parse_args()
    asyncio.run(serve(args.token_file, args.record, args.quote_refused, args.quote_accepted))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
