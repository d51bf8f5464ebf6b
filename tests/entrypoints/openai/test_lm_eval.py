"""lm-eval against this engine, as its users run it: `--model vllm` in-process and `--model local-completions`
against `vllm serve` with no extra arguments, on a tiny local task (lm-eval cannot download datasets here). The
task has a loglikelihood part (multiple choice, through prompt_logprobs) and a generation part (exact match);
both backends score the same greedy model, so their metrics must agree exactly."""
from __future__ import annotations

import json
import logging

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from vllm.assets import DEFAULT_MODEL_DIR  # noqa: E402

# Standard-library code (the built-in model's training data): continuations to choose among, and a first line
# to generate (two of the four are the trained model's greedy lines).
DOCS = [
    {"context": "import os\nimport sys\n\n\ndef main():\n    ", "choices": ["return", "=>", "}}"], "label": 0,
     "answer": "return 0"},
    {"context": "class Stack:\n    def __init__(self):\n        self.", "choices": ["items", "import", "elif"],
     "label": 0, "answer": "items = []"},
    {"context": "for i in range(10):\n    print(", "choices": ["i", "class", "]]"], "label": 0, "answer": "i)"},
    {"context": "if __name__ == '__main__':\n   ", "choices": [" main()", " def", " }"], "label": 0,
     "answer": " unittest.main()"},
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (d / "code_choice.yaml").write_text(
        "task: code_choice\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    (d / "code_gen.yaml").write_text(
        "task: code_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{context}}'\n"
        "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return d


def evaluate(model: str, model_args: str, task_dir) -> dict:
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["code_choice", "code_gen"],
                                  task_manager=TaskManager(include_path=str(task_dir)), batch_size=4,
                                  log_samples=True)
    return out


def scores(out: dict) -> dict:
    return {"acc": out["results"]["code_choice"]["acc,none"],
            "exact_match": out["results"]["code_gen"]["exact_match,none"],
            "loglikelihoods": [[r[0][0] for r in s["resps"]] for s in out["samples"]["code_choice"]],
            "generations": [s["resps"][0][0] for s in out["samples"]["code_gen"]]}


@pytest.fixture(scope="module")
def in_process(task_dir):
    return scores(evaluate("vllm", f"pretrained={DEFAULT_MODEL_DIR},max_model_len=256,dtype=float32", task_dir))


def test_lm_eval_vllm_backend_in_process(in_process):
    assert in_process["acc"] >= 0.5  # the trained model knows common stdlib code
    assert 0 < in_process["exact_match"] < 1
    assert all(ll < 0 for row in in_process["loglikelihoods"] for ll in row)
    assert len(in_process["generations"]) == len(DOCS)


def test_lm_eval_local_completions_matches_in_process(start_server, task_dir, in_process):
    server = start_server("--dtype", "float32")  # served under its path, as a plain `vllm serve DIR`
    out = scores(evaluate("local-completions", f"model={DEFAULT_MODEL_DIR},base_url={server.url}/v1/completions,"
                                               "num_concurrent=2,max_retries=1,tokenized_requests=True,add_bos_token=True",
                          task_dir))
    assert out["acc"] == in_process["acc"] and out["exact_match"] == in_process["exact_match"]
    assert out["generations"] == in_process["generations"]
    for a, b in zip(out["loglikelihoods"], in_process["loglikelihoods"]):
        assert a == pytest.approx(b, abs=1e-4)
