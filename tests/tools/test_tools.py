"""The tools package: the calculator's safe evaluator, the http tool against a local server, the hermes
parser, the tool config file, the registry, and running a round of calls with errors and timeouts."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import pytest

from hybridflow.errors import UserError
from hybridflow.registry import UnknownNameError
from hybridflow.tools import (TOOLS, Tool, ToolCall, ToolError, evaluate, get_tool_class, get_tool_format,
                              load_tools, register_tool, run_calls)
from hybridflow.tools.calculator import MAX_CHARS


@pytest.mark.parametrize("expression, value", [
    ("2+3", 5), ("12 * (3 + 4)", 84), ("-2 ** 2", -4), ("7 / 2", 3.5), ("7 // 2", 3), ("7 % 4", 3),
    ("2 ** 10", 1024), ("1.5 * 4", 6.0), (" ( 1 ) ", 1),
])
def test_calculator_values(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "unsupported syntax"), ("x + 1", "unsupported syntax"),
    ("'a' * 3", "unsupported syntax"), ("1 < 2", "unsupported syntax"), ("1 / 0", "division by zero"),
    ("2 ** 999", "exponent"), ("9 ** 9 ** 9", "exponent"), ("10.0 ** 64 * 10.0 ** 64", "out of range"),
    ("1 +", "not an arithmetic"), ("1" * (MAX_CHARS + 1), "longer than"), ("+".join(["1"] * 40), "syntax nodes"),
    ("(-8) ** 0.5", "cannot compute"),
])
def test_calculator_rejects(expression, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_calculator_tool_formats_numbers():
    tool = get_tool_class("calculator")()
    assert asyncio.run(tool.call({"expression": "6 * 7"})) == "42"
    assert asyncio.run(tool.call({"expression": "8 / 2"})) == "4"
    assert asyncio.run(tool.call({"expression": "1 / 3"})) == "0.3333333333"
    assert tool.schema["function"]["name"] == "calculator"
    assert tool.schema["function"]["parameters"]["required"] == ["expression"]


def test_hermes_parse():
    fmt = get_tool_format("hermes")
    calls = fmt.parse('x <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> '
                      '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{oops'
                      '</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "calculator"')
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("calculator", {"expression": "1+1"}, True), ("f", {"a": 1}, True), (None, {}, False), (None, {}, False)]
    assert fmt.stop == ("</tool_call>",)
    with pytest.raises(UnknownNameError, match="hermes"):
        get_tool_format("hermez")


def test_hermes_parse_reads_empty_string_arguments_as_no_arguments():
    # a call without arguments written as "" (as chat APIs serialise it) is a call with {} -- not an error
    calls = get_tool_format("hermes").parse('<tool_call>{"name": "now", "arguments": ""}</tool_call>'
                                            '<tool_call>{"name": "now", "arguments": " "}</tool_call>'
                                            '<tool_call>{"name": "now", "arguments": "[1]"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls[:2]] == [("now", {}, None), ("now", {}, None)]
    assert calls[2].error == 'tool call "arguments" must be a JSON object'


class _Slow(Tool):
    async def call(self, arguments, *, instance_id=None):
        await asyncio.sleep(arguments.get("seconds", 5))
        return "late"


class _Broken(Tool):
    async def call(self, arguments, *, instance_id=None):
        raise RuntimeError("boom")


class _NotText(Tool):
    async def call(self, arguments, *, instance_id=None):
        return 42


def test_run_calls_turns_every_failure_into_an_observation():
    tools = {"slow": _Slow(), "broken": _Broken(), "calculator": get_tool_class("calculator")(), "bad": _NotText()}
    rounds = [("t0", [ToolCall("slow", {"seconds": 5}), ToolCall("calculator", {"expression": "2*21"})]),
              ("t1", [ToolCall("broken"), ToolCall("nope"), ToolCall(None, error="tool call is not valid JSON"),
                      ToolCall("bad"), ToolCall("calculator", {"expression": "1/0"}),
                      ToolCall("calculator", {"expression": "2**40"})])]
    asyncio.run(run_calls(rounds, tools, timeout_s=0.2, max_chars=5))
    slow, calc = rounds[0][1]
    assert slow.error == "tool 'slow' timed out after 0.2s" and slow.result.startswith("Error")
    assert calc.result == "42" and calc.error is None and calc.latency_s > 0
    broken, unknown, unparsed, bad, zero, long = rounds[1][1]
    assert broken.error == "RuntimeError: boom"
    assert "unknown tool 'nope'" in unknown.error and "calculator" in unknown.error
    assert unparsed.result == "Error"  # "Error: tool call is not valid JSON" cut to max_chars
    assert "returned int" in bad.error and "division by zero" in zero.error
    assert long.result == "10995"  # 1099511627776 cut to 5 characters


def test_register_tool_and_config_file(tmp_path):
    @register_tool("echo_test_tool")
    class Echo(Tool):
        description = "echo"

        async def create(self, instance_id, sample):
            self.config.setdefault("created", []).append(instance_id)

        async def call(self, arguments, *, instance_id=None):
            return json.dumps(arguments)

    assert "echo_test_tool" in TOOLS.names() and Echo.name == "echo_test_tool"
    with pytest.raises(TypeError):
        register_tool("not_a_tool")(object)
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: calculator\n  - name: echo_test_tool\n    config: {x: 1}\n")
    tools = load_tools(str(path))
    assert list(tools) == ["calculator", "echo_test_tool"] and tools["echo_test_tool"].config == {"x": 1}
    assert list(load_tools(None)) == ["calculator"]
    path.write_text("tools:\n  - name: calculater\n")
    with pytest.raises(UserError, match="did you mean 'calculator'"):
        load_tools(str(path))
    path.write_text("tools: []\n")
    with pytest.raises(UserError, match="non-empty list"):
        load_tools(str(path))
    path.write_text("tools:\n  - name: http\n")
    with pytest.raises(UserError, match="config.url"):
        load_tools(str(path))


class _Service(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["arguments"].get("fail"):
            self.send_response(500)
            self.end_headers()
            return
        reply = {"result": f"{body['name']}:{body['arguments']['query']}:{body['instance_id']}"}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/call"
    server.shutdown()
    server.server_close()
    thread.join()


def test_http_tool_against_a_local_service(service):
    tool = get_tool_class("http")({"url": service, "name": "search", "description": "search the web",
                                   "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}})
    assert tool.schema["function"]["name"] == "search"
    tools = {"search": tool}
    calls = [ToolCall("search", {"query": "q1"}), ToolCall("search", {"query": "q2", "fail": True})]
    asyncio.run(run_calls([("traj-7", calls)], tools, timeout_s=10, max_chars=100))
    assert calls[0].result == "search:q1:traj-7" and calls[0].error is None
    assert calls[1].error == "ToolError: service returned HTTP 500"
    dead = get_tool_class("http")({"url": "http://127.0.0.1:9/nothing", "timeout_s": 2})
    call = ToolCall("http", {})
    asyncio.run(run_calls([("t", [call])], {"http": dead}, timeout_s=10, max_chars=100))
    assert "service unreachable" in call.error


def test_calls_of_different_trajectories_run_concurrently():
    """Each call waits until all three have started (an asyncio barrier): run one after the other, the first
    would time out."""

    class Meet(Tool):
        def __init__(self):
            super().__init__()
            self.barrier = None

        async def call(self, arguments, *, instance_id=None):
            self.barrier = self.barrier or asyncio.Barrier(3)
            await self.barrier.wait()
            return instance_id

    tools = {"meet": Meet()}
    rounds = [(f"t{i}", [ToolCall("meet")]) for i in range(3)]
    asyncio.run(run_calls(rounds, tools, timeout_s=30, max_chars=100))
    assert [calls[0].result for _, calls in rounds] == ["t0", "t1", "t2"]
    assert all(calls[0].error is None for _, calls in rounds)
