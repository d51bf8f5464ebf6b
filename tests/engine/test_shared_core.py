"""One engine core process, two front ends (what `vllm serve --api-server-count 2` runs): both stream outputs equal
to offline greedy; a request id the other front end holds is refused; a front end cannot abort another's request;
a front end that leaves has its requests aborted while the other serves on; the core exits when both have left,
with every block and slot free."""
from __future__ import annotations

import asyncio

import pytest

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.engine.core_client import MPClient
from vllm.engine.core_proc import await_ready, start_engine_core

from tests.engine.test_async_llm import ARGS, GREEDY, assert_all_free, collect, prompts


def test_two_front_ends_share_one_core_and_own_their_requests():
    batch = prompts([5, 30, 12])
    offline = [o.outputs[0].token_ids for o in LLM(**ARGS).generate(batch, GREEDY, use_tqdm=False)]
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        proc, pipes = start_engine_core(EngineArgs(**ARGS), 2)
        a, b = [AsyncLLM(MPClient(None, attach=(to_core, from_core, *await_ready(from_core, proc))))
                for to_core, from_core in pipes]
        results = await asyncio.gather(collect(a, batch[0], GREEDY, "r0"), collect(b, batch[1], GREEDY, "r1"),
                                       collect(b, batch[2], GREEDY, "r2"))
        assert [outs[-1].outputs[0].token_ids for outs in results] == offline

        held = a.generate(prompts([8])[0], SamplingParams(max_tokens=40, ignore_eos=True), "same")
        await anext(held)
        with pytest.raises(ValueError, match="already in use"):
            await collect(b, prompts([4])[0], GREEDY, "same")
        b.client.abort("same")  # a rogue front end's abort of another's request: the core ignores it
        rest = [o async for o in held]
        assert rest[-1].outputs[0].finish_reason == "length" and len(rest[-1].outputs[0].token_ids) == 40

        leaving = a.generate(prompts([8])[0], long, "a-long")
        await anext(leaving)
        staying = asyncio.create_task(collect(b, prompts([9])[0], SamplingParams(max_tokens=30, ignore_eos=True),
                                              "b-long"))
        await a.shutdown()
        left = [o async for o in leaving]
        assert left[-1].outputs[0].finish_reason == "abort"
        assert (await staying)[-1].outputs[0].finish_reason == "length"
        assert proc.is_alive()
        assert_all_free(b)
        await b.shutdown()
        await asyncio.to_thread(proc.join, 30)
        assert proc.exitcode == 0

    asyncio.run(main())
