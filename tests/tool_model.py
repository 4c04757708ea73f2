"""A Qwen2-style random-weight model whose chat template teaches tools the way Qwen2.5's does
(tools listed in <tools>, calls written as <tool_call> JSON, answers in <tool_response>), with
the default model's tokenizer plus Qwen's two added tokens."""

from __future__ import annotations

from pathlib import Path

import transformers
from model_helpers import save_random_model

from vmkv.models import load_tokenizer, resolve_model

#: Qwen2.5-Instruct's template, trimmed to the parts tools use
QWEN_TOOL_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": "
    "<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
""".strip()


def save_qwen_tool_model(path: Path, special: tuple[str, ...] = (),
                         template: str | dict[str, str] = QWEN_TOOL_TEMPLATE,
                         scale: float = 0.2) -> Path:
    """Write the model and its tokenizer to ``path`` and return it. ``special``: more tokens,
    added as special tokens (``skip_special_tokens`` drops them from the text), instead of
    Qwen's two plain ones; ``template``: the chat template (a dict: named templates);
    ``scale``: of the random weights (small: logits near 0, which logit biases then steer)."""
    tokenizer = load_tokenizer(resolve_model(None, progress=False))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    else:
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer) + 64, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None, pad_token_id=None, architectures=["Qwen2ForCausalLM"])
    save_random_model(config, path, seed=0, scale=scale)
    return path
