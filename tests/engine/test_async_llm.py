"""AsyncLLM: concurrent streams equal offline greedy outputs; cancellation frees the cache at once; bad input
fails only its request; shutdown ends requests in flight. In the front end's process (internals checked), and
with the engine core in a process of its own: streams equal offline, bad input fails alone with the engine's own
message (as does a bad call into the core), a cancelled stream is aborted in the core, shutdown leaves every block
and slot free, a bad checkpoint fails start-up with its message, and a core that dies fails the requests in flight
instead of hanging them."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ARGS = dict(max_model_len=256, dtype="float32")


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 512, (n,), generator=gen).tolist() for n in lengths]


async def collect(engine: AsyncLLM, prompt, params, rid):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    return outs


async def long_run_and_short_one_cancelled(engine: AsyncLLM) -> asyncio.Task:
    """Starts a long request, then reads 3 outputs of a short one and stops (like a client that disconnects);
    returns the long one's task."""
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    long_run = asyncio.create_task(collect(engine, prompts([20])[0], params, "long"))
    got = 0
    async for _ in engine.generate(prompts([8], seed=1)[0], params, "short"):
        got += 1
        if got == 3:
            break
    return long_run


def test_concurrent_streams_equal_offline_and_free_everything():
    batch = prompts([5, 30, 1, 60])
    offline = [o.outputs[0].token_ids for o in LLM(**ARGS).generate(batch, GREEDY, use_tqdm=False)]

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=False)
        results = await asyncio.gather(*(collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(batch)))
        await engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    for outs, expected in zip(results, offline):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens)  # cumulative
    engine.client.engine.kv_cache_manager.assert_all_free()
    assert engine.stats().generation_tokens_total == sum(map(len, offline))


def test_cancel_mid_stream_aborts_and_frees():
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=False)
        long_run = await long_run_and_short_one_cancelled(engine)
        parents = engine.client.engine.output_processor.parents
        for _ in range(500):  # the abort lands at the loop's next turn, which a loaded CPU can delay past 50 ms
            if "short" not in parents:
                break
            await asyncio.sleep(0.01)
        assert "short" not in parents
        # Aborted, not run to its end: the long request, started first with as many tokens to go, still runs.
        assert not long_run.done()
        long_run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long_run
        for _ in range(100):  # the abort lands at the next loop turn
            if not engine.client.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        engine.client.engine.kv_cache_manager.assert_all_free()
        await engine.shutdown()

    asyncio.run(main())


def test_bad_input_fails_only_its_request():
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=False)
        good = asyncio.create_task(collect(engine, prompts([6])[0], GREEDY, "good"))
        with pytest.raises(ValueError, match="exceeds --max-model-len"):
            await collect(engine, list(range(5, 250)), SamplingParams(max_tokens=50), "bad")
        assert (await good)[-1].finished
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_aborts_in_flight_requests():
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=False)
        task = asyncio.create_task(collect(engine, prompts([6])[0], SamplingParams(max_tokens=240,
                                                                                   ignore_eos=True), "x"))
        await asyncio.sleep(0.2)
        await engine.shutdown()
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        engine.client.engine.kv_cache_manager.assert_all_free()

    asyncio.run(main())


# ---- the engine core in a process of its own (AsyncLLM's default) ---------------------------------------------
def assert_all_free(engine: AsyncLLM) -> None:
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (0, 0)
    assert (s.num_free_blocks, s.num_free_slots) == (s.num_blocks, s.num_slots)


def test_streams_equal_offline_bad_input_fails_alone_and_everything_is_freed():
    batch = prompts([5, 30, 1, 60])
    offline = [o.outputs[0].token_ids for o in LLM(**ARGS).generate(batch, GREEDY, use_tqdm=False)]

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=True)
        assert engine.client.proc.is_alive() and engine.config.model_config.max_model_len == 256
        good = [collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(batch)]
        text = collect(engine, "def fibonacci(n):", GREEDY, "text")
        results = await asyncio.gather(*good, text)
        with pytest.raises(ValueError, match="exceeds --max-model-len"):
            await collect(engine, list(range(5, 250)), SamplingParams(max_tokens=50), "bad")
        # A call into the core process fails alone too; reset_prefix_cache is one that runs there.
        with pytest.raises(AttributeError, match="no_such_method"):
            await engine.client.call("no_such_method")
        assert await engine.reset_prefix_cache() is True
        await engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    for outs, expected, prompt in zip(results, offline, batch):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected
        assert outs[-1].prompt_token_ids == prompt  # put back by the front end: the core sends outputs without
    text_out = results[-1][-1]
    assert text_out.prompt == "def fibonacci(n):" and text_out.prompt_token_ids == engine.tokenizer.encode(
        "def fibonacci(n):")
    assert_all_free(engine)
    assert engine.stats().generation_tokens_total == sum(map(len, offline)) + len(text_out.outputs[0].token_ids)
    assert not engine.client.proc.is_alive() and engine.client.proc.exitcode == 0


def test_cancelled_stream_is_aborted_in_the_core_and_shutdown_aborts_the_rest():
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=True)
        long_run = await long_run_and_short_one_cancelled(engine)
        for _ in range(200):  # the abort reaches the core within a step
            if engine.stats().num_running == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().num_running == 1 and not long_run.done()
        await engine.shutdown()
        outs = await long_run
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert_all_free(engine)

    asyncio.run(main())


def test_bad_checkpoint_fails_start_up_with_its_message(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path)), multiprocess=True)


def test_a_dead_core_fails_the_requests_in_flight_and_new_ones():
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=True)
        stream = engine.generate(prompts([8])[0], SamplingParams(max_tokens=200, ignore_eos=True), "victim")
        await anext(stream)
        os.kill(engine.client.proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process died"):
            async for _ in stream:
                pass
        assert engine.errored
        with pytest.raises(RuntimeError, match="engine process has died"):
            await collect(engine, prompts([4])[0], GREEDY, "after")
        await engine.shutdown()

    asyncio.run(main())


def test_a_failed_in_process_loop_is_a_dead_engine_and_says_so_once():
    """A bug that ends the in-process step loop leaves an engine that runs nothing: like a dead core process, the
    requests in flight fail, new ones are refused and the dead handlers (the server's exit) run once."""
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=False)
        seen = []
        engine.dead_handlers.append(seen.append)
        stream = engine.generate(prompts([8])[0], SamplingParams(max_tokens=200, ignore_eos=True), "victim")
        await anext(stream)

        def broken_step():
            raise AssertionError("an invariant broke")
        engine.client.core.step = broken_step

        async def drain():
            async for _ in stream:
                pass
        with pytest.raises(RuntimeError, match="the engine loop failed: AssertionError: an invariant broke"):
            await asyncio.wait_for(drain(), 30)  # before: the stream waited forever
        assert engine.errored and len(seen) == 1
        with pytest.raises(RuntimeError, match="the engine loop has failed"):
            await collect(engine, prompts([4])[0], GREEDY, "after")
        await engine.shutdown()

    asyncio.run(main())


def test_a_lone_surrogate_is_a_value_error_naming_it_before_tokenizing():
    """The tokenizer raises TypeError on a lone surrogate; the engine's own check comes first, on every entry."""
    from vllm.sampling_params import BeamSearchParams

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(**ARGS), multiprocess=False)
        for prompt in ("abc\ud800", {"prompt": "x\udfff"}):
            with pytest.raises(ValueError, match="holds a lone UTF-16 surrogate"):
                await collect(engine, prompt, GREEDY, "s")
        await engine.shutdown()
    asyncio.run(main())
    with pytest.raises(ValueError, match="holds a lone UTF-16 surrogate"):
        LLM(**ARGS).beam_search(["abc\ud800"], BeamSearchParams(beam_width=2, max_tokens=2))
