"""A GGUF model's chat template, from its metadata.

HF's GGUF tokenizer conversion drops `tokenizer.chat_template`, which llama.cpp's files carry; we read it back.
A file without one (the Gemma 3 270M Q4_K_M package's) gets its architecture's own template, shipped in
server/templates, so that chat requests work as they would with the model's HF tokenizer. Imports no torch:
the API server loads tokenizers too."""
from __future__ import annotations

# GGUF architecture → the shipped template (server/templates, chat_utils.SHIPPED_TEMPLATES) for files without one
ARCH_TEMPLATES = {"gemma3": "gemma3"}


def gguf_chat_template(path: str) -> str | None:
    from tokenmill.gguf_file import gguf_reader
    fields = gguf_reader(path).fields
    if "tokenizer.chat_template" in fields:
        return fields["tokenizer.chat_template"].contents()
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    name = ARCH_TEMPLATES.get(arch)
    if name is None:
        return None
    from tokenmill.server.chat_utils import SHIPPED_TEMPLATES
    return SHIPPED_TEMPLATES[name].read_text()
