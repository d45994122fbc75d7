"""A Qwen-style chat template with tools for the agent gateway's tests (the byte tokenizer has none): tools in a
system turn, assistant tool calls written as `<tool_call>{..}</tool_call>`, tool results as a user turn of
`<tool_response>` blocks."""

from __future__ import annotations

from areal_k8s_testing.byte_tokenizer import build_tokenizer

CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def chat_tokenizer():
    """The byte tokenizer with the template above."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML_TOOLS
    return tokenizer
