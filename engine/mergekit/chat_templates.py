"""mergekit's `chat_template`: `auto`, one of the templates mergekit ships by name, or Jinja text.

The named templates are written here anew. Each renders every conversation as mergekit's
template of that name does where transformers renders chat templates (trim_blocks and
lstrip_blocks on): the same text, whitespace included, and the same refusals (mistral's
alternation). `auto` takes the template most of the merged models' tokenizers carry, stripped
of surrounding whitespace, as mergekit does; a text is written as given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import RecipeError, quoted

AUTO = "auto"
FIELD = "chat_template"

# Each message: <|im_start|>role, the content, <|im_end|>; the prompt opens an assistant turn.
_CHATML = (
    "{%- for turn in messages %}"
    "{{- '<|im_start|>' + turn.role + '\\n' + turn.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's headers, the content trimmed, each turn followed by a newline; bos before the first.
_LLAMA3 = (
    "{%- for turn in messages %}"
    "{{- (bos_token if loop.first else '') + '<|start_header_id|>' + turn.role"
    " + '<|end_header_id|>\\n\\n' + turn.content | trim + '<|eot_id|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
# The last system message first; then ### Instruction / Response / Input sections, two blank
# lines between them; other roles are left out.
_ALPACA = (
    "{%- set systems = messages | selectattr('role', 'equalto', 'system') | list %}"
    "{{- ((systems | last).content | trim if systems else '') + '\\n\\n' }}"
    "{%- for turn in messages %}"
    "{%- set heading = {'user': 'Instruction', 'assistant': 'Response',"
    " 'user_context': 'Input'}.get(turn.role) %}"
    "{%- if heading %}"
    "{{- '### ' + heading + ':\\n' + turn.content | trim }}"
    "{%- if not loop.last %}{{- '\\n\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and messages[-1].role != 'assistant' %}"
    "{{- '### Response:\\n' }}"
    "{%- endif %}"
)
# EXAONE's [|role|] markers, with the indentation and blank lines mergekit's template renders.
_EXAONE = (
    "{%- for turn in messages %}"
    "{%- if loop.first and turn.role != 'system' %}"
    "{{- '        [|system|][|endofturn|]\\n\\n' }}"
    "{%- endif %}"
    "{{- '    [|' + turn.role + '|]' + turn.content + '\\n' }}"
    "{{- '        \\n\\n' if turn.role == 'user' else '        [|endofturn|]\\n\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '    [|assistant|]\\n' }}{%- endif %}"
)
# [INST] turns after bos, a leading system message folded into the first; user and assistant
# must alternate, starting with the user.
_MISTRAL = (
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set turns = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for turn in turns %}"
    "{%- if (turn.role == 'user') != (loop.index0 is even) %}"
    "{{- raise_exception('after an optional system message, the turns must alternate user, "
    "assistant, user, ...') }}"
    "{%- elif turn.role == 'user' %}"
    "{{- ' [INST] ' + (system + '\\n\\n' if loop.first and system is defined else '')"
    " + turn.content + ' [/INST]' }}"
    "{%- elif turn.role == 'assistant' %}"
    "{{- ' ' + turn.content + eos_token }}"
    "{%- else %}"
    "{{- raise_exception('only user and assistant turns may follow the system message') }}"
    "{%- endif %}"
    "{%- endfor %}"
)
NAMED = {
    "alpaca": _ALPACA,
    "chatml": _CHATML,
    "exaone": _EXAONE,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
}


@dataclass(frozen=True)
class Chosen:
    """The template a config's `chat_template` gives the output; None: the tokenizer's own."""

    text: str | None
    warnings: tuple[str, ...] = ()


def check(value: Any) -> None:
    """Refuse, naming the field, what mergekit would not take as a chat template."""
    if value is None:
        return
    if not isinstance(value, str):
        raise RecipeError.for_field(FIELD, f"must be text (got {quoted(value)})")
    if value == AUTO or value in NAMED:
        return
    if len(value) < 20 or "{" not in value:
        raise RecipeError.for_field(
            FIELD,
            f"{quoted(value)}: neither auto, one of mergekit's templates "
            f"({', '.join(sorted(NAMED))}) nor a Jinja template",
        )


def choose(value: Any, templates: Sequence[tuple[str, str | None]]) -> Chosen:
    """The template for a checked `chat_template`; `templates` are the merged models' own
    (label, template or None), in the recipe's order, which `auto` reads."""
    if value is None:
        return Chosen(None)
    if value == AUTO:
        return most_common(templates)
    if value in NAMED:
        return Chosen(NAMED[value])
    return Chosen(str(value))


def most_common(templates: Sequence[tuple[str, str | None]]) -> Chosen:
    """mergekit's `auto`: the template most models carry (stripped); None when none does. mergekit
    breaks a tie by the order of a set of its models, which may change from run to run;
    Layerswap takes the first in the recipe's order, and says so."""
    found = [(label, t.strip()) for label, t in templates if t]
    if not found:
        return Chosen(None)
    counts = Counter(t for _, t in found)
    ranked = counts.most_common()
    best = ranked[0][0]
    tied = [t for t, n in ranked if n == ranked[0][1]]
    if len(tied) == 1:
        return Chosen(best)
    owners = [next(label for label, t in found if t == template) for template in tied]
    return Chosen(
        best,
        (
            f"{FIELD} auto: the templates of {', '.join(owners)} are as common as each other; "
            f"mergekit takes whichever its set of models yields first, Layerswap {owners[0]}'s",
        ),
    )
