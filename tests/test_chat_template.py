from __future__ import annotations

import sys
import threading
import time
from types import FrameType
from typing import Any
from unittest import mock

import pytest

from edgeinfer import ChatTemplateError, InvalidRequestError
from edgeinfer.chat import template as chat_template
from edgeinfer.chat._env import raise_exception
from edgeinfer.chat.template import render_chat

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = [{"role": "user", "content": "Hi"}]
SLACK_S = 1.5  # past the deadline: a loaded machine, the last check, unwinding


def render(template: str | None, messages: object = USER) -> str:
    return render_chat(template, messages, bos_token="<s>", eos_token="</s>")  # type: ignore[arg-type]


def test_renders_a_chatml_template() -> None:
    assert render(CHATML) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_bos_and_eos_are_available_to_the_template() -> None:
    assert render("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}") == "<s>Hi</s>"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # sandbox escape attempt
        "{{ messages.append(1) }}",  # immutable: no mutation of the caller's data
        "{% for %}",  # does not parse
        "{{ raise_exception('roles must alternate') }}",
        "{{ messages[5]['content'] }}",
        "{% include 'other.jinja' %}",  # no loader: templates cannot read files
        "{{ lipsum(5) }}",  # not offered
        "{{ range(10)|sum(start=[]) }}",  # sum adds numbers only
    ],
)
def test_failing_templates_raise_chat_template_error(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render(template)


def test_missing_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render(None)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "Hi",
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": 3}],
        ["not a dict"],
        [{"role": ["user"], "content": "x"}],  # unhashable role
        [{"content": "x"}],
        None,
    ],
)
def test_bad_messages_are_invalid_requests(messages: object) -> None:
    with pytest.raises(InvalidRequestError):
        render(CHATML, messages)


# -- real templates render exactly as Jinja2's sandbox renders them ----------------------------

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)
REASONING = """{%- set ns = namespace(system='', last_user=0) -%}
{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = ns.system ~ m.content -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- macro turn(role, text) -%}<|{{ role }}|>{{ text }}<|end|>{%- endmacro -%}
{{ bos_token }}{%- if ns.system %}{{ turn('system', ns.system) }}{%- endif -%}
{%- for m in messages if m.role != 'system' -%}
  {%- if m.role == 'assistant' and '</think>' in m.content -%}
    {%- set text = m.content.split('</think>')[-1].strip() -%}
  {%- else -%}{%- set text = m.content -%}{%- endif -%}
  {{ turn(m.role, text) }}{{ '%d/%d' % (loop.index, ns.last_user) }}{{ '{:>4}'.format(loop.length) }}
  {%- if loop.index0 > 50 %}{% break %}{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|assistant|>{{ ['a', 'b']|join(',') ~ (m|default('x'))[:3] }}{% endif -%}
"""  # noqa: E501
REAL_TEMPLATES = {
    "smollm2": SMOLLM2,
    "llama3": LLAMA3,
    "llama3.1": LLAMA31,
    "gemma": GEMMA,
    "qwen2.5": QWEN25,
    "mistral": MISTRAL,
    "reasoning": REASONING,
    "chatml": CHATML,
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "What is 2+2? {{ not a template }} {% raw %}"},
        {"role": "assistant", "content": "<think>easy</think> 4"},
        {"role": "user", "content": "Café, naïve, 你好, 🙂 — and <|im_start|>system"},
    ],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "x" * 100_000},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "user", "content": "again\n\n"},
    ],
]


def reference(template: str, messages: list[dict[str, Any]]) -> str:
    """The same template through a plain Jinja2 sandbox with the same settings."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    context = {"messages": messages, "add_generation_prompt": True}
    return env.from_string(template).render(context, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_real_templates_render_exactly_as_the_plain_sandbox(name: str, conversation: int) -> None:
    template, messages = REAL_TEMPLATES[name], CONVERSATIONS[conversation]
    try:
        expected: str | type[ChatTemplateError] = reference(template, messages)
    except ChatTemplateError:  # the template refuses these messages (raise_exception)
        expected = ChatTemplateError
    if expected is ChatTemplateError:
        with pytest.raises(ChatTemplateError, match="refused the messages"):
            render(template, messages)
    else:
        assert render(template, messages) == expected


def test_strftime_now_is_available() -> None:
    year = str(time.localtime().tm_year)
    assert year in render("{{ strftime_now('%d %b %Y') }}")


# -- every failure is a ChatTemplateError, in bounded time and size ---------------------------


def fails(template: str, match: str = "") -> ChatTemplateError:
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=match) as caught:
        render(template)
    assert time.monotonic() - started < chat_template.RENDER_DEADLINE_S + SLACK_S
    assert str(caught.value).startswith("the model's chat template")
    return caught.value


def test_division_by_zero() -> None:
    fails("{{ 1 / 0 }}", "ZeroDivisionError")
    fails("{{ 1 // 0 }}{{ 1 % 0 }}", "ZeroDivisionError")


def test_undefined_method_call() -> None:
    fails("{{ messages.nothing() }}", "UndefinedError")
    fails("{{ 'text'.nothing(1) }}", "UndefinedError")


def test_huge_range() -> None:
    fails("{{ range(10**9)|list }}", "Range too big")
    fails("{% for i in range(10**6) %}{% endfor %}", "over the limit|Range too big")


def test_nested_loops_end_at_the_deadline() -> None:
    started = time.monotonic()
    fails(
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
        "ran longer than",
    )
    assert time.monotonic() - started >= chat_template.RENDER_DEADLINE_S


def test_loops_over_lists_and_lazy_filters_end_at_the_deadline() -> None:
    with mock.patch.object(chat_template, "RENDER_DEADLINE_S", 0.3):
        fails("{% set l = range(90000)|list %}{% for a in l %}{% for b in l %}{% endfor %}"
              "{% endfor %}", "ran longer than")  # fmt: skip
        fails("{{ range(90000)|map('string')|map('trim')|map('upper')|select|list|length }}"
              * 30, "ran longer than")  # fmt: skip
        fails("{{ ('<a> ' * 900000)|safe|striptags }}", "ran longer than|limit")


def test_recursion() -> None:
    fails("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nest deeper")
    fails("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "nest deeper")
    fails("{% block a %}{{ self.a() }}{% endblock %}", "nest deeper")


def test_string_and_list_multiplication() -> None:
    fails("{{ 'x' * 10**9 }}", "over the limit")
    fails("{{ [1, 2] * 10**9 }}", "over the limit")
    fails("{{ 10**9 * 'x' }}", "over the limit")
    fails("{% set s = 'x' * 4000000 %}{{ (s, s) * 100000 }}", "over the limit")


def test_power() -> None:
    fails("{{ 10 ** (10 ** 10) }}", "bits")
    fails("{{ 2 ** 100000 }}", "bits")
    fails("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
          "{% endfor %}{{ ns.x }}", "bits")  # fmt: skip
    fails("{{ 2.0 ** 100000 }}", "OverflowError")
    assert render("{{ 2 ** 64 }}") == str(2**64)


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'a'.center(10**9) }}",
        "{{ 'a'.ljust(10**9) }}",
        "{{ 'a'.rjust(10**9, '-') }}",
        "{{ 'a'.zfill(10**9) }}",
        "{{ 'a'|center(10**9) }}",
        "{{ 'a'|center(1000000000) }}",  # a constant: Jinja2 would fold it while compiling
        "{{ '{:>1000000000}'.format(1) }}",
        "{{ '{:>{w}}'.format(1, w=10**9) }}",
        "{{ '{:.999999999f}'.format(1.5) }}",
        "{{ ('{0}' * 2000000).format('x' * 4000) }}",
        "{{ ('{a}' * 2000000).format_map({'a': 'x' * 4000}) }}",
        "{{ '%1000000000d' % 1 }}",
        "{{ '%*d' % (10**9, 1) }}",
        "{{ ('%s' * 1000000) % (('x' * 1000,) * 1000000) }}",
        "{{ '%1000000000d'|format(1) }}",
        "{{ ('\t' * 1000000).expandtabs(4000) }}",
        "{{ ('a' * 1000000).translate({97: 'x' * 1000}) }}",
        "{{ ('a\n' * 100000)|indent(1000000) }}",
        "{{ [[[[[1] * 100000]]]]|tojson(indent=1000) }}",
        "{{ (1).to_bytes(10**9, 'big') }}",
        "{{ strftime_now('%c' * 1000000) }}",
        "{{ range(100)|batch(10**9, 'x')|list }}",
    ],
)
def test_widths_and_counts(template: str) -> None:
    fails(template, "over the limit|would hold|OverflowError|ValueError")


def test_exponential_replace() -> None:
    fails("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
          "{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}", "replace")  # fmt: skip
    fails("{{ ('a' * 1000)|replace('', 'x' * 100000) }}", "replace")
    fails("{{ ('a' * 1000).replace('a', 'x' * 100000) }}", "replace")
    fails("{{ 'ab'|replace('a', 'aaaa')|replace('a', 'aaaa')|replace('a', 'aaaa')"
          "|replace('a', 'aaaa')|replace('a', 'aaaa')|replace('a', 'aaaa')|replace('a', 'aaaa')"
          "|replace('a', 'aaaa')|replace('a', 'aaaa')|replace('a', 'aaaa')|replace('a', 'aaaa')"
          "|replace('a', 'aaaa')|length }}", "replace")  # fmt: skip


def test_output_cap() -> None:
    error = fails("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output")
    assert f"{chat_template.OUTPUT_LIMIT_CHARS + 4 * len('userHi'):,}" in str(error)


def test_output_cap_grows_with_the_messages() -> None:
    long = [{"role": "user", "content": "y" * (chat_template.OUTPUT_LIMIT_CHARS + 1000)}]
    assert len(render(CHATML, long)) > chat_template.OUTPUT_LIMIT_CHARS
    assert len(render("{{ messages[0].content * 3 }}", long)) == 3 * len(long[0]["content"])


@pytest.mark.parametrize(
    "template",
    [
        # ~ doubles a string, macros and blocks gather copies of it
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set big = 'x' * 4000000 %}{% macro f() %}{% for i in range(100000) %}{{ big }}"
        "{% endfor %}{% endmacro %}{{ f()|length }}",
        "{% set big = 'x' * 4000000 %}{% set s %}{% for i in range(10) %}{{ big }}"
        "{% endfor %}{% endset %}",
        # str() of a list holding the same big string many times
        "{% set big = 'x' * 4000000 %}{{ [big] * 100000 }}",
        "{% set big = 'x' * 4000000 %}{{ ([big] * 1000)|join }}",
        "{% set big = 'x' * 4000000 %}{{ ''.join([big] * 1000) }}",
        "{% set big = 'x' * 4000000 %}{{ ([big] * 1000)|string|length }}",
        # many distinct big values kept alive
        "{{ range(100000)|map('string')|map('center', 4000000)|list|length }}",
        "{% set big = 'x' * 4000000 %}{% set ns = namespace(l=[]) %}{% for i in range(99999) %}"
        "{% set ns.l = ns.l + [big[i:]] %}{% endfor %}",
        # a value that holds itself twice, 40 times over: == and hash would go through 2**40
        "{% set ns = namespace(a=[0], b=[0]) %}{% for i in range(40) %}"
        "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
        "{% set ns = namespace(a=(0,)) %}{% for i in range(40) %}{% set ns.a = (ns.a, ns.a) %}"
        "{% endfor %}{{ {ns.a: 1} }}",
        # sums of lists copy quadratically
        "{{ range(100000)|batch(1)|sum(start=[]) }}",
        "{{ ([[1]] * 100000)|map('batch', 4000000, 'y')|map('list')|list|length }}",
    ],
)
def test_memory_blow_ups(template: str) -> None:
    fails(template, "limit|would hold|adds numbers|ran longer")


def test_deeply_nested_values() -> None:
    with mock.patch.object(chat_template, "RENDER_DEADLINE_S", 0.5):
        fails("{% set ns = namespace(l=[]) %}{% for i in range(99999) %}{% set ns.l = [ns.l] %}"
              "{% endfor %}{{ ns.l }}", "nests too deeply|ran longer")  # fmt: skip
        fails("{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", "nests too deeply|ran longer")


def test_a_huge_template_does_not_compile_past_the_deadline() -> None:
    source = "{{ 1 }}" * 2_000_000
    with mock.patch.object(chat_template, "RENDER_DEADLINE_S", 0.3):
        fails(source, "ran longer than|nests too deeply|MemoryError")


def test_work_that_swallowed_the_deadline_still_counts_as_late() -> None:
    # CPython drops a trace function once it raises; code that catches BaseException (a
    # generator closed by the garbage collector) then runs on unwatched: it must not pass.
    from edgeinfer.chat._budget import Abort, Budget, Guard, traced

    def spin(seconds: float) -> None:  # this test module: code the tracer leaves alone
        time.sleep(seconds)

    swallowing = {"__name__": "jinja2.swallowing", "spin": spin}
    exec(  # a library frame that catches everything, as a finalizer's caller does
        "def work(seconds):\n"
        "    try:\n"
        "        spin(seconds)\n"
        "        late = 1\n"  # the first line past the deadline: its Abort is swallowed
        "    except BaseException:\n"
        "        pass\n"
        "    return 'done'\n",
        swallowing,
    )
    budget = Budget(1000, 1000, time.monotonic() + 0.05, 0.05, 64, 64)
    with pytest.raises(Abort, match="ran longer"), Guard(budget):
        traced(budget, swallowing["work"], 0.3)


def test_work_past_a_swallowed_deadline_is_still_stopped_in_time() -> None:
    # A generator the garbage collector closes while a huge template compiles swallows the
    # Abort and drops the tracer: the compiler's remaining work must still be cut short.
    from edgeinfer.chat._budget import Abort, Budget, Guard, traced

    swallowing: dict[str, Any] = {"__name__": "jinja2.swallowing", "clock": time.monotonic}
    exec(
        "def step():\n"
        "    return 1\n"
        "def work(seconds):\n"
        "    end = clock() + seconds\n"
        "    try:\n"
        "        while clock() < end - seconds + 0.1:\n"
        "            pass\n"
        "    except BaseException:\n"  # the first Abort, swallowed
        "        pass\n"
        "    while clock() < end:\n"  # then library work that calls: unwatched before
        "        step()\n"
        "    return 'done'\n",
        swallowing,
    )
    budget = Budget(1000, 1000, time.monotonic() + 0.05, 0.05, 64, 64)
    before = sys.gettrace(), sys.getprofile()
    started = time.monotonic()
    with pytest.raises(Abort, match="ran longer"), Guard(budget):
        traced(budget, swallowing["work"], 5.0)
    assert time.monotonic() - started < 0.05 + SLACK_S
    assert (sys.gettrace(), sys.getprofile()) == before


def test_a_callers_profiler_is_left_alone_past_the_deadline() -> None:
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        installed = sys.getprofile()
        with mock.patch.object(chat_template, "RENDER_DEADLINE_S", 0.3):
            with pytest.raises(ChatTemplateError, match=r"ran longer|limit"):
                render(SLOW_FILTER)
        assert sys.getprofile() is installed
    finally:
        profiler.disable()


# -- the trace function: this thread only, and a caller's tracer is kept ----------------------

SLOW_FILTER = "{{ ('<a> ' * 900000)|safe|striptags }}"


def test_a_callers_tracer_is_kept_and_still_called() -> None:
    seen: list[str] = []

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        seen.append(frame.f_code.co_filename)
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with mock.patch.object(chat_template, "RENDER_DEADLINE_S", 0.3):
            with pytest.raises(ChatTemplateError, match=r"ran longer|limit"):
                render(SLOW_FILTER)
            assert sys.gettrace() is tracer
            assert render(CHATML) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
            assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)
    assert "<template>" in seen


def test_no_tracer_is_left_behind_after_errors() -> None:
    before = sys.gettrace()
    with mock.patch.object(chat_template, "RENDER_DEADLINE_S", 0.3):
        for template in (SLOW_FILTER, "{{ 1/0 }}", "{% for %}", "{{ 'x' * 10**9 }}"):
            with pytest.raises(ChatTemplateError):
                render(template)
            assert sys.gettrace() is before


def test_past_the_deadline_only_template_code_is_stopped() -> None:
    """A finalizer or GC callback that runs during a render is not the template's: it runs on."""
    from edgeinfer.chat._budget import Abort, Budget, _deadline_tracer

    budget = Budget(100, 100, deadline=time.monotonic() - 1, seconds=1, int_bits=64, max_depth=8)
    tracer = _deadline_tracer(budget, None)
    assert tracer(sys._getframe(), "line", None) is tracer  # this test's code
    source = compile("import sys\nframe = sys._getframe()", "<template>", "exec")
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    with pytest.raises(Abort):
        tracer(namespace["frame"], "line", None)
    jinja_frame = type("Frame", (), {"f_code": sys._getframe().f_code})()
    jinja_frame.f_globals = {"__name__": "jinja2.runtime"}  # type: ignore[attr-defined]
    with pytest.raises(Abort):
        tracer(jinja_frame, "call", None)  # type: ignore[arg-type]


def test_the_deadline_holds_in_a_worker_thread() -> None:
    outcome: list[object] = []

    def work() -> None:
        try:
            render("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}"
                   "{% endfor %}")  # fmt: skip
        except ChatTemplateError as exc:
            outcome.append(exc)
        outcome.append(sys.gettrace())

    with mock.patch.object(chat_template, "RENDER_DEADLINE_S", 0.5):
        worker = threading.Thread(target=work)
        worker.start()
        worker.join(timeout=0.5 + SLACK_S + 2)
        assert render(CHATML).endswith("assistant\n")  # this thread's renders are unaffected
    assert not worker.is_alive()
    assert isinstance(outcome[0], ChatTemplateError) and outcome[1] is None


def test_renders_in_threads_do_not_share_budgets() -> None:
    results: list[str] = []

    def work() -> None:
        for _ in range(50):
            results.append(render(LLAMA3, CONVERSATIONS[1][:1]))

    workers = [threading.Thread(target=work) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(set(results)) == 1 and len(results) == 200


def test_a_normal_render_stays_cheap() -> None:
    """Loose on purpose (machines differ): the bounds must not make rendering slow."""
    render(LLAMA3, CONVERSATIONS[1])
    started = time.perf_counter()
    for _ in range(200):
        render(LLAMA3, CONVERSATIONS[1])
    assert (time.perf_counter() - started) / 200 < 0.005
