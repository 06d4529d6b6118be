"""How vLLM turns a Responses API request into the chat messages its prompt is rendered from.

Shared by the simulated engine (which renders the prompt from them, as vLLM does) and the
gateway's prompt keying (which keys a Responses request's prompt as the engine will tokenize it).
The body is taken as checked: an item missing what its type needs raises KeyError or TypeError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class UnsupportedItem(ValueError):
    """An input item vLLM's request model takes but cannot make a chat message of."""


#: item types of the OpenAI API that vLLM's request model takes but cannot make a chat message of
#: (custom tool calls it can: the sim, which has no tools, refuses them too)
UNSUPPORTED_ITEMS = frozenset(
    {
        "item_reference",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "web_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
    }
)


Message = dict[str, Any]


def conversation(
    body: Mapping[str, Any],
    previous_messages: list[Message] | None,
    previous_output: list[dict[str, Any]] | None,
) -> list[Message]:
    """The chat messages vLLM renders the prompt from: this request's instructions as the system
    turn, the previous response's messages without their system turns (instructions do not carry
    over), that response's output text as assistant turns, then this request's input."""
    messages: list[Message] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    if previous_messages is not None:
        messages.extend(m for m in previous_messages if m.get("role") != "system")
    for item in previous_output or ():
        if item.get("type") == "message":
            messages.extend({"role": "assistant", "content": part["text"]} for part in item["content"])
    request_input = body["input"]
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
    else:
        messages.extend(_input_messages(request_input))
    return messages


def _input_messages(items: list[dict[str, Any]]) -> list[Message]:
    """Input items as chat messages; a call or reasoning joins the assistant turn before it, as
    vLLM builds them."""
    messages: list[Message] = []
    for item in items:
        before = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        kind = item.get("type")
        if kind in UNSUPPORTED_ITEMS:
            raise UnsupportedItem(f"Unsupported input item type: {kind}")
        if kind == "function_call":
            call = {
                "id": item["call_id"],
                "function": {"name": item["name"], "arguments": item["arguments"]},
                "type": "function",
            }
            if before is None:
                messages.append({"role": "assistant", "tool_calls": [call]})
            elif before.get("tool_calls") is None:
                before["tool_calls"] = [call]
            else:
                before["tool_calls"].append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]})
        elif kind == "reasoning":
            parts = item.get("content") or item["summary"]
            text = parts[0]["text"] if parts else ""
            if before is not None and before.get("reasoning") is None:
                before["reasoning"] = text
            else:
                messages.append({"role": "assistant", "reasoning": text})
        elif item["role"] == "assistant" and (text := _first_text(item["content"])) is not None:
            if before is not None and before.get("content") is None:
                before["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        else:
            # as given, as vLLM passes a message on; a copy, which the turns after it may fill
            # (the client's body is not this function's to change)
            messages.append(dict(item))
    return messages


def _first_text(content: str | list[dict[str, Any]]) -> str | None:
    """An assistant message's text as vLLM reads it: the string, or its first part's."""
    if isinstance(content, str):
        return content
    return content[0]["text"] if content else None
