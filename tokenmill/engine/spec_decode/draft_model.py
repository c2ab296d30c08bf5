"""A draft model as proposer (vLLM's `draft_model` method): a smaller model with the target's tokenizer runs in
the engine process and proposes each speculating request's next k tokens, one forward pass per draft position,
batched over the requests.

The draft is a ModelRunner of its own (weights, attention backend, a paged KV cache with as many blocks as the
target's, KV dtype of the model), driven position by position from here rather than through the scheduler.
Each request has a DraftSequence: the tokens whose K/V the draft cache holds at each position, the request's
real tokens followed by the last step's drafts. Before proposing, the sequence is compared with the request's
tokens: positions whose draft was accepted stay, those of rejected drafts are rolled back (their slots are
simply rewritten), and whatever the draft has not seen yet (the prompt on the first proposal, the target's token
after the accepted drafts, the tokens of steps without drafts) is fed in the first forward pass, whose last row
proposes the first draft. The draft cache has no prefix caching; a request's blocks are freed when it finishes,
or taken back from the least recently drafted requests when the pool runs out.

Drafts are drawn per request as the request samples: the argmax for greedy requests, and for seeded ones (a
deterministic proposer, so that verification reproduces the plain run's tokens exactly: rejection_sampler.py);
otherwise a draw from q, the draft's distribution after the request's temperature, top-k, top-p and min-p, kept
for verification (accept with probability min(1, p/q)). A draft must share the target's vocabulary: its config's
vocab_size and its tokenizer's token → id map are checked at start-up."""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import sample_inverse_cdf
from tokenmill.models.loader import ModelInfo, load_model_config
from tokenmill.models.paths import resolve_model_path
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger("tokenmill.spec_decode")


class DraftSequence:
    """The draft model's view of one request, in the shape ModelRunner._metadata and KVCacheManager read: the
    tokens at each position (all_token_ids) and how many of them have K/V in the draft cache."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.all_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_real_tokens = 0  # positions below this were computed from the request's own tokens
        self.spec_token_ids: list[int] = []  # always empty: drafts are in all_token_ids here

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def sync(self, tokens: list[int]) -> None:
        """Keep the computed positions that still hold the request's tokens (accepted drafts), drop the rest,
        and append the request's tokens the draft has not seen. The last token is always fed again: its row's
        logits propose the first draft."""
        keep = self.num_real_tokens
        limit = min(self.num_computed_tokens, len(tokens) - 1)
        while keep < limit and self.all_token_ids[keep] == tokens[keep]:
            keep += 1
        self.num_computed_tokens = self.num_real_tokens = keep
        del self.all_token_ids[keep:]
        self.all_token_ids.extend(tokens[keep:])


def check_same_vocabulary(draft: ModelInfo, target_vocab_size: int, target_tokenizer) -> None:
    """A draft proposes token ids: they must mean the same text to the target."""
    path = draft.path
    draft_vocab_size = draft.hf_config.vocab_size
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"--speculative-config: the draft model {path} has a vocabulary of {draft_vocab_size} "
                         f"tokens, the target {target_vocab_size}; a draft must share the target's tokenizer")
    draft_vocab, target_vocab = load_tokenizer(path).get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"--speculative-config: the draft model {path}'s tokenizer differs from the target's "
                         f"({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. (token, id) {differing} is in "
                         f"one only); a draft must share the target's tokenizer")


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: ModelRunner, max_model_len: int, target_tokenizer):
        spec = config.speculative_config
        info = load_model_config(resolve_model_path(spec.model))
        check_same_vocabulary(info, target.vocab_size, target_tokenizer)
        draft_config = dataclasses.replace(
            config, model=spec.model, tokenizer=None, quantization=spec.quantization or "auto",
            kv_cache_dtype="auto", calculate_kv_scales=False, num_gpu_blocks_override=target.num_blocks,
            speculative_config=None, max_model_len=max_model_len, enable_lora=False)  # adapters are the target's
        logger.info("draft model %s (%s, %d layers)", info.path, info.architecture,
                    info.hf_config.num_hidden_layers)
        self.runner = ModelRunner(draft_config, info, max_model_len)
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self.sampler = target.sampler  # the target's processing (target_probs) and the engine's generator
        self.vocab_size = target.vocab_size
        self.sequences: OrderedDict[str, DraftSequence] = OrderedDict()  # least recently drafted first

    @torch.inference_mode()
    def propose_batch(self, wanted: list[tuple[Request, int]]) -> None:
        """Sets spec_token_ids (and, for drafts drawn from q, spec_draft_probs [k, V]) of each request with the
        k drafts it wants; fewer (none) only when the draft cache has no room."""
        busy = {r.request_id for r, _ in wanted}
        live = []
        for r, k in wanted:
            seq = self.sequences.pop(r.request_id, None) or DraftSequence(r.request_id)
            self.sequences[r.request_id] = seq  # the most recently drafted, last
            seq.sync(r.all_token_ids)
            live.append((r, seq, k))
        drafted: dict[str, list[int]] = {r.request_id: [] for r, _ in wanted}
        q_rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in wanted}
        while live:
            live = [item for item in live if self._make_room(item[1], busy)]
            if not live:
                break
            # decodes first, as the attention backends want the batch
            live.sort(key=lambda item: item[1].num_tokens - item[1].num_computed_tokens != 1)
            seqs = [seq for _, seq, _ in live]
            tokens, q = self._forward_and_draw(seqs, [r for r, _, _ in live])
            for i, ((r, seq, k), token) in enumerate(zip(live, tokens)):
                seq.num_computed_tokens = seq.num_tokens
                seq.all_token_ids.append(token)
                drafted[r.request_id].append(token)
                if q is not None and i in q:
                    q_rows[r.request_id].append(q[i])
            live = [item for item in live if len(drafted[item[0].request_id]) < item[2]]
        for r, _ in wanted:
            r.spec_token_ids = drafted[r.request_id]
            rows = q_rows[r.request_id]
            r.spec_draft_probs = torch.stack(rows) if rows else None

    def _make_room(self, seq: DraftSequence, busy: set[str]) -> bool:
        """Blocks for the sequence's uncomputed tokens, taking the least recently drafted idle requests' ones
        when the pool is short (they catch up from their tokens when they draft again)."""
        need = seq.num_tokens - seq.num_computed_tokens
        while not self.kv_cache.allocate_slots(seq, need):
            idle = next((s for rid, s in self.sequences.items() if rid not in busy), None)
            if idle is None:
                return False
            self.kv_cache.free(idle)
            del self.sequences[idle.request_id]
        return True

    def _forward_and_draw(self, seqs: list[DraftSequence],
                          requests: list[Request]) -> tuple[list[int], dict[int, torch.Tensor] | None]:
        """One draft forward over every sequence's uncomputed tokens; each one's next token, and q for the rows
        drawn from it (row index → q)."""
        runner = self.runner
        query_lens = [seq.num_tokens - seq.num_computed_tokens for seq in seqs]
        tables = {seq.request_id: self.kv_cache.block_ids(seq.request_id) for seq in seqs}
        input_ids, meta = runner._metadata(seqs, query_lens, tables)
        hidden = runner.model(input_ids, runner.kv_caches, meta, runner.backend)
        last = meta.query_start_loc[1:].long() - 1
        logits = runner.model.compute_logits(hidden[last] if len(last) < hidden.shape[0] else hidden)
        logits = logits[:, :self.vocab_size]
        tokens = self.sampler._argmax(logits)
        drawn = [i for i, r in enumerate(requests) if not r.params.greedy and r.params.seed is None]
        if not drawn:
            return tokens.tolist(), None
        probs = self.sampler.target_probs(logits[drawn], [requests[i] for i in drawn], [False] * len(drawn))
        q = probs.double()
        q /= q.sum(dim=-1, keepdim=True)
        uniforms = torch.rand(len(drawn), dtype=torch.float64, device=q.device, generator=self.sampler.generator)
        tokens[drawn] = sample_inverse_cdf(q, uniforms)
        return tokens.tolist(), dict(zip(drawn, q))

    def finish(self, request_id: str, tokens: list[int], num_prompt_tokens: int) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.kv_cache.free(seq)
