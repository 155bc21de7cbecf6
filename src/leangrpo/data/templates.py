"""Chat templates by name or file, one place for every key that takes one.

`data.chat_template` (the prompts' rendering: `true` is the tokenizer's own, a name or a
file another, so a base model without a template can be trained on chat data) and
`environment.chat_template` (multi-turn conversations; unset, it is data.chat_template's
name or file, else the tokenizer's) are read by `load_template(spec, key)`: a bundled name
(`BUNDLED_TEMPLATES`) or the path of a Jinja file, which must compile as transformers
compiles a template (model/tokenizer.py `compiled_template`; jinja2 only, no transformers,
so a bad one is refused among the checks before the model loads). Each failure is one
sentence naming the key (`TemplateError`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leangrpo.errors import UserError
from leangrpo.model.tokenizer import compiled_template

# ChatML with Hermes tool calls: the Qwen2.5-Instruct template (tools listed as JSON in the
# system turn, calls in <tool_call> tags, tool replies grouped into one user turn in
# <tool_response> tags), with a neutral default system message.
CHATML_HERMES = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
BUNDLED_TEMPLATES = {"chatml-hermes": CHATML_HERMES}


class TemplateError(UserError):
    """A chat template cannot be used: unknown, unreadable, invalid, or (environments) it
    cannot render a conversation token-exactly."""


def load_template(spec: str | None, key: str = "environment.chat_template") -> str | None:
    """The template `spec` names: None (the tokenizer's), a bundled name, or a file holding
    a template that compiles as transformers compiles it."""
    if spec is None:
        return None
    if spec in BUNDLED_TEMPLATES:
        return BUNDLED_TEMPLATES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise TemplateError(
            f"{key} = {spec!r} is neither a bundled template ({', '.join(BUNDLED_TEMPLATES)}) nor a file"
        )
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"{key} = {spec!r} cannot be read: {e}") from None
    try:
        compiled_template(source)
    except Exception as e:  # jinja2's TemplateSyntaxError and friends
        line = getattr(e, "lineno", None)
        raise TemplateError(
            f"{key} = {spec!r} is not a valid Jinja template: {getattr(e, 'message', None) or e}{f' (line {line})' if line else ''}; fix the template"
        ) from None
    return source


def data_template(data_cfg: Any) -> str | None:
    """data.chat_template's own template (a name or a file), None for true / false."""
    spec = data_cfg.chat_template
    return load_template(spec, "data.chat_template") if isinstance(spec, str) else None


def conversation_template(cfg: Any) -> str | None:
    """environment.chat_template (agent.chat_template), else data.chat_template's name or
    file (the prompts' template), else None: the tokenizer's."""
    section = cfg.environment if cfg.environment is not None else cfg.agent
    if section.chat_template is not None:
        return load_template(section.chat_template, f"{cfg.multi_turn()[0]}.chat_template")
    return data_template(cfg.data)
