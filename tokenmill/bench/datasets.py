"""Benchmark workloads, built completely before a run starts so the client spends nothing on them under load.

Every workload is a list of sessions; a session is one or more turns run one after another (only `multiturn`
has more than one). Lengths are exact in the served model's tokenizer: prompts are made of whole-word tokens
(' word') that re-encode to themselves, so a prompt of N such tokens is N tokens."""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field

DATASETS = ("random", "sharegpt", "prefix", "multiturn", "copy")
SHAREGPT_DEFAULT = os.path.join(os.path.dirname(__file__), "data", "sharegpt_synthetic.json")
COPY_DEFAULT = os.path.join(os.path.dirname(__file__), "data", "copy_edit.json")  # data/make_copy_edit.py


@dataclass
class Turn:
    text: str  # the new user text of this turn
    input_len: int  # tokens of that text (a later turn's prompt also carries the history)
    output_len: int
    tag: str | None = None  # its class in a mixed workload ('short' or 'long'), reported apart


@dataclass
class Session:
    turns: list[Turn]
    think_time_s: float = 0.0  # pause before each turn after the first
    history: list[str] = field(default_factory=list)


class WordPool:
    """Vocabulary entries of the form ' word' that encode back to exactly themselves."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        words = []
        for token_id in range(min(len(tokenizer), 60000)):
            text = tokenizer.decode([token_id])
            if re.fullmatch(r" [a-z]{3,9}", text):
                words.append(text)
        encoded = tokenizer(words, add_special_tokens=False)["input_ids"]
        self.words = [w for w, ids in zip(words, encoded) if len(ids) == 1]
        if len(self.words) < 100:
            raise ValueError("this tokenizer has too few whole-word tokens to build exact-length prompts")

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """Exactly num_tokens tokens of random words (checked; a rare cross-word merge is redrawn)."""
        for _ in range(20):
            text = "".join(rng.choice(self.words) for _ in range(num_tokens))
            if self.count(text) == num_tokens:
                return text
        raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens")


def sample_len(rng: random.Random, mean: int, stddev: float) -> int:
    return max(1, round(rng.gauss(mean, stddev))) if stddev else mean


def random_sessions(pool: WordPool, num: int, input_len: int, input_std: float, output_len: int,
                    output_std: float, seed: int, *, long_share: float = 0.0, long_input_len: int = 0,
                    long_output_len: int = 0) -> list[Session]:
    """num single-turn requests of random words. With long_share, that share of them (rounded, at positions drawn
    from the seed) are long prompts: long_input_len tokens in, long_output_len out, spread as much relative to
    their mean as the short ones (input_std / input_len), as RAG, agents and pasted documents mix into chat.
    Then every request is tagged 'short' or 'long', and the levels report each class apart."""
    rng = random.Random(seed)
    long_at = set(rng.sample(range(num), round(num * long_share))) if long_share else set()
    sessions = []
    for i in range(num):
        long = i in long_at
        n_in = (sample_len(rng, long_input_len, input_std * long_input_len / input_len) if long
                else sample_len(rng, input_len, input_std))
        text = pool.text(n_in, rng)
        n_out = (sample_len(rng, long_output_len, output_std * long_output_len / output_len) if long
                 else sample_len(rng, output_len, output_std))
        tag = ("long" if long else "short") if long_share else None
        sessions.append(Session([Turn(text, n_in, n_out, tag)]))
    return sessions


def prefix_sessions(pool: WordPool, groups: int, per_group: int, prefix_len: int, suffix_len: int,
                    output_len: int, seed: int) -> list[Session]:
    """G groups of P prompts: a shared S-token system prompt plus Q unique tokens. Groups are interleaved, so
    consecutive requests do not share a prefix."""
    rng = random.Random(seed)
    prefixes = [pool.text(prefix_len, rng) for _ in range(groups)]
    sessions = []
    for _ in range(per_group):
        for prefix in prefixes:
            text = prefix + pool.text(suffix_len, rng)
            sessions.append(Session([Turn(text, prefix_len + suffix_len, output_len)]))
    return sessions


def multiturn_sessions(pool: WordPool, num: int, turns: int, input_len: int, input_std: float,
                       output_len: int, output_std: float, think_time_s: float, seed: int) -> list[Session]:
    """Each turn sends the whole conversation so far (earlier turns and the answers received) plus new text."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(num):
        ts = []
        for _ in range(turns):
            n_in = sample_len(rng, input_len, input_std)
            ts.append(Turn(pool.text(n_in, rng), n_in, sample_len(rng, output_len, output_std)))
        sessions.append(Session(ts, think_time_s))
    return sessions


def sharegpt_sessions(pool: WordPool, path: str, num: int, output_len_override: int | None,
                      seed: int) -> list[Session]:
    """The first human turn of each conversation as the prompt, the first answer's length as the output length;
    pairs that are too short or too long are skipped, as vLLM's benchmark does."""
    with open(path) as f:
        conversations = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(conversations)
    sessions = []
    for conv in conversations:
        turns = conv.get("conversations", [])
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        n_in = pool.count(prompt)
        n_out = output_len_override or pool.count(answer)
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        sessions.append(Session([Turn(prompt, n_in, n_out)]))
        if len(sessions) == num:
            break
    if len(sessions) < num:
        raise ValueError(f"{path} yields only {len(sessions)} usable conversations; {num} were asked for")
    return sessions


def copy_sessions(pool: WordPool, path: str, num: int, seed: int) -> list[Session]:
    """Copy-heavy prompts (repeat or lightly edit a given text: data/make_copy_edit.py); the output length is the
    text's length in tokens, what a faithful answer needs. Prompts repeat in order when num exceeds the file."""
    with open(path) as f:
        entries = json.load(f)
    random.Random(seed).shuffle(entries)
    sessions = []
    for i in range(num):
        entry = entries[i % len(entries)]
        sessions.append(Session([Turn(entry["prompt"], pool.count(entry["prompt"]), pool.count(entry["text"]))]))
    return sessions


def build_sessions(args, pool: WordPool, num: int, seed: int) -> list[Session]:
    """The workload of one level (num sessions) from the CLI flags."""
    if args.dataset == "random":
        return random_sessions(pool, num, args.input_len, args.input_len_stddev, args.output_len,
                               args.output_len_stddev, seed, long_share=args.long_prompt_share,
                               long_input_len=args.long_input_len, long_output_len=args.long_output_len)
    if args.dataset == "prefix":
        per_group = max(1, -(-num // args.prefix_groups))
        return prefix_sessions(pool, args.prefix_groups, per_group, args.prefix_len, args.input_len,
                               args.output_len, seed)[:num]
    if args.dataset == "multiturn":
        return multiturn_sessions(pool, num, args.turns, args.input_len, args.input_len_stddev, args.output_len,
                                  args.output_len_stddev, args.think_time, seed)
    if args.dataset == "sharegpt":
        return sharegpt_sessions(pool, args.dataset_path or SHAREGPT_DEFAULT, num, args.sharegpt_output_len, seed)
    if args.dataset == "copy":
        return copy_sessions(pool, args.dataset_path or COPY_DEFAULT, num, seed)
    raise ValueError(f"unknown dataset {args.dataset!r}; choose from {DATASETS}")
