"""Generate copy_edit.json: copy-heavy prompts (repeat, lightly edit or reformat a given text), the workload where
speculative decoding pays off (vLLM's n-gram proposer reached a mean acceptance length of 4.6 on code editing).

Each entry is {"prompt": ..., "text": ...}: the prompt gives a task and a text, `text` is what a faithful answer
reproduces (the benchmark asks for as many tokens as it has). The texts are the assistant answers of the shipped
synthetic ShareGPT file (prose, lists and code), cut at a paragraph boundary to 60..220 words, so the set is
deterministic and needs nothing from outside.

    python -m tokenmill.bench.data.make_copy_edit [--num 200] [--seed 0] [--output PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import random

HERE = os.path.dirname(__file__)
TASKS = (
    "Repeat the following text exactly, word for word.",
    "Copy the following text without any changes.",
    "Rewrite the following text, keeping every sentence but replacing the word \"{a}\" with \"{b}\".",
    "Reproduce the following text, fixing any typos you find.",
    "Here is a draft. Return it unchanged except for the first sentence, which should start with \"Note:\".",
)
SWAPS = (("important", "essential"), ("simple", "plain"), ("system", "setup"), ("project", "plan"),
         ("user", "reader"), ("process", "procedure"), ("team", "group"), ("result", "outcome"))


def cut(text: str, rng: random.Random) -> str | None:
    """The first paragraphs of text, between 60 and 220 words (None if it has no such prefix)."""
    out, words = [], 0
    limit = rng.randint(120, 220)
    for paragraph in text.split("\n\n"):
        n = len(paragraph.split())
        if words + n > limit:
            break
        out.append(paragraph)
        words += n
    return "\n\n".join(out) if words >= 60 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=os.path.join(HERE, "copy_edit.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(os.path.join(HERE, "sharegpt_synthetic.json")) as f:
        conversations = json.load(f)
    entries = []
    for conv in conversations:
        turns = conv["conversations"]
        if len(turns) < 2:
            continue
        text = cut(turns[1]["value"], rng)
        if text is None:
            continue
        a, b = rng.choice(SWAPS)
        task = rng.choice(TASKS).format(a=a, b=b)
        entries.append({"prompt": f"{task}\n\nText:\n{text}\n\nResult:\n", "text": text})
        if len(entries) == args.num:
            break
    with open(args.output, "w") as f:
        json.dump(entries, f, indent=1)
    print(f"{len(entries)} entries written to {args.output}")


if __name__ == "__main__":
    main()
