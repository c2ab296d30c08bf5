"""Offline batch generation, `LLM(model).generate(prompts, SamplingParams(...))`, beam search
(`.beam_search(prompts, BeamSearchParams(...))`), and embedding,
`LLM(model, runner="pooling").embed(texts)` / `.score(query, docs)`, in one process."""
from __future__ import annotations

import dataclasses
import itertools
import time

from tqdm import tqdm

from tokenmill.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, advance_all, check_beam_width,
                                   live_beams)
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine import EngineCore
from tokenmill.engine.messages import EngineCoreOutput
from tokenmill.lora.request import LoRARequest
from tokenmill.models.generation_config import generation_defaults
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.pooling_outputs import (EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput,
                                       cosine_similarity)
from tokenmill.pooling_params import PoolingParams, truncate
from tokenmill.sampling_params import SamplingParams, bad_words_token_ids, child_params
from tokenmill.tokenizer import load_tokenizer


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.engine.model_info.path, self.config.tokenizer)
        self._ids = itertools.count()
        # generation_config (auto, vllm or a directory): the model's recommended sampling, as the server applies it
        self._generation_defaults = generation_defaults(self.engine.model_info.path, self.config.generation_config,
                                                      self.config.override_generation_config)

    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep (needs enable_sleep_mode=True): level 1 frees the KV cache and the caches built from
        the weights, level 2 the weights too; no request may be running."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: restores the parts named ("weights", "kv_cache"), both by default."""
        self.engine.wake_up(tags)

    def start_profile(self) -> None:
        """vLLM's LLM.start_profile: torch's profiler records the engine until stop_profile (needs
        VLLM_TORCH_PROFILER_DIR, where the trace goes)."""
        self.engine.profiler.start()

    def stop_profile(self) -> None:
        """vLLM's LLM.stop_profile: ends the recording and writes its Chrome trace."""
        self.engine.profiler.stop()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate() and chat() use when given no SamplingParams, the model's generation_config.json
        defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over
        SamplingParams'."""
        return SamplingParams(**self._generation_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists. lora_request:
        the adapter of every prompt, or one per prompt (None: the base model); needs enable_lora=True."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        tracked = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if text is not None else list(prompt)
            tracked.append(self._add(text, ids, params, priority[i] if priority else 0, loras[i]))
        return self._run(tracked, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            for conv in conversations]
        params = sampling_params or self.get_default_sampling_params()
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        tracked = [self._add(p, i, params, 0, lora_request) for p, i in zip(prompts, ids)]
        return self._run(tracked, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (tokenmill/beam_search.py): the beam_width best sequences of each prompt, best
        first; a sequence's tokens and text hold the prompt too, as vLLM's do. prompts: strings, token-id lists, or
        vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts. Each step runs the live beams of every prompt as
        one batch of one-token requests, which share their prefixes' KV blocks through the prefix cache."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        eos = self.tokenizer.eos_token_id
        check_beam_width(params.beam_width, self.config.max_logprobs)
        searches = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
            self.engine.check_request(ids, SamplingParams(max_tokens=params.max_tokens))  # the whole search fits
            searches.append(BeamSearch(ids, params, eos))
        step_params = params.step_params()
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm)
        while not all(s.done for s in searches):
            rids = [str(next(self._ids)) for _ in live_beams(searches)]
            for rid, tokens in zip(rids, live_beams(searches)):
                self.engine.add_request(rid, tokens, step_params, eos, lora_request=lora_request)
            results = {}
            while len(results) < len(rids):
                for o in self.engine.step():
                    if o.finish_reason is not None:
                        results[o.request_id] = o.logprobs[0] if o.logprobs else None
            advance_all(searches, [results[rid] for rid in rids])
            bar.update(1)
        bar.close()
        outputs = [BeamSearchOutput(s.best()) for s in searches]
        for out in outputs:
            for beam in out.sequences:
                beam.text = self.tokenizer.decode(beam.tokens)
        return outputs

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """prompts as for generate(); one pooled (and, as the model says, normalised) vector each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        ids = [truncate(self.tokenizer.encode(p) if isinstance(p, str) else list(p), truncate_prompt_tokens,
                        self.engine.max_model_len) for p in prompts]
        rids = [str(next(self._ids)) for _ in ids]
        for rid, prompt_ids in zip(rids, ids):
            self.engine.add_pooling_request(rid, prompt_ids, params)
        pooled, bar = {}, tqdm(total=len(rids), desc="Embedding", disable=not use_tqdm)
        while len(pooled) < len(rids):
            for o in self.engine.step():
                if o.pooled is not None:
                    pooled[o.request_id] = o.pooled
                    bar.update(1)
        bar.close()
        return [EmbeddingRequestOutput(rid, i, EmbeddingOutput(pooled[rid])) for rid, i in zip(rids, ids)]

    def score(self, query, documents, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """The cosine similarity of the query's embedding with each document's (a bi-encoder's score)."""
        documents = [documents] if isinstance(documents, str) else documents
        embeds = self.embed([query, *documents], use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        q = embeds[0]
        return [ScoringRequestOutput(d.request_id, q.prompt_token_ids + d.prompt_token_ids,
                                     ScoringOutput(cosine_similarity(q.outputs.embedding, d.outputs.embedding)))
                for d in embeds[1:]]

    def _add(self, text, ids, params: SamplingParams, priority: int, lora_request: LoRARequest | None = None):
        rid = str(next(self._ids))
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer,
                                                                                         params.bad_words))
        if params.structured_outputs is not None:
            # Invalid schemas fail here, with the compiler's message; the engine then finds it compiled.
            self.engine.structured.compiler.compile(params.structured_outputs)
        out = RequestOutput(rid, text, ids, [CompletionOutput(i) for i in range(params.n)])
        children = {}
        for i in range(params.n):
            cp = child_params(params, i)
            child_id = f"{rid}-{i}" if params.n > 1 else rid
            self.engine.add_request(child_id, ids, cp, self.tokenizer.eos_token_id, priority,
                                    lora_request=lora_request)
            children[child_id] = (i, cp, IncrementalDetokenizer(self.tokenizer, cp, ids))
        return out, children

    def _run(self, tracked, use_tqdm: bool) -> list[RequestOutput]:
        by_child = {cid: (out, i, cp, detok) for out, children in tracked
                    for cid, (i, cp, detok) in children.items()}
        pending = set(by_child)
        bar = tqdm(total=len(pending), desc="Generating", disable=not use_tqdm)
        while pending:
            for o in self.engine.step():
                if o.request_id in pending and self._apply(o, *by_child[o.request_id]):
                    pending.discard(o.request_id)
                    bar.update(1)
        bar.close()
        for out, _ in tracked:
            out.finished = True
        return [out for out, _ in tracked]

    def _apply(self, o: EngineCoreOutput, out: RequestOutput, index: int, params: SamplingParams,
               detok: IncrementalDetokenizer) -> bool:
        comp = out.outputs[index]
        comp.token_ids.extend(o.new_token_ids)
        if o.logprobs:
            comp.logprobs = (comp.logprobs or []) + list(o.logprobs)
        if o.prompt_logprobs and index == 0:  # every sample computes them; the request gives them once
            out.prompt_logprobs = (out.prompt_logprobs or []) + list(o.prompt_logprobs)
        out.num_cached_tokens = o.num_cached_tokens
        out.metrics = RequestMetrics(o.arrival_time, o.first_scheduled_time or None, o.first_token_time or None,
                                     o.finished_time or None)
        finish, stop_reason = detok.finish(o.new_token_ids, o.finish_reason, params.stop_token_ids)
        if finish is not None and o.finish_reason is None:
            self.engine.abort_request(o.request_id)
            out.metrics.finished_time = time.monotonic()
        comp.text = detok.text
        if finish is None:
            return False
        comp.finish_reason, comp.stop_reason = finish, stop_reason
        return True
