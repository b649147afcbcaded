"""Run the paged forward pass directly (contiguous block assignment), without the engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention import AttentionMetadata, get_backend
from paged_jax.executor.batch import SeqChunk, prepare_batch
from paged_jax.models import compute_logits, forward


def empty_cache(config, num_blocks, block_size):
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [(jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype)) for _ in range(config.num_layers)]


def batch_dict(batch):
    d = {k: jnp.asarray(getattr(batch, k)) for k in ("input_ids", "positions", "slot_mapping", "token_seq",
                                                     "token_qidx", "block_tables", "context_lens", "query_lens")}
    return d


class PagedRunner:
    """Greedy generation for a fixed set of prompts, each with its own (scattered) blocks."""

    def __init__(self, config, params, block_size=4, num_blocks=256, seed=0, backend="reference"):
        self.config, self.params, self.block_size = config, params, block_size
        self.kv = empty_cache(config, num_blocks, block_size)
        attn = get_backend(backend)

        def step(params, kv, arrays, max_q):
            meta = AttentionMetadata(arrays["slot_mapping"], arrays["token_seq"], arrays["token_qidx"],
                                     arrays["block_tables"], arrays["context_lens"], arrays["query_lens"],
                                     max_query_len=max_q)
            h, kv = forward(params, config, arrays["input_ids"], arrays["positions"], kv, meta, attn)
            return compute_logits(params, config, h), kv

        self._step = jax.jit(step, static_argnums=(3,), donate_argnums=(1,))
        # Hand out physical blocks in a shuffled order (block 0 is the null block).
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))

    def table_for(self, table, n_tokens):
        while len(table) * self.block_size < n_tokens:
            table.append(int(self.free.pop()))
        return table

    def run(self, chunks):
        b = prepare_batch(chunks, self.block_size)
        logits, self.kv = self._step(self.params, self.kv, batch_dict(b), b.max_query_len)
        return np.asarray(logits)[: b.num_tokens], b

    def prefill_logits(self, prompts):
        tables = [self.table_for([], len(p)) for p in prompts]
        logits, _ = self.run([SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables)])
        out, t = [], 0
        for p in prompts:
            out.append(logits[t:t + len(p)])
            t += len(p)
        return out

    def greedy(self, prompts, max_new_tokens, banned=()):
        """``banned`` token ids are never chosen (as HF's min_new_tokens does for EOS)."""
        seqs = [list(p) for p in prompts]
        tables = [self.table_for([], len(p)) for p in prompts]
        chunks = [SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables)]
        for _ in range(max_new_tokens):
            logits, b = self.run(chunks)
            last = logits[b.logits_indices[: b.num_seqs]].copy()
            last[:, list(banned)] = -np.inf
            nxt = last.argmax(-1)
            chunks = []
            for s, tok, t in zip(seqs, nxt, tables):
                s.append(int(tok))
                chunks.append(SeqChunk([int(tok)], len(s) - 1, self.table_for(t, len(s))))
        return [s[len(p):] for s, p in zip(seqs, prompts)]
