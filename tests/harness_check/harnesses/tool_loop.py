"""A tiny harness (the openai SDK): a streamed call that asks for a tool, the tool's result, a second
call with the whole conversation as it got it. Its two calls merge into one sample."""

import openai

client = openai.OpenAI()
tools = [{"type": "function", "function": {"name": "ls", "description": "List the folder.",
                                             "parameters": {"type": "object", "properties": {}}}}]
messages = [{"role": "system", "content": "You list folders."}, {"role": "user", "content": "What is here?"}]
calls: dict[int, dict] = {}
content = ""
for chunk in client.chat.completions.create(model="tiny", messages=messages, tools=tools, stream=True):
    delta = chunk.choices[0].delta if chunk.choices else None
    for call in (delta.tool_calls or []) if delta else []:
        entry = calls.setdefault(call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        entry["id"] = call.id or entry["id"]
        entry["function"]["name"] += (call.function.name or "") if call.function else ""
        entry["function"]["arguments"] += (call.function.arguments or "") if call.function else ""
    content += (delta.content or "") if delta else ""
assert calls, f"no tool call in the stream (content {content!r})"
messages.append({"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]})
messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "notes.txt"})
answer = client.chat.completions.create(model="tiny", messages=messages, tools=tools)
print(answer.choices[0].message.content)
