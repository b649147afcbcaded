"""Run the paged forward pass directly (contiguous block assignment), without the engine."""

from __future__ import annotations

import numpy as np

from paged_jax.executor.batch import SeqChunk, prepare_batch, split_steps
from paged_jax.executor.model_runner import ModelRunner


class PagedRunner:
    """Greedy generation for a fixed set of prompts, each with its own (scattered) blocks,
    through the engine's own jitted step (``ModelRunner.run_batch``) but without scheduler."""

    def __init__(self, config, params, block_size=4, num_blocks=256, seed=0, backend="reference"):
        self.config, self.block_size = config, block_size
        self.runner = ModelRunner(config, params, block_size, num_blocks, num_cpu_blocks=0, attention_backend=backend)
        # Hand out physical blocks in a shuffled order (block 0 is the null block).
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))

    def table_for(self, table, n_tokens):
        while len(table) * self.block_size < n_tokens:
            table.append(int(self.free.pop()))
        return table

    def run(self, chunks):
        b = prepare_batch(chunks, self.block_size)
        logits = self.runner.run_batch(b, all_logits=True)
        return np.asarray(logits)[: b.num_tokens], b

    def run_step(self, chunks):
        """Logits of every real token, in chunk order, of a step split as the model runner splits one
        (:func:`split_steps`: many short prompts need more query tiles than one batch holds)."""
        return np.concatenate([self.run([chunks[i] for i in part])[0] for part in split_steps(chunks)])

    def prefill_logits(self, prompts):
        tables = [self.table_for([], len(p)) for p in prompts]
        logits = self.run_step([SeqChunk(list(p), 0, t) for p, t in zip(prompts, tables)])
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
            last = self.run_step(chunks)[np.cumsum([len(c.token_ids) for c in chunks]) - 1]
            last[:, list(banned)] = -np.inf
            nxt = last.argmax(-1)
            chunks = []
            for s, tok, t in zip(seqs, nxt, tables):
                s.append(int(tok))
                chunks.append(SeqChunk([int(tok)], len(s) - 1, self.table_for(t, len(s))))
        return [s[len(p):] for s, p in zip(seqs, prompts)]
