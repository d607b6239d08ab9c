"""whetstone's chat format as a Jinja chat template, for tools that render prompts themselves.

`Tokenizer.save` writes it into tokenizer_config.json, so transformers' `apply_chat_template`
and vLLM/SGLang render exactly what `render_chat(..., thinking=None)` renders. It is Qwen3's
template with the thinking parts taken out; the tool preamble is Qwen3's, word for word.
"""

import json

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)

CHAT_TEMPLATE = (
    "{%- if tools %}\n{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0].role == 'system' %}{{- (messages[0].content or '') + '\\n\\n' }}{%- endif %}\n"
    "{{- " + json.dumps(TOOLS_HEADER) + " }}\n"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}\n"
    "{{- " + json.dumps(TOOLS_FOOTER) + " }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- set content = message.content if message.content is string else '' %}\n"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' + content }}\n"
    "{%- for tool_call in message.tool_calls or [] %}\n"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "{%- set call = tool_call.function if tool_call.function else tool_call %}\n"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}\n'
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""`render_chat(..., thinking=None)` as a Jinja chat template (written into tokenizer_config.json)."""
