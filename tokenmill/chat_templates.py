"""Chat templates the package ships (tokenmill/templates) and a GGUF model's own, from its metadata.

The tokenizer, the API server and the router all read templates from here. HF's GGUF tokenizer conversion drops
`tokenizer.chat_template`, which llama.cpp's files carry; we read it back. A file without one (the Gemma 3 270M
Q4_K_M package's) gets its architecture's own template, shipped here, so that chat requests work as they would
with the model's HF tokenizer. Imports no torch: the API server loads tokenizers too."""
from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).parent / "templates"
SHIPPED_TEMPLATES = {path.stem: path for path in TEMPLATES_DIR.glob("*.jinja")}

# GGUF architecture → the shipped template for files without one
ARCH_TEMPLATES = {"gemma3": "gemma3"}


def load_chat_template(value: str) -> str:
    """--chat-template: a shipped template's name, a file, or the Jinja text itself."""
    if value in SHIPPED_TEMPLATES:
        return SHIPPED_TEMPLATES[value].read_text()
    if "{{" in value or "{%" in value:
        return value
    return Path(value).read_text()


def gguf_chat_template(path: str) -> str | None:
    from tokenmill.gguf_file import gguf_reader
    fields = gguf_reader(path).fields
    if "tokenizer.chat_template" in fields:
        return fields["tokenizer.chat_template"].contents()
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    name = ARCH_TEMPLATES.get(arch)
    if name is None:
        return None
    return SHIPPED_TEMPLATES[name].read_text()
