"""Generate sharegpt_synthetic.json: a deterministic stand-in for the ShareGPT dataset (nothing can be downloaded).

Only the shape matters to a serving benchmark: how long prompts and replies are, how skewed, how many rounds.
Human turns are log-normal (median ~40 words) with a tail made of pasted code and documents; assistant replies
are log-normal (median ~180 words). The text is English-ish prose, lists and code built from word lists, so
tokenizers see a realistic mix of words, punctuation and code symbols.

    python -m tokenmill.bench.data.make_sharegpt [--num 1000] [--seed 0] [--output PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import string

NOUNS = ("system", "team", "user", "project", "result", "process", "model", "customer", "report", "budget",
         "schedule", "document", "feature", "market", "strategy", "problem", "solution", "garden", "recipe",
         "city", "student", "teacher", "company", "product", "habit", "routine", "network", "library",
         "platform", "workflow", "deadline", "meeting", "proposal", "decision", "community", "experience",
         "database", "interface", "article", "story", "character", "audience", "message", "goal", "question")
ADJS = ("simple", "important", "efficient", "clear", "reliable", "modern", "common", "useful", "difficult",
        "practical", "flexible", "careful", "consistent", "popular", "large", "small", "new", "key", "specific",
        "detailed", "robust", "friendly", "professional", "creative", "realistic", "long-term", "basic")
VERBS = (("improve", "improves"), ("support", "supports"), ("reduce", "reduces"), ("change", "changes"),
         ("explain", "explains"), ("affect", "affects"), ("handle", "handles"), ("create", "creates"),
         ("organize", "organizes"), ("track", "tracks"), ("review", "reviews"), ("build", "builds"),
         ("measure", "measures"), ("describe", "describes"), ("simplify", "simplifies"), ("define", "defines"),
         ("protect", "protects"), ("share", "shares"), ("test", "tests"), ("plan", "plans"))
ADVS = ("quickly", "carefully", "often", "usually", "clearly", "directly", "gradually", "easily", "regularly")
OPENERS = ("However,", "In addition,", "For example,", "As a result,", "In practice,", "On the other hand,",
           "Overall,", "In many cases,", "That said,", "Importantly,", "First,", "Finally,")
# {n} noun, {a} adjective, {v} verb, {vs} verb with -s, {r} adverb, {t} a term of the conversation's topic.
SENTENCES = (
    "The {a} {n} {vs} the {n} when it is used {r}.",
    "A {a} approach to {t} can {v} the {n} and {v} the {n}.",
    "You should {v} the {n} before you {v} the {a} {n}.",
    "Most people {v} their {n} {r}, but a {a} {n} {vs} more.",
    "This is why {t} is {a} for any {n} that needs to {v} a {n}.",
    "It is {a} to {v} the {n} {r}, because the {n} {vs} the {a} {n}.",
    "When the {n} {vs} the {n}, the {a} {n} {vs} as well.",
    "Think of {t} as a {a} {n} that {vs} every {n} in the {n}.",
    "If you {v} {t} {r}, the {n} will be more {a}.",
    "There are several ways to {v} a {a} {n}, and {t} is one of them.",
)
TOPICS = {
    "coding": ("error handling", "recursion", "unit testing", "caching", "a REST API", "type hints", "async code",
               "a database index", "dependency injection", "a regular expression", "pagination", "logging"),
    "writing": ("the opening paragraph", "a cover letter", "a product description", "a short story",
                "a blog post", "a wedding speech", "a persuasive essay", "a LinkedIn post", "a poem"),
    "maths": ("linear equations", "percentages", "probability", "compound interest", "the quadratic formula",
              "fractions", "averages", "unit conversion"),
    "advice": ("time management", "a job interview", "learning a language", "saving money", "better sleep",
               "a difficult conversation", "starting a business", "moving to a new city", "public speaking"),
    "trivia": ("the Roman Empire", "black holes", "the printing press", "coral reefs", "the Olympic Games",
               "volcanoes", "the human brain", "the Silk Road", "honey bees", "the history of tea"),
    "summarisation": ("the meeting notes", "the article", "the research abstract", "the chapter",
                      "the customer feedback", "the press release", "the policy document"),
}
TOPIC_WEIGHTS = {"coding": 30, "writing": 18, "maths": 8, "advice": 16, "trivia": 14, "summarisation": 14}
LANGS = ("Python", "JavaScript", "SQL")
ASKS = {
    "coding": ("Write a {lang} function that can {v} a {n} and handle {t}.", "How do I use {t} in {lang}?",
               "Can you explain {t} in {lang} with an example?", "Why does my {lang} code fail to {v} the {n}?"),
    "writing": ("Write {t} about a {a} {n} for a {a} audience.", "Can you help me plan {t}?",
                "Give me some ideas for {t} about a {n}."),
    "advice": ("What are some tips for {t}?", "I need advice about {t}. How can I {v} my {n}?",
               "How should I prepare for {t} if my {n} is not very {a}?"),
    "trivia": ("Tell me some interesting facts about {t}.", "What is the history of {t}?",
               "Explain how {t} works in simple terms."),
}
FOLLOW_UPS = ("Can you make it shorter?", "Thanks! Could you explain {t} in more detail?",
              "What about a {a} {n}?", "Can you give me another example?", "Please rewrite it to be more {a}.",
              "That helps. How would this {v} the {n}?", "Can you put that in a table?", "Why is that?")
PASTE_ASKS = {
    "coding": ("Can you review this code and tell me how to {v} it?", "Here is my code. What does it do?",
               "This code is supposed to {v} the {n} but it is slow. Any ideas?"),
    "writing": ("Please proofread this and make it more {a}:", "Rewrite the following text in a {a} tone:"),
    "summarisation": ("Summarize {t} below in a few bullet points:", "Give me a short summary of {t}:",
                      "What are the key points of {t}?"),
}


def _fill(rng: random.Random, template: str, topic_terms) -> str:
    def pick(m: re.Match) -> str:
        kind = m.group(1)
        if kind == "vs":
            return rng.choice(VERBS)[1]
        return rng.choice({"n": NOUNS, "a": ADJS, "v": [v for v, _ in VERBS], "r": ADVS,
                           "t": topic_terms, "lang": LANGS}[kind])
    text = re.sub(r"\{(vs|n|a|v|r|t|lang)\}", pick, template)
    return re.sub(r"\b([Aa]) (?=[aeio])", r"\1n ", text)


def _sentence(rng: random.Random, terms) -> str:
    s = _fill(rng, rng.choice(SENTENCES), terms)
    if rng.random() < 0.3:
        s = rng.choice(OPENERS) + " " + s[0].lower() + s[1:]
    return s


def _words(text: str) -> int:
    return len(text.split())


def _prose(rng: random.Random, terms, budget: int) -> str:
    paragraphs, used = [], 0
    while used < budget:
        para = " ".join(_sentence(rng, terms) for _ in range(rng.randint(2, 5)))
        paragraphs.append(para)
        used += _words(para)
    return "\n\n".join(paragraphs)


def _bullets(rng: random.Random, terms, budget: int, numbered: bool) -> str:
    items, used = [], 0
    while used < budget:
        head = " ".join(_fill(rng, "{a} {n}", terms).split()).capitalize()
        item = f"**{head}**: " + " ".join(_sentence(rng, terms) for _ in range(rng.randint(1, 2)))
        items.append(item)
        used += _words(item)
    return "\n".join((f"{i}. " if numbered else "- ") + it for i, it in enumerate(items, 1))


def _ident(rng: random.Random) -> str:
    return rng.choice([v for v, _ in VERBS]) + "_" + rng.choice(NOUNS)


def _code(rng: random.Random, lang: str, budget: int) -> str:
    """Plausible-looking code of about `budget` whitespace-separated words, in a fenced block."""
    blocks, used = [], 0
    while used < budget:
        name, arg, other = _ident(rng), rng.choice(NOUNS), rng.choice(NOUNS) + "s"
        if lang == "Python":
            block = (f"def {name}({arg}, {other}=None, limit={rng.randint(1, 100)}):\n"
                     f'    """{_sentence(rng, ("the input",))}"""\n'
                     f"    result = []\n    for item in {other} or []:\n"
                     f"        if item.{rng.choice(NOUNS)} > limit:\n            continue\n"
                     f"        result.append({_ident(rng)}(item, {arg}))\n"
                     f"    # {_sentence(rng, ('the loop',))}\n    return result\n")
        elif lang == "JavaScript":
            camel = name.split("_")[0] + name.split("_")[1].capitalize()
            block = (f"async function {camel}({arg}, options = {{}}) {{\n"
                     f"  const {other} = await fetch(`/api/{arg}/${{options.id}}`).then((r) => r.json());\n"
                     f"  // {_sentence(rng, ('the response',))}\n"
                     f"  return {other}.filter((x) => x.{rng.choice(NOUNS)} !== null).map((x) => x.value);\n}}\n")
        else:
            table = rng.choice(NOUNS) + "s"
            block = (f"SELECT {arg}_id, COUNT(*) AS total, AVG({rng.choice(NOUNS)}_score) AS score\n"
                     f"FROM {table}\nJOIN {other} ON {other}.{arg}_id = {table}.id\n"
                     f"WHERE {table}.created_at > '2023-0{rng.randint(1, 9)}-01'\n"
                     f"GROUP BY {arg}_id\nORDER BY total DESC\nLIMIT {rng.randint(5, 50)};\n")
        blocks.append(block)
        used += _words(block)
    return f"```{lang.lower()}\n" + "\n".join(blocks) + "```"


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def _maths(rng: random.Random) -> tuple[str, str]:
    """A small problem with its real worked answer, so the reply's numbers are right."""
    a, x, b = rng.randint(2, 12), rng.randint(-20, 40), rng.randint(1, 90)
    c = a * x + b
    ask = rng.choice((f"Solve for x: {a}x + {b} = {c}", f"How do I solve {a}x + {b} = {c}? Please show the steps.",
                      f"My homework says {a}x + {b} = {c}. What is x and why?"))
    steps = (f"To solve {a}x + {b} = {c}, isolate x step by step.\n\n"
             f"1. Subtract {b} from both sides: {a}x = {c} - {b} = {c - b}\n"
             f"2. Divide both sides by {a}: x = {c - b} / {a} = {x}\n"
             f"3. Check: {a} * {x} + {b} = {a * x} + {b} = {c}\n\n**Answer:** x = {x}")
    return ask, steps


def _human(rng: random.Random, topic: str, terms, first: bool, problem) -> str:
    if not first:
        # Follow-ups are mostly short; some paste more material or ask a long question.
        if rng.random() < 0.5:
            return _fill(rng, rng.choice(FOLLOW_UPS), terms)
        target = _lognormal(rng, 45, 0.9, 5, 800)
    else:
        target = _lognormal(rng, 55, 0.95, 3, 800)
    if topic == "maths":
        ask = problem[0]
        return ask if target < 40 else _prose(rng, terms, target - 20) + "\n\n" + ask
    # Long prompts in the wild are mostly pasted material, not long questions.
    if topic in PASTE_ASKS and (target > 120 or (target > 50 and rng.random() < 0.3)):
        ask = _fill(rng, rng.choice(PASTE_ASKS[topic]), terms)
        budget = target - _words(ask)
        if topic == "coding":
            return ask + "\n\n" + _code(rng, rng.choice(LANGS), budget)
        return ask + "\n\n" + _prose(rng, terms, budget)
    asks = ASKS.get(topic, ASKS["trivia"])
    text = _fill(rng, rng.choice(asks), terms)
    # Add context sentences one at a time so short prompts stay short.
    while _words(text) + 10 < target:
        text = _sentence(rng, terms) + " " + text if rng.random() < 0.5 else text + " " + _sentence(rng, terms)
    return text


def _gpt(rng: random.Random, topic: str, terms, problem) -> str:
    target = _lognormal(rng, 150, 0.6, 8, 900)
    intro = _sentence(rng, terms)
    if topic == "maths":
        steps = problem[1]
        return steps + ("\n\n" + _prose(rng, terms, target - 60) if target > 80 else "")
    if topic == "coding":
        code = _code(rng, rng.choice(LANGS), int(target * 0.45))
        return (f"{intro}\n\n{code}\n\n**How it works:**\n\n"
                + _bullets(rng, terms, int(target * 0.35), numbered=True) + "\n\n" + _sentence(rng, terms))
    if topic == "advice" or (topic == "trivia" and rng.random() < 0.4):
        return intro + "\n\n" + _bullets(rng, terms, target - 30, numbered=True) + "\n\n" + _sentence(rng, terms)
    if topic == "summarisation":
        return "Here is a summary of the key points:\n\n" + _bullets(rng, terms, target - 8, numbered=False)
    return _prose(rng, terms, target)


def generate(num: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    topics = list(TOPIC_WEIGHTS)
    data, seen = [], set()
    while len(data) < num:
        cid = "".join(rng.choices(string.ascii_letters + string.digits, k=7))
        if cid in seen:
            continue
        seen.add(cid)
        topic = rng.choices(topics, weights=[TOPIC_WEIGHTS[t] for t in topics])[0]
        terms = (rng.choice(TOPICS[topic]),)  # one subject per conversation, as in real chats
        rounds = rng.choices((1, 2, 3, 4), weights=(62, 20, 11, 7))[0]
        # A maths chat stays on one problem, so every reply's worked answer matches the question.
        problem = _maths(rng) if topic == "maths" else None
        turns = []
        for r in range(rounds):
            turns.append({"from": "human", "value": _human(rng, topic, terms, r == 0, problem)})
            turns.append({"from": "gpt", "value": _gpt(rng, topic, terms, problem)})
        data.append({"id": f"{cid}_0", "conversations": turns})
    return data


def _summary(data: list[dict]) -> str:
    lines = [f"conversations: {len(data)}, turns: {sum(len(c['conversations']) for c in data)}"]
    for role in ("human", "gpt"):
        w = sorted(_words(t["value"]) for c in data for t in c["conversations"] if t["from"] == role)
        lines.append(f"{role}: turns {len(w)}, words median {statistics.median(w):.0f}, "
                     f"p90 {w[int(0.9 * (len(w) - 1))]}, p99 {w[int(0.99 * (len(w) - 1))]}, max {w[-1]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "sharegpt_synthetic.json"))
    args = parser.parse_args()
    data = generate(args.num, args.seed)
    with open(args.output, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(_summary(data))
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
