"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import time
from typing import Optional, Sequence, Union

from paged_jax.engine import EngineArgs, LLMEngine
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams


class LLM:
    """An engine plus a loop that runs a batch of prompts to completion.

    Arguments are vLLM's (see :class:`EngineArgs`); ``model=None`` uses the
    bundled tiny LLaMA, built on first use without any download. ``model`` may also be
    a checkpoint written by ``paged-jax convert``; ``tensor_parallel_size=N`` splits the
    model over N devices. ``warm_up=True`` compiles the step shapes up front (greedy sampler;
    call ``llm.llm_engine.warm_up(sampling_params)`` for others).
    ``target_itl_ms=T`` keeps the time between a running stream's tokens near T milliseconds
    while prompts prefill (prefill chunks sized by a step-cost model fitted online).
    """

    def __init__(self, model: Optional[str] = None, tokenizer: Optional[str] = None, dtype: str = "auto",
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, swap_space: float = 4,
                 max_num_seqs: int = 256, max_num_batched_tokens: Optional[int] = None,
                 max_model_len: Optional[int] = None, preemption_mode: Optional[str] = None,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False,
                 attention_backend: str = "auto", seed: int = 0, tensor_parallel_size: int = 1,
                 warm_up: bool = False, **kwargs):
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, block_size=block_size,
                          num_kv_blocks=num_kv_blocks, swap_space=swap_space, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          preemption_mode=preemption_mode, enable_chunked_prefill=enable_chunked_prefill,
                          enable_prefix_caching=enable_prefix_caching, attention_backend=attention_backend,
                          seed=seed, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.llm_engine = LLMEngine(args)
        if warm_up:  # compile every reachable step shape now (see LLMEngine.warm_up)
            self.llm_engine.warm_up()
        self._counter = 0

    def add_prefix(self, prompt: Optional[str] = None, prompt_token_ids: Optional[Sequence[int]] = None) -> int:
        """Compute a shared prefix once and keep its blocks; see :meth:`LLMEngine.add_prefix`."""
        return self.llm_engine.add_prefix(prompt, None if prompt_token_ids is None else list(prompt_token_ids))

    def release_prefix(self, handle: int) -> None:
        self.llm_engine.release_prefix(handle)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[None, str, Sequence[str]] = None,
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 prompt_token_ids: Optional[Sequence[Sequence[int]]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns RequestOutputs in input order."""
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None and prompt_token_ids is not None and len(prompts) != len(prompt_token_ids):
            raise ValueError(f"prompts ({len(prompts)}) and prompt_token_ids ({len(prompt_token_ids)}) "
                             "must have the same length")
        num = len(prompts) if prompts is not None else len(prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * num
        else:
            params_list = list(sampling_params)
            if len(params_list) != num:
                raise ValueError(f"got {len(params_list)} sampling_params for {num} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for i in range(num):
                rid = str(self._counter)
                self._counter += 1
                engine.add_request(rid, prompts[i] if prompts is not None else None, params_list[i],
                                   prompt_token_ids[i] if prompt_token_ids is not None else None)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            # A bad prompt, an error in a step or Ctrl-C: drop this call's requests and free their
            # blocks, so that the engine is clean for the next call.
            engine.abort_request(ids)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start_tokens, t0 = engine.num_generated_tokens, time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            rate = (engine.num_generated_tokens - start_tokens) / max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(f"{rate:.1f} tok/s")
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
