"""Speculative decoding where users meet it: ``--speculative-config`` on the command line (generate and
serve), vLLM's speculative decoding counters in ``get_stats()`` and ``/metrics``, and ``warm_up()``
compiling the verification steps so that the first drafted step compiles nothing."""

from __future__ import annotations

import json
import re

import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.cli import build_parser, main
from paged_jax.server.metrics import ServerMetrics
from tests.test_spec_decode_engine_logic import CacheModel, run

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEATING = "import os\nimport sys\nimport "


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_cli_takes_the_speculative_config_as_json(cmd):
    a = build_parser().parse_args([cmd, "--speculative-config", json.dumps(SPEC)])
    assert a.speculative_config == SPEC
    assert build_parser().parse_args([cmd]).speculative_config is None


@pytest.mark.parametrize("text,message", [
    ('{"method": ngram}', "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
])
def test_cli_refuses_a_bad_speculative_config_naming_it(text, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", text])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


@pytest.mark.slow
def test_cli_generate_with_speculation_prints_what_plain_decoding_gives(tiny_llama_dir, capsys):
    """Greedy: ``paged-jax generate --speculative-config ...`` prints the same completion as LLM.generate
    without speculation, and its acceptance line."""
    args = ["--model", str(tiny_llama_dir), "--prompt", REPEATING, "--max-tokens", "24", "--max-model-len", "128",
            "--num-kv-blocks", "32"]
    assert main(["generate", *args, "--speculative-config", json.dumps(SPEC)]) == 0
    printed = capsys.readouterr().out
    plain = LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=32).generate(
        REPEATING, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    assert f"{REPEATING!r} -> {plain!r}" in printed
    accepted, drafted = map(int, re.search(r"speculative decoding: (\d+) of (\d+) draft tokens", printed).groups())
    assert 0 <= accepted <= drafted and drafted > 0


class RecordingModel(CacheModel):
    """The fake model of test_spec_decode_engine_logic, recording each drafted row's drafts and the
    target's tokens: the oracle for the acceptance counters."""

    def __init__(self):
        super().__init__()
        self.verified: list[tuple[list[int], list[int]]] = []

    def execute(self, out, sampling=(), eos_token_id=None):
        result = super().execute(out, sampling, eos_token_id)
        for i, spec in enumerate(sampling):
            if spec.num_speculative_tokens:
                drafts = out.scheduled[i].seq.output_token_ids[-spec.num_speculative_tokens:]
                self.verified.append((list(drafts), [s.token_id for s in result.samples[i]]))
        return result


def expected_counters(verified, k):
    per_pos = [0] * k
    for drafts, targets in verified:
        for j, d in enumerate(drafts):
            if d != targets[j]:
                break
            per_pos[j] += 1
    return {"num_drafts": len(verified), "num_draft_tokens": sum(len(d) for d, _ in verified),
            "num_accepted_tokens": sum(per_pos), "num_accepted_tokens_per_pos": per_pos}


def test_acceptance_counters_in_get_stats_and_metrics(monkeypatch):
    """vLLM's counters (drafts, draft tokens, accepted tokens, accepted per draft position) against a count
    made from the drafts and the target's tokens themselves, in get_stats() and in /metrics."""
    model = RecordingModel()
    monkeypatch.setattr("tests.test_spec_decode_engine_logic.CacheModel", lambda: model)
    prompt = [3, 4, 5, 3, 4, 5, 3]
    requests = [(prompt, SamplingParams(temperature=0, max_tokens=30)),
                ([2, 7, 2, 7, 9, 2, 7], SamplingParams(temperature=0, max_tokens=25))]
    _, engine = run(requests, {**SPEC, "num_speculative_tokens": 4}, 40, None, False)
    stats = engine.get_stats()["spec_decode"]
    want = expected_counters(model.verified, 4)
    assert {key: stats[key] for key in want} == want
    assert want["num_accepted_tokens_per_pos"][0] > want["num_accepted_tokens_per_pos"][3] > 0  # some at each

    metrics = ServerMetrics()
    metrics.stats_source = engine.get_stats
    text = metrics.render()[0].decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f"paged_jax_spec_decode_{name}_total {float(want[name])!r}" in text
    for pos, count in enumerate(want["num_accepted_tokens_per_pos"]):
        assert f'paged_jax_spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}} {float(count)!r}' in text
    _, plain = run(requests, None, 40, None, False)
    metrics.stats_source = plain.get_stats
    assert plain.get_stats()["spec_decode"] is None and "spec_decode" not in metrics.render()[0].decode()


@pytest.mark.parametrize("as_rows", [False, True])
def test_warm_up_compiles_the_verification_steps(tiny_llama_dir, as_rows):
    """After warm_up(), requests whose rows carry drafts (prompt-lookup hits, a prefill beside drafted
    rows) compile nothing, with drafts scored as query tiles or as a decode row per token."""
    llm = LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=24, max_num_seqs=3, max_num_batched_tokens=16,
              speculative_config=SPEC)
    engine = llm.llm_engine
    engine.runner.drafts_as_rows = as_rows
    engine.warm_up(progress=False)
    compiled = engine.get_stats()["num_compilations"]
    prompts = [REPEATING, "for i in range(3):\n    print(i)\nfor i in range(3):\n", REPEATING * 2, "def f(x):\n"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    stats = engine.get_stats()
    assert stats["spec_decode"]["num_drafts"] > 0
    assert stats["num_compilations"] == compiled


@pytest.mark.slow
def test_server_with_speculation_answers_as_llm_and_counts_drafts(tiny_llama_dir, tmp_path):
    """``paged-jax serve --speculative-config ...`` for real: a greedy completion equals LLM.generate's
    without speculation, and /metrics carries the speculative decoding counters."""
    from tests.test_server import MODEL, Server, client

    srv = Server(tiny_llama_dir, tmp_path / "server.log", "--speculative-config", json.dumps(SPEC))
    try:
        text = client(srv).completions.create(model=MODEL, prompt=REPEATING, max_tokens=24, temperature=0) \
            .choices[0].text
        metrics = srv.metrics()
    finally:
        srv.stop()
    plain = LLM(str(tiny_llama_dir), max_model_len=1024, num_kv_blocks=256).generate(
        REPEATING, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    assert text == plain
    drafted = metrics["paged_jax_spec_decode_num_draft_tokens_total"]
    accepted = metrics["paged_jax_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    assert sum(v for k, v in metrics.items() if k.startswith("paged_jax_spec_decode_num_accepted_tokens_per_pos")) \
        == accepted
