"""The agent stage's tools (docs/rl.md): plug-ins ``package.module:function`` with an OpenAI function schema, the
``<tool_call>`` parser, the argument checks, and a runner that executes calls in a worker process with a time limit.

* :func:`parse_tool_calls` reads every ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block of a reply
  (MiniMind's format, which the chat template renders); a block that is not JSON is counted, not run.
* :func:`check_arguments` validates a call's arguments against its tool's ``parameters`` schema (``jsonschema``),
  and, as MiniMind's per-tool checks do, wants every required argument non-empty.
* :class:`ToolBox` runs calls in one long-lived worker process (``python -m minimind_ray.rl.tool_worker``): a tool
  that raises, returns something that is not JSON, or runs past its ``timeout_s`` gives an error message
  (``{"error": ...}``) that goes back into the conversation; one that hangs has its process killed and replaced.
  Model text is never evaluated: a call's arguments are JSON, handed to the function as keywords.
* :func:`calculate` is the built-in calculator (``calculate``, and ``calculate_math`` as MiniMind names it): a safe
  evaluator of arithmetic over Python's ``ast`` (numbers, + - * / // % **, parentheses, a few math functions),
  with bounds on sizes, instead of MiniMind's ``eval`` of the model's text.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
import select
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from minimind_ray.failures import Mistake
from minimind_ray.plugins import callable_object

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression such as 12 + 7",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
BUILTIN_TOOLS: Dict[str, Tuple[str, dict]] = {  # name -> (function, schema)
    "calculate": ("minimind_ray.rl.tools:calculate", CALCULATOR_SCHEMA),
    "calculate_math": ("minimind_ray.rl.tools:calculate", {"type": "function", "function": {
        **CALCULATOR_SCHEMA["function"], "name": "calculate_math"}}),
}


# --------------------------------------------------------------------------- the calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {name: getattr(math, name) for name in ("sqrt", "exp", "log", "log10", "log2", "sin", "cos", "tan",
                                                     "floor", "ceil", "factorial")}
_FUNCTIONS.update(abs=abs, round=round)
_CONSTANTS = {"pi": math.pi, "e": math.e}
_SPELLINGS = {"^": "**", "×": "*", "÷": "/", "−": "-", "（": "(", "）": ")", "²": "**2", "³": "**3"}  # MiniMind's
MAX_EXPRESSION_CHARS, MAX_INT_BITS, MAX_EXPONENT = 200, 512, 1000
STARTUP_S = 60.0  # the worker's start and a tool module's import (never counted against a call's timeout_s)


def _number(x):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"not a number: {x!r}")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ValueError("result too large")
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("result is not finite")
    return x


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (isinstance(left, int) and isinstance(
                right, int) and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_INT_BITS)):
            raise ValueError("result too large")
        return _number(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _number(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and not node.keywords:
        fn = node.func
        if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "math":
            fn = ast.Name(id=fn.attr)  # math.sqrt(2), as MiniMind's prompts write it
        if isinstance(fn, ast.Name) and fn.id in _FUNCTIONS:
            args = [_evaluate(a) for a in node.args]
            if fn.id == "factorial" and (len(args) != 1 or not isinstance(args[0], int) or not 0 <= args[0] <= 100):
                raise ValueError("factorial takes one integer in 0..100")
            return _number(_FUNCTIONS[fn.id](*args))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculate(expression: str) -> Dict[str, Any]:
    """``{"result": value}`` of an arithmetic expression ("12 + 7", "2^10", "sqrt(144)"); ValueError (or
    ZeroDivisionError) for anything else. Nothing of the text is executed: it is parsed and walked."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    for k, v in _SPELLINGS.items():
        expression = expression.replace(k, v)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree)
    return {"result": value}


# --------------------------------------------------------------------------- calls and their arguments


def parse_tool_calls(text: str) -> Tuple[List[dict], int]:
    """(the calls of a reply as {"name", "arguments"} dicts, the number of blocks that were not a JSON object with
    a name). ``arguments`` given as a JSON string are parsed; unparsable ones become {} (MiniMind's rule)."""
    calls, bad = [], 0
    for block in TOOL_CALL.findall(text):
        try:
            call = json.loads(block.strip())
        except ValueError:
            bad += 1
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            bad += 1
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {}
        calls.append({"name": call["name"], "arguments": args})
    return calls, bad


def tool_schemas(tools) -> Dict[str, dict]:
    """The offered tools by name (OpenAI function schemas, or their ``function`` part)."""
    out = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn
    return out


def check_arguments(function_schema: dict, arguments) -> Optional[str]:
    """None when ``arguments`` suit the tool's ``parameters`` JSON schema and every required one is non-empty
    (MiniMind's checks), else the reason."""
    import jsonschema

    if not isinstance(arguments, dict):
        return f"arguments are a {type(arguments).__name__}, not an object"
    params = function_schema.get("parameters") or {"type": "object"}
    try:
        jsonschema.validate(arguments, params)
    except jsonschema.ValidationError as e:
        return f"arguments do not match the schema: {e.message}"
    except jsonschema.SchemaError as e:
        return f"the tool's schema is not a JSON schema: {e.message}"
    empty = [k for k in params.get("required", []) if arguments.get(k) in (None, "", [], {})]
    return f"required argument {empty[0]!r} is empty" if empty else None


def load_tool_function(spec: str) -> Callable:
    """``package.module:function`` -> the tool's function; ValueError naming what is wrong."""
    return callable_object(spec, "tool")


# --------------------------------------------------------------------------- running them


class ToolBox:
    """The run's tools by name (``train.agent.tools``), executed in a worker process with a time limit each."""

    def __init__(self, tools, max_response_chars: int = 2048):
        self.tools: Dict[str, Tuple[str, dict, float]] = {}
        self._specs = list(tools)
        for t in tools:
            function, schema = (t.function, t.schema) if t.function else BUILTIN_TOOLS[t.name]
            self.tools[t.name] = (function, t.schema or schema, float(t.timeout_s))
        self.max_chars = max_response_chars
        self.proc: Optional[subprocess.Popen] = None
        self.loaded: set = set()
        self.calls = self.errors = self.timeouts = 0

    def load_user_tools(self) -> None:
        """Import every tool of the user's own (``package.module:function``) in the tool worker now: one that cannot
        be imported where the run trains (a module not shipped to this node) fails the run's start, naming it,
        instead of answering every call with an error."""
        for name, (function, _, _) in self.tools.items():
            if function in self.loaded or not any(function == t.function for t in self._specs):
                continue
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            loaded = self._request({"load": function}, STARTUP_S)
            if loaded is None:  # the tool worker did not answer in time: a loaded machine, retried like a fault
                raise TimeoutError(f"train.agent.tools: {name} ({function}): the tool worker did not load it within "
                                   f"{STARTUP_S:g} s")
            if "error" in loaded:  # the user's module: the same on every attempt
                raise Mistake(f"train.agent.tools: {name} ({function})",
                              f"cannot be loaded on this worker: {loaded['error']}")
            self.loaded.add(function)

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # what this process imports
        self.proc = subprocess.Popen([sys.executable, "-m", "minimind_ray.rl.tool_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.loaded = set()
        if self._readline(STARTUP_S) is None:  # its start and imports are not a tool's time
            self._kill()
            raise RuntimeError(f"the tool worker did not start within {STARTUP_S:g} s")

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, name: str, arguments) -> Tuple[str, bool]:
        """(the tool message's content, whether the call failed): the result as JSON, or ``{"error": ...}``."""
        self.calls += 1
        if name not in self.tools:
            return self._error(f"unknown tool {name!r}; the tools are {sorted(self.tools)}")
        if not isinstance(arguments, dict):
            return self._error(f"arguments of {name} must be an object, got {type(arguments).__name__}")
        function, _, timeout = self.tools[name]
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        if function not in self.loaded:  # importing the tool's module is not the call's time either
            loaded = self._request({"load": function}, STARTUP_S)
            if loaded is None or "error" in loaded:
                return self._error(f"{name} could not be loaded: {(loaded or {}).get('error', 'timed out')}")
            self.loaded.add(function)
        reply = self._request({"function": function, "arguments": arguments}, timeout)
        if reply is None:
            self.timeouts += 1
            return self._error(f"{name} did not finish within {timeout:g} s")
        if "error" in reply:
            return self._error(f"{name} failed: {reply['error']}")
        return json.dumps(reply["result"], ensure_ascii=False)[:self.max_chars], False

    def _error(self, message: str) -> Tuple[str, bool]:
        self.errors += 1
        return json.dumps({"error": message}, ensure_ascii=False)[:self.max_chars], True

    def _request(self, request: dict, timeout: float) -> Optional[dict]:
        """One request to the worker; None when it did not answer in time (it is killed: a hung tool never holds
        the run), an error reply when it died."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            line = self._readline(timeout)
        except (BrokenPipeError, OSError):
            line = b""
        if line is None:
            self._kill()
            return None
        if not line:  # it exited (a tool that called os._exit, say): the next call starts another
            self._kill()
            return {"error": "the tool's worker process exited"}
        return json.loads(line)

    def _readline(self, timeout: float) -> Optional[bytes]:
        """One reply line of the worker, b'' at its end of output, None after ``timeout`` seconds."""
        fd, buf = self.proc.stdout.fileno(), b""
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            buf += chunk
        return buf

    def close(self) -> None:
        self._kill()

    def __del__(self):
        try:
            self._kill()
        except Exception:
            pass
