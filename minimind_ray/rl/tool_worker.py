"""The agent stage's tool worker process (rl/tools.py:ToolBox starts it as ``python -m minimind_ray.rl.tool_worker``).

One JSON request per line on stdin, one JSON reply per line on the original stdout:

    {"load": "package.module:function"}                     -> {"loaded": ...}        (imports it once)
    {"function": "package.module:function", "arguments": {}} -> {"result": ...} | {"error": "Type: message"}

A tool's own prints go to stderr, so they cannot break the protocol. The parent enforces the time limit (it
kills this process when a reply is late); whatever a tool raises becomes an error reply.
"""
from __future__ import annotations

import json
import os
import sys

from minimind_ray.rl.tools import load_tool_function


def main() -> None:
    channel = os.fdopen(os.dup(1), "wb", buffering=0)  # replies only; a tool's prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    functions = {}

    def reply(obj) -> None:
        channel.write((json.dumps(obj, ensure_ascii=False) + "\n").encode())

    reply({"ready": True})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            spec = req.get("load") or req["function"]
            if spec not in functions:
                functions[spec] = load_tool_function(spec)
            if "load" in req:
                reply({"loaded": spec})
                continue
            result = functions[spec](**req["arguments"])
            json.dumps(result, ensure_ascii=False)  # a result that is not JSON is the tool's error
            reply({"result": result})
        except Exception as e:  # the tool's failure, reported; the worker goes on
            reply({"error": f"{type(e).__name__}: {e}"[:500]})


if __name__ == "__main__":
    main()
