"""AsyncLLMEngine in process: one engine thread, many coroutines; aborts free blocks; a failing step fails
every request without hanging anyone."""

from __future__ import annotations

import asyncio

import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.server.async_engine import AsyncLLMEngine, EngineDeadError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512)


def test_concurrent_requests_match_llm_and_abort_frees_blocks(tiny_llama_dir, llm):
    prompts = [f"Story {i}: the dragon" for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=10)
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = LLM(model=str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512).llm_engine
    async_engine = AsyncLLMEngine(engine)

    async def main():
        async_engine.start()
        try:
            async def run(i):
                stream = await async_engine.add_request(f"r{i}", prompts[i], greedy)
                seen = []
                async for out in stream:
                    seen.append(len(out.outputs[0].token_ids))
                return out.outputs[0].text, seen

            async def leave():
                stream = await async_engine.add_request("long", "A very long story", SamplingParams(
                    temperature=0, max_tokens=400, ignore_eos=True))
                async for out in stream:
                    if len(out.outputs[0].token_ids) >= 3:
                        async_engine.abort("long")
                        return len(out.outputs[0].token_ids)

            with pytest.raises(ValueError, match="prompt_token_ids hold ids outside"):
                await async_engine.add_request("bad", None, greedy, [10 ** 6])
            results = await asyncio.gather(*[run(i) for i in range(6)], leave())
            for _ in range(200):  # the abort is processed on the next iteration
                if async_engine.stats["num_free_blocks"] == async_engine.stats["num_total_blocks"]:
                    break
                await asyncio.sleep(0.02)
            return results
        finally:
            async_engine.shutdown()

    *runs, left_at = asyncio.run(main())
    assert [text for text, _ in runs] == want  # same continuous batch, same greedy text as LLM.generate
    assert all(seen == sorted(seen) and seen[-1] == 10 and len(seen) > 1 for _, seen in runs)  # streamed
    assert left_at < 400
    # The thread is gone: the engine is ours again.
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_generated_tokens"] < 6 * 10 + 400
    engine.block_manager.check_invariants()


def test_failing_step_fails_every_request(tiny_llama_dir):
    engine = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256).llm_engine

    real_step = engine.step

    def broken_step():  # fails once three requests are running together
        if engine.get_num_unfinished_requests() >= 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = broken_step
    async_engine = AsyncLLMEngine(engine)

    async def main():
        async_engine.start()
        try:
            streams = [await async_engine.add_request(f"r{i}", "hello", SamplingParams(max_tokens=200, ignore_eos=True))
                       for i in range(3)]
            for stream in streams:
                with pytest.raises(EngineDeadError, match="device lost"):
                    async for _ in stream:
                        pass
            assert not async_engine.is_running
            with pytest.raises(EngineDeadError):
                await async_engine.add_request("late", "hello", SamplingParams(max_tokens=4))
        finally:
            async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_non_streaming_client_that_leaves_is_aborted(tiny_llama_dir):
    """A non-streaming completion whose client goes away is aborted (its blocks freed), however fast
    the engine is: the engine is held after its first step until the server has queued the abort, which
    the engine thread takes before its next step."""
    import copy
    import threading

    from paged_jax.server.protocol import CompletionRequest
    from paged_jax.server.serving import OpenAIServing

    engine = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256).llm_engine
    aborted, real_step = threading.Event(), engine.step

    generated = []

    def step():  # after the request has started, wait until the server has aborted it
        outputs = real_step()
        generated.extend(len(o.outputs[0].token_ids) for o in outputs)
        if any(not o.finished for o in outputs):
            aborted.wait(10)
        return outputs

    engine.step = step
    async_engine = AsyncLLMEngine(engine)
    real_abort = async_engine.abort

    def abort(request_id):
        real_abort(request_id)
        aborted.set()

    async_engine.abort = abort
    serving = OpenAIServing(async_engine, copy.deepcopy(engine.tokenizer), "tiny", 256, disconnect_poll_s=0.01)

    class LeavingClient:  # the part of Starlette's Request the handler polls
        def __init__(self):
            self.polls = 0

        async def is_disconnected(self):
            self.polls += 1
            return self.polls > 2

    async def main():
        async_engine.start()
        try:
            req = CompletionRequest(model="tiny", prompt="hello", max_tokens=200, ignore_eos=True)
            response = await serving.completion(req, LeavingClient())
            assert response.status_code == 400 and b"client disconnected" in response.body
            for _ in range(1000):  # the abort reaches the engine thread
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            # Checked before shutdown, which would end the request itself.
            assert not engine.has_unfinished_requests()
        finally:
            async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert 0 < max(generated) <= 2  # stopped at once, not run to its 200 tokens
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.block_manager.gpu_allocator.num_total_blocks
