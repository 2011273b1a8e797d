"""Ollama's Modelfile beside a GGUF: the chat template turned into a Go TEMPLATE, stop tokens, parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELFILE_NAME = "Modelfile"
ROLES = ("system", "user", "assistant")
_MARK = "\x00{}\x00"  # message contents no template rewrites: where they land splits the rendering into pieces
# Ollama's Modelfile instructions and PARAMETER names (docs/modelfile.md of ollama/ollama).
INSTRUCTIONS = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "ADAPTER", "LICENSE", "MESSAGE", "REQUIRES")
PARAMETERS = ("num_ctx", "repeat_last_n", "repeat_penalty", "temperature", "seed", "stop", "num_predict", "top_k",
              "top_p", "min_p", "num_gpu", "num_thread", "mirostat", "mirostat_eta", "mirostat_tau")
_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)


@dataclass(frozen=True)
class TemplatePieces:
    """A chat template as text around each message: head, (before, after) per role, then the generation prompt."""

    head: str
    around: dict[str, tuple[str, str]]
    generation: str

    def render(self, messages: list[dict[str, str]]) -> str:
        body = "".join(self.around[m["role"]][0] + m["content"] + self.around[m["role"]][1] for m in messages)
        return self.head + body + self.generation

    def go_template(self) -> str:
        """The same rendering as an Ollama (Go text/template) TEMPLATE: no `{{-`, so no whitespace is trimmed."""
        branches = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}'
                           f"{before}{{{{ .Content }}}}{after}"
                           for i, (role, (before, after)) in enumerate(self.around.items()))
        return f"{self.head}{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{self.generation}"


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def template_pieces(tokenizer: Any) -> TemplatePieces | None:
    """Split the tokenizer's chat template into pieces by rendering marked messages with it (transformers' own
    renderer); None when the template is not uniform per message (then it is checked against a whole
    conversation: system, user, assistant, user, generation prompt)."""
    try:
        around, heads = {}, set()
        for role in ROLES:
            one, two = _MARK.format(role + "1"), _MARK.format(role + "2")
            single = _render(tokenizer, [{"role": role, "content": one}], False)
            double = _render(tokenizer, [{"role": role, "content": one}, {"role": role, "content": two}], False)
            lead, after = single.split(one)
            between = double.split(one)[1].split(two)[0]
            if not between.startswith(after):
                return None
            before = between[len(after):]
            if not lead.endswith(before):
                return None
            heads.add(lead[: len(lead) - len(before)])
            around[role] = (before, after)
        user = [{"role": "user", "content": _MARK.format("u")}]
        generation = _render(tokenizer, user, True)[len(_render(tokenizer, user, False)):]
    except Exception:  # noqa: BLE001 - a template that refuses these conversations is just not convertible
        return None
    if len(heads) != 1:
        return None
    pieces = TemplatePieces(head=heads.pop(), around=around, generation=generation)
    probe = [{"role": r, "content": c} for r, c in (("system", "Be brief."), ("user", "Hi there"),
                                                    ("assistant", "Hello!"), ("user", "2 + 2?"))]
    try:
        if pieces.render(probe) != _render(tokenizer, probe, True):
            return None
    except Exception:  # noqa: BLE001
        return None
    if any("{{" in p or '"""' in p for p in (pieces.head, pieces.generation, *sum(around.values(), ()))):
        return None
    return pieces


def stop_tokens(tokenizer: Any, pieces: TemplatePieces | None) -> list[str]:
    """eos, and every special token that closes an assistant turn in the template (e.g. <|im_end|>, <|eot_id|>)."""
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    if pieces is not None:
        after = pieces.around["assistant"][1]
        stops += [t for t in tokenizer.all_special_tokens if t and t in after and t not in stops]
    return stops


def modelfile_text(gguf_name: str, tokenizer: Any, num_ctx: int) -> tuple[str, bool]:
    """The Modelfile for ./gguf_name, and whether its TEMPLATE came from the chat template."""
    pieces = template_pieces(tokenizer) if tokenizer.chat_template else None
    lines = ["# Written by memfit: `ollama create NAME -f Modelfile` in this folder.", f"FROM ./{gguf_name}"]
    if pieces is not None:
        lines.append(f'TEMPLATE """{pieces.go_template()}"""')
    else:
        lines.append("# No TEMPLATE: the chat template is not one memfit can convert (or there is none); Ollama "
                     "falls back to the GGUF's tokenizer.chat_template where it recognises it.")
    lines += [f"PARAMETER stop {_quote(s)}" for s in stop_tokens(tokenizer, pieces)]
    lines.append(f"PARAMETER num_ctx {num_ctx}")
    return "\n".join(lines) + "\n", pieces is not None


def with_adapter(text: str, base: str, adapter: str) -> str:
    """A Modelfile whose FROM is the base GGUF (`base`: a name in the folder, or an absolute path to a base the
    user already has) and whose ADAPTER is the LoRA adapter GGUF beside it: Ollama applies it to that base."""
    ref = base if base.startswith("/") else f"./{base}"
    lines = [f"FROM {ref}" if ln.startswith("FROM ") else ln for ln in text.splitlines()]
    at = next(i for i, ln in enumerate(lines) if ln.startswith("FROM "))
    lines.insert(at + 1, f"ADAPTER ./{adapter}")
    return "\n".join(lines) + "\n"


def check_paths(parsed: list[tuple[str, str]], folder: Path) -> None:
    """Every FROM and ADAPTER that names a file (./NAME relative to the Modelfile, or /absolute) exists, as
    `ollama create` needs; ValueError naming the first missing one. A FROM naming a model (llama3.2) is not a file."""
    for word, arg in parsed:
        named_file = word in ("FROM", "ADAPTER") and arg.startswith(("./", "../", "/"))
        if named_file and not (folder / arg).is_file():
            raise ValueError(f"{word} {arg}: no such file beside the Modelfile ({folder})")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs as Ollama's parser reads them; ValueError names the first bad line.
    Checks: known instructions and PARAMETER names, FROM first, closed triple quotes, balanced Go actions."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line, i = lines[i].strip(), i + 1
        if not line or line.startswith("#"):
            continue
        word, _, arg = line.partition(" ")
        if word.upper() not in INSTRUCTIONS:
            raise ValueError(f"line {i}: unknown instruction {word!r}")
        if arg.startswith('"""'):
            body = arg[3:]
            while '"""' not in body:
                if i >= len(lines):
                    raise ValueError(f"line {i}: unterminated \"\"\" in {word}")
                body, i = body + "\n" + lines[i], i + 1
            arg, rest = body.split('"""', 1)
            if rest.strip():
                raise ValueError(f"line {i}: text after the closing \"\"\"")
        if word.upper() == "PARAMETER":
            name, _, value = arg.partition(" ")
            if name not in PARAMETERS or not value:
                raise ValueError(f"line {i}: bad PARAMETER {arg!r}")
            if value.startswith('"') and not (len(value) > 1 and value.endswith('"')):
                raise ValueError(f"line {i}: unclosed quote in {arg!r}")
        if word.upper() == "TEMPLATE":
            check_go_template(arg)
        if word.upper() == "ADAPTER" and not arg.strip():
            raise ValueError(f"line {i}: ADAPTER needs the adapter's path (a GGUF or safetensors LoRA)")
        out.append((word.upper(), arg))
    if not out or out[0][0] != "FROM":
        raise ValueError("a Modelfile starts with FROM")
    return out


def check_go_template(template: str) -> None:
    """Go text/template structure: every {{ if/range/with }} closed by {{ end }}, else only inside an if."""
    stack = []
    for action in _ACTION.findall(template):
        word = action.split(" ", 1)[0]
        if word in ("if", "range", "with"):
            stack.append(word)
        elif word == "else":
            if not stack or stack[-1] not in ("if", "with", "range"):
                raise ValueError(f"template: {{{{ {action} }}}} outside an if")
        elif word == "end":
            if not stack:
                raise ValueError("template: {{ end }} without an open block")
            stack.pop()
    if stack:
        raise ValueError(f"template: {len(stack)} block(s) not closed: {', '.join(stack)}")
    if template.count("{{") != template.count("}}"):
        raise ValueError("template: unbalanced {{ }}")
