"""lm-eval against a real server, as its users run it: `local-completions` with no tokenizer
argument (it reads the server's /tokenizer_info, /tokenize and /detokenize), on a small task of
its own format held in local files (no dataset download)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

TASK = """
task: kiln_pick
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""
GENERATE = """
task: kiln_say
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    docs = [{"question": f"Which number comes after {i}?", "choices": [str(i + 1), str(i + 7), "none"],
             "answer": 0, "target": str(i + 1)} for i in range(4)]
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / "kiln_pick.yaml").write_text(TASK.format(data=data))
    (directory / "kiln_say.yaml").write_text(GENERATE.format(data=data))
    return directory


def test_local_completions_with_the_servers_own_tokenizer(tiny_server, tasks, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": tiny_server.url + "/v1/completions", "tokenizer_backend": "remote",
                    "num_concurrent": 2, "max_retries": 1, "max_length": 256},
        tasks=["kiln_pick", "kiln_say"], task_manager=TaskManager(include_path=str(tasks)),
    )
    pick, say = results["results"]["kiln_pick"], results["results"]["kiln_say"]
    assert 0.0 <= pick["acc,none"] <= 1.0 and 0.0 <= say["exact_match,none"] <= 1.0
    assert results["n-samples"]["kiln_pick"]["effective"] == 4
