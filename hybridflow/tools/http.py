"""``http``: forwards each call to a user's service as a JSON POST and returns the response body.

Config keys (the tool's ``config`` in the tool config file): ``url`` (required), ``name``/``description``/
``parameters`` (the schema the model sees; defaults describe a free-form call), ``headers`` (extra request
headers). The request body is ``{"name": <tool name>, "arguments": {...}, "instance_id": ...}``; a 2xx response
body is the observation (a JSON body with a ``"result"`` string field gives that field); any other status, a
connection error or a timeout becomes an error observation. The request runs in a thread
(``asyncio.to_thread``), so calls of different samples proceed concurrently.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any, Optional

from hybridflow.tools.base import Tool, ToolError, register_tool

__all__ = ["HttpTool"]


@register_tool("http")
class HttpTool(Tool):
    """POSTs the call as JSON to ``config["url"]`` (see the module docstring).

    Raises:
        ValueError: at construction, no ``url`` in the config.
    """

    description = "Call an external service."
    parameters = {"type": "object", "properties": {}}

    def __init__(self, config: Optional[dict[str, Any]] = None) -> None:
        super().__init__(config)
        if not self.config.get("url"):
            raise ValueError("the http tool needs config.url (the service to POST calls to)")
        self.url = str(self.config["url"])
        self.timeout_s = float(self.config.get("timeout_s", 30.0))

    @property
    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.config.get("name", self.name),
            "description": self.config.get("description", self.description),
            "parameters": self.config.get("parameters", self.parameters)}}

    def _post(self, body: bytes) -> str:
        headers = {"Content-Type": "application/json", **self.config.get("headers", {})}
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as err:
            raise ToolError(f"service returned HTTP {err.code}") from None
        except (urllib.error.URLError, OSError) as err:
            raise ToolError(f"service unreachable: {err}") from None
        try:
            parsed = json.loads(text)
        except ValueError:
            return text
        return parsed["result"] if isinstance(parsed, dict) and isinstance(parsed.get("result"), str) else text

    async def call(self, arguments: dict[str, Any], *, instance_id: Optional[str] = None) -> str:
        body = json.dumps({"name": self.schema["function"]["name"], "arguments": arguments,
                           "instance_id": instance_id}).encode()
        return await asyncio.to_thread(self._post, body)
