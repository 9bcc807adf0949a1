"""The example runbook server over stdio, writing down the environment it started with.

The worker's MCP tests configure it as a stdio server to see which variables a worker
gives the servers it starts. Before it serves the tools of examples/mcp/runbooks.py (the
official Python SDK, `pip install mcp==2.3.0`) on stdin and stdout, it writes its whole
environment as a JSON object to the file `--env-file` names (written whole, then
renamed, so a reader never sees half of it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

# The example server is imported, not copied; importing it leaves no bytecode behind.
sys.dont_write_bytecode = True
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4] / "examples" / "mcp"))
import runbooks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-file", type=pathlib.Path, required=True,
                        help="where to write the environment, as a JSON object")
    args = parser.parse_args()
    partial = args.env_file.with_name(args.env_file.name + ".partial")
    partial.write_text(json.dumps(dict(os.environ), sort_keys=True))
    partial.replace(args.env_file)
    runbooks.SERVER.run()


if __name__ == "__main__":
    main()
