"""Chat templates of the tool-call families, written for the tests in each family's
documented syntax (not copied from any model): a Hermes/Qwen-style one with <tool_call>, a
Llama 3.1-style one with JSON calls and ipython results, a Mistral-style one with
[TOOL_CALLS]."""

HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{ bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
Answer a function call as {"name": function name, "parameters": arguments}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""  # noqa: E501

MISTRAL = """{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"call_id": "{{ message.tool_call_id }}", "content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- elif message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | map(attribute='function') | list | tojson }}{{ eos_token }}
{%- else %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""  # noqa: E501

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The same families in few characters, for the tiny models' 256-token context.
TINY_HERMES = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>"
    "<tool_call>{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "<tool_response>{{ m.content }}</tool_response>{% elif m.tool_calls %}"
    "{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% else %}{{ m.role }}:{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TINY_LLAMA3 = (
    "<|start_header_id|>{% if tools %}ipython{% for t in tools %}{{ t.function.name }}"
    "{% endfor %}{% endif %}{% for m in messages %}{% if m.role == 'tool' %}ipython:"
    "{{ m.content }}{% elif m.tool_calls %}<|python_tag|>"
    "{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% else %}{{ m.role }}:{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
