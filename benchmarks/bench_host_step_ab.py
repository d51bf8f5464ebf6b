"""Host time per engine step of two commits, measured in one run that alternates them.

    python benchmarks/bench_host_step_ab.py --commits eb49632 HEAD --device cpu --stub-model \
        --out benchmarks/results/cpu/host_step_ab_cpu.json
    python benchmarks/bench_host_step_ab.py --trees base=.ab/base head=. --device cuda  # trees made beforehand

Each commit is checked out into a git worktree under a temp dir (or `--trees` names directories holding each
side's `vllm/`, where there is no git, as on the GPU machine); rounds alternate A, B, A, B, ... and each round
runs every case in a fresh process of that commit (`--worker`), so drift of the machine (thermals, other load)
falls on both alike. A case is (kind, N): N requests in pure decode steps ("decode"), or in steps where every
row verifies K drafts ("ngram", "dspark"; --num-spec). Host time per step is `engine.step()`'s wall time less
its waits for the device (the engine's `_waited`, which both sides of the refactor keep): what the host spends
scheduling, preparing, sampling, drafting and processing outputs. It reads nothing else of the engine's
internals, so it runs unchanged on both commits.

`--stub-model` replaces the target's forward by zeros (every logit equal, so greedy picks token 0 and ngram's
drafts of repeated zeros are always accepted) and DSpark's draft by drafts of zeros: on a CPU the step is then
host work alone. Without it (on a GPU)
the forward runs for real. Reported: per case and commit, the median over rounds of each round's median.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("decode", "ngram", "dspark")


def stub_forward(ids, positions, meta, *, hidden, dtype, device):
    import torch
    return torch.zeros(ids.shape[0], hidden, dtype=dtype, device=device)


def stub_propose(anchor_ids, *args, K, outputs=3, **kwargs):
    """Zero drafts, no confidences (and no draft distributions, for trees whose propose returns them)."""
    import torch
    return (torch.zeros(anchor_ids.shape[0], K, dtype=torch.int64, device=anchor_ids.device),) + (None,) * (outputs - 1)


def run_cases(args) -> dict:
    """In a worker process: every case of args.cases on this process's commit; {case: [us per step]}."""
    import torch

    from vllm.assets import DEFAULT_DSPARK_DIR, DEFAULT_MODEL_DIR, TINY_TOKENIZER_DIR
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.llm_engine import LLMEngine
    from vllm.sampling_params import SamplingParams
    torch.set_num_threads(1)
    results = {}
    counts = [int(n) for n in args.num_running.split(",")]
    for kind in args.kinds.split(","):
        spec = None
        if kind == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": args.num_spec, "prompt_lookup_max": 2}
        elif kind == "dspark":
            spec = {"method": "dspark", "model": str(DEFAULT_DSPARK_DIR), "num_speculative_tokens": args.num_spec}
        max_model_len = 64 + (args.warmup + 8 + args.iters) * (1 + args.num_spec) + 16
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(DEFAULT_MODEL_DIR), tokenizer=str(TINY_TOKENIZER_DIR), device=args.device, dtype=args.dtype,
            max_num_seqs=max(counts), max_num_batched_tokens=8192, max_model_len=max_model_len,
            kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) if args.device == "cpu" else None,
            speculative_config=spec, enforce_eager=args.enforce_eager))
        if args.stub_model:
            runner = engine.runner
            runner.model.forward = functools.partial(
                stub_forward, hidden=engine.config.model_config.hf_config.hidden_size, dtype=runner.dtype,
                device=runner.device)
            if runner.drafter is not None:  # drafts of zeros, which the stub's greedy tokens accept
                # Trees before probabilistic drafts return (drafts, confidences), later ones add the distributions.
                outputs = 3 if hasattr(runner.drafter, "probabilistic") else 2
                runner.drafter.draft.propose = functools.partial(stub_propose, K=args.num_spec, outputs=outputs)
                runner.drafter.write_context = lambda *a: None
        for n in counts:
            rng = random.Random(n)
            params = SamplingParams(temperature=0.0, max_tokens=max_model_len - 64, ignore_eos=True)
            rids = [f"{kind}{n}-{i}" for i in range(n)]
            for rid in rids:
                engine.add_request(rid, [rng.randrange(3, engine.vocab_size) for _ in range(64)], params)
            for _ in range(args.warmup + 8):  # prefill, then the drafts settle
                engine.step()
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - t0 - engine._waited) * 1e6)
            if len(engine.scheduler.running) != n:
                raise RuntimeError(f"{kind} N={n}: {len(engine.scheduler.running)} requests running at the end "
                                   "(finished, or preempted for want of cache: raise --kv-cache-gib)")
            results[f"{kind} N={n}"] = times
            engine.abort_request(rids)
            while engine.has_unfinished_requests():
                engine.step()
        del engine
    return results


def worktree(commit: str, root: Path) -> Path:
    sha = subprocess.check_output(["git", "rev-parse", commit], cwd=REPO, text=True).strip()
    path = root / sha[:12]
    if not path.exists():
        subprocess.check_call(["git", "worktree", "add", "--detach", str(path), sha], cwd=REPO,
                              stdout=subprocess.DEVNULL)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", nargs=2, metavar=("A", "B"), help="the two commits (driver mode)")
    ap.add_argument("--trees", nargs=2, metavar=("A=DIR", "B=DIR"), help="or two labelled source trees")
    ap.add_argument("--worker", action="store_true", help="run the cases in this tree, print JSON (internal)")
    ap.add_argument("--rounds", type=int, default=4, help="alternations: A, B per round")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--num-running", default="1,64,256")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40, help="timed steps per case and round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--stub-model", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="the cache budget on CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        import vllm
        print("RESULT " + json.dumps({"vllm": vllm.__file__, "cases": run_cases(args)}), flush=True)
        return
    sides = args.commits or args.trees
    passthrough = [a for a in sys.argv[1:] if a not in sides and a not in ("--commits", "--trees")]
    if args.commits:
        root = Path(tempfile.mkdtemp(prefix="host_ab_"))
        trees = {c: worktree(c, root) for c in args.commits}
    else:
        trees = dict((label, Path(d).resolve()) for label, d in (t.split("=", 1) for t in args.trees))
    rounds: dict[str, dict[str, list[float]]] = {c: {} for c in trees}
    try:
        for r in range(args.rounds):
            for commit, tree in trees.items():
                proc = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_host_step_ab.py"), "--worker",
                                       *passthrough], cwd=tree,
                                      env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                          [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])},
                                      capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise RuntimeError(f"{commit} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                got = json.loads(line[7:])
                if not Path(got["vllm"]).is_relative_to(tree):
                    raise RuntimeError(f"the worker for {commit} imported {got['vllm']}, not its worktree's vllm")
                for case, times in got["cases"].items():
                    rounds[commit].setdefault(case, []).append(statistics.median(times))
                print(f"round {r + 1}/{args.rounds} {commit}: " + ", ".join(
                    f"{case} {v[-1]:.0f}" for case, v in rounds[commit].items()), flush=True)
    finally:
        for tree in trees.values() if args.commits else ():
            subprocess.call(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO)
    a, b = trees
    table = {case: {a: statistics.median(rounds[a][case]), b: statistics.median(rounds[b][case])}
             for case in rounds[a]}
    print(f"{'case':16s} {a[:12]:>12s} {b[:12]:>12s}   B/A   (host us per step, median over rounds)")
    for case, row in table.items():
        print(f"{case:16s} {row[a]:12.1f} {row[b]:12.1f} {row[b] / row[a]:6.3f}")
    if args.out:
        shas = {c: subprocess.check_output(["git", "rev-parse", c], cwd=REPO, text=True).strip() for c in trees} \
            if args.commits else {label: str(tree) for label, tree in trees.items()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"benchmark": "host_step_ab", "config": vars(args), "commits": shas,
                                              "median_us": table, "round_medians_us": rounds}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
