"""Constrained decoding with xgrammar: JSON schema, JSON object, regex, choice, EBNF grammars and structural tags.

Each constrained request owns a GrammarMatcher. Before sampling, the runner asks for a token bitmask for the rows
of constrained requests and masks their logits; free requests in the same batch are untouched. After sampling,
every constrained request's token is fed to its matcher, and a grammar that has completed ends the request.
Compiled grammars are cached by (tokenizer, spec) and compiled in a worker thread: a request whose grammar is
still compiling simply waits in the queue, and the step loop never blocks on a compiler."""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenmill.sampling_params import ParamError, StructuredOutputsParams

logger = logging.getLogger("tokenmill.structured_output")


def grammar_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text): equal specs share one compiled grammar."""
    if spec.json is not None:
        # not sort_keys: the schema's property order is the order the output must follow
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return "json", schema
    if spec.json_object:
        return "json_object", ""
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "choice", json.dumps(spec.choice)
    if spec.structural_tag is not None:
        return "structural_tag", spec.structural_tag
    return "grammar", spec.grammar


def _choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer, with a cache; usable from the API server to validate specs."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.tokenizer_hash = hashlib.sha256(json.dumps(self.info.dump_metadata()).encode()
                                             + str(self.info.vocab_size).encode()).hexdigest()[:16]
        self._cache: dict[tuple[str, str], object] = {}

    def compile(self, spec: StructuredOutputsParams):
        """Raises ParamError with the compiler's own message for an invalid schema, regex or grammar."""
        kind, text = grammar_key(spec)
        cached = self._cache.get((kind, text))
        if cached is not None:
            return cached
        try:
            # Compact JSON (no free whitespace between tokens): a sampled model cannot wander into endless
            # runs of blank lines, so a bounded schema always closes.
            if kind == "json":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(_choice_grammar(spec.choice))
            elif kind == "structural_tag":
                compiled = self._compile_structural_tag(text)
            else:
                compiled = self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            # xgrammar prefixes "[hh:mm:ss] /path/file.cc:line: "; the rest is the compiler's own message
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()) or type(e).__name__
            param = "response_format" if kind in ("json", "json_object", "structural_tag") else f"guided_{kind}"
            raise ParamError(f"invalid {kind.replace('_', ' ')} for structured output: {message}", param) from None
        self._cache[(kind, text)] = compiled
        return compiled

    def _compile_structural_tag(self, text: str):
        """vLLM's two forms: the legacy one (each structure's begin, JSON schema and end, opened after any of the
        triggers) through xgrammar's tag items; otherwise xgrammar's own structural tag JSON."""
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            try:
                items = [self.xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}),
                                                    end=s["end"]) for s in tag["structures"]]
                triggers = list(tag["triggers"])
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"the legacy form takes structures (each with begin, schema and end) and triggers; "
                                 f"{type(e).__name__}: {e}") from None
            with warnings.catch_warnings():  # the legacy call is deprecated in xgrammar, not in vLLM's API
                warnings.simplefilter("ignore", DeprecationWarning)
                return self.compiler.compile_structural_tag(items, triggers)
        return self.compiler.compile_structural_tag(text)


class StructuredOutputManager:
    """Engine-side: compiles in a worker thread, keeps a matcher per request, fills and applies bitmasks."""

    def __init__(self, tokenizer_loader, vocab_size: int):
        self._tokenizer_loader = tokenizer_loader  # the tokenizer is loaded on first use only
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._pending: dict[str, Future] = {}  # request id → compile future
        self.matchers: dict[str, object] = {}  # request id → GrammarMatcher
        self.failed: list[str] = []  # requests whose grammar did not compile (front ends validate first)
        self.mask_time_s = 0.0  # spent filling and applying bitmasks, in total

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer_loader(), self.vocab_size)
        return self._compiler

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        self._pending[request_id] = self._pool.submit(self.compiler.compile, spec)

    @property
    def num_compiling(self) -> int:
        """Requests whose grammar is still compiling: all waiting, since the scheduler admits none of them."""
        return sum(1 for future in self._pending.values() if not future.done())

    def ready(self, request_id: str) -> bool:
        """False while its grammar compiles; the scheduler leaves such a request waiting."""
        future = self._pending.get(request_id)
        if future is None:
            return True
        if not future.done():
            return False
        del self._pending[request_id]
        try:
            compiled = future.result()
        except ParamError as e:
            logger.error("%s: %s", request_id, e)
            self.failed.append(request_id)
            return False
        self.matchers[request_id] = self.compiler.xgr.GrammarMatcher(compiled)
        return True

    def take_failed(self) -> list[str]:
        failed, self.failed = self.failed, []
        return failed

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self.matchers.pop(request_id, None)

    def apply_bitmask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Masks, in place, the logits rows of constrained requests to the tokens their grammar allows."""
        rows = [(i, self.matchers[rid]) for i, rid in enumerate(request_ids) if rid in self.matchers]
        if not rows:
            return
        start = time.perf_counter()
        xgr = self.compiler.xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, (_, matcher) in enumerate(rows):
            matcher.fill_next_token_bitmask(bitmask, j)
        index = torch.tensor([i for i, _ in rows])
        sub = logits[index].float()
        xgr.apply_token_bitmask_inplace(sub, bitmask)
        logits[index] = sub.to(logits.dtype)
        self.mask_time_s += time.perf_counter() - start

    def accept(self, request_id: str, token_id: int) -> bool:
        """Feeds a sampled token; True when the grammar is complete (the request ends with "stop")."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            logger.error("grammar rejected token %d of %s; ending the request", token_id, request_id)
            return True
        return matcher.is_terminated()
