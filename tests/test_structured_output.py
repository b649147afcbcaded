"""Structured output: constraints checked against independent oracles.

JSON outputs are parsed by ``json.loads`` and validated by ``jsonschema``; regex outputs by
``re.fullmatch``; choices by membership; Lark grammars and truncated outputs by llguidance's own
matcher fed the output's tokens. The sampler's bitmask against llguidance's numpy reference.
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from paged_jax import SamplingParams, StructuredOutputsParams
from paged_jax.models.tiny import default_model_path
from paged_jax.structured_output.grammar import JSON_DEFAULTS, GrammarCompiler
from tests.host_devices import xla_flags_with_devices

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICE = ["yes", "no", "it depends"]
GRAMMAR = 'start: "def " NAME "(" NAME? ")" ":"\nNAME: /[a-z_]{1,10}/'
PROMPT = "def main():\n    data = "


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def llm():
    from paged_jax import LLM

    return LLM(num_kv_blocks=256, max_model_len=512)


def constraints():
    return {
        "json": StructuredOutputsParams(json=SCHEMA),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICE),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
        "json_object": StructuredOutputsParams(json_object=True),
    }


def grammar_accepts(tokenizer, grammar: str, token_ids, complete: bool = True) -> bool:
    """llguidance's own matcher, fresh, fed the output's tokens: all accepted (and, if
    ``complete``, the grammar satisfied)."""
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar, log_level=0)
    ids = [t for t in token_ids if t != tokenizer.eos_token_id]
    return m.consume_tokens(ids) and (m.is_accepting() or not complete)


def json_grammar(schema):
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)


def grammar_of(params: StructuredOutputsParams) -> str:
    fmt, text = params.key()
    return json_grammar(text) if fmt == "json" else llguidance.grammar_from(fmt, text)


def check_valid(kind: str, text: str, tokenizer, token_ids) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
        # Once the grammar admits nothing more the request ends there, as a stop (no step for EOS).
        assert tokenizer.eos_token_id not in token_ids, token_ids
    else:
        assert grammar_accepts(tokenizer, llguidance.grammar_from("lark", GRAMMAR), token_ids), text


# ---- the interface -------------------------------------------------------------------------
def test_params_need_exactly_one_valid_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="choice must hold strings only, got 3"):
        StructuredOutputsParams(choice=["a", 3])
    with pytest.raises(ValueError, match="json is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="json must be a JSON schema"):
        StructuredOutputsParams(json="[1, 2]")
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="")
    with pytest.raises(ValueError, match="json_object must be True"):
        StructuredOutputsParams(json_object="yes")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0,
                       structured_outputs=StructuredOutputsParams(regex="a+"))
    # The same schema as a dict or as text is one constraint (one compile).
    assert StructuredOutputsParams(json=SCHEMA).key() == StructuredOutputsParams(json=json.dumps(SCHEMA)).key()


def test_compiler_refuses_bad_constraints_and_caches_good_ones(tokenizer):
    c = GrammarCompiler(tokenizer, 4096, [tokenizer.eos_token_id], cache_size=2)
    bad = {
        "(?s)regex is invalid or unsupported.*unclosed group": StructuredOutputsParams(regex="(ab"),
        "json is invalid or unsupported: Unimplemented keys: \\[\"uniqueItems\"\\]":
            StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
        "json is invalid or unsupported: Invalid type: strin": StructuredOutputsParams(json={"type": "strin"}),
        "(?s)grammar is invalid or unsupported.*unknown name: \"foo\"": StructuredOutputsParams(grammar="start: foo"),
    }
    for message, params in bad.items():
        with pytest.raises(ValueError, match=message):
            c.matcher(params)
    assert c.num_compiled == 0
    a, b, d = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "d+"))
    c.matcher(a)
    c.matcher(StructuredOutputsParams(regex="a+"))  # an equal constraint: the cached grammar
    assert c.num_compiled == 1
    c.matcher(b), c.matcher(d)  # bounded: "a+" (least recently used) goes
    c.matcher(b)
    assert c.num_compiled == 3
    c.matcher(a)
    assert c.num_compiled == 4
    # A grammar slower to compile than the bound is refused; the compiler goes on serving.
    # (this one takes about 0.4 s here)
    big = {"anyOf": [{"type": "object", "required": [f"k{j}_{i}" for i in range(50)],
                      "properties": {f"k{j}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i}}}[0-9]+$"}
                                     for i in range(50)}} for j in range(100)]}
    c.timeout_s = 0.02
    with pytest.raises(ValueError, match=r"structured_outputs.json took longer than 0.02 s to compile"):
        c.matcher(StructuredOutputsParams(json=big))
    c.timeout_s = 10
    assert c.matcher(StructuredOutputsParams(regex="z+")).matcher.consume_token(tokenizer.encode("z")[-1])


def test_sampler_applies_the_bitmask_per_row(tokenizer):
    """The jitted sampler's mask against llguidance's numpy reference; an unconstrained row in the
    same batch gets exactly what it gets without any mask."""
    from paged_jax.sampler import sample
    from paged_jax.sampling_tensors import SamplingTensors
    from paged_jax.structured_output.grammar import with_bitmask

    V = 4096
    c = GrammarCompiler(tokenizer, V, [tokenizer.eos_token_id])
    m1 = c.matcher(StructuredOutputsParams(json=SCHEMA))
    m2 = c.matcher(StructuredOutputsParams(regex=REGEX))
    for t in tokenizer.encode('{"name": "a', add_special_tokens=False):
        m1.accept(t)
    masks = c.fill_bitmasks([m2, m1])  # the greedy row: digits only; the sampled row: inside a JSON string
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)
    rows = [(with_bitmask(greedy, masks[0]), None, [1], []), (greedy, None, [1], []),
            (with_bitmask(sampled, masks[1]), 7, [1], []), (sampled, 7, [1], [])]
    out = sample(logits, SamplingTensors.from_params(rows, V))
    ref = logits[[0, 2]].copy()
    apply_token_bitmask_inplace(ref, masks)
    ids = np.asarray(out.token_ids)
    assert ids[0] == np.argmax(ref[0])
    assert np.isfinite(ref[1, ids[2]])  # the sampled token is allowed
    plain = sample(logits, SamplingTensors.from_params([(greedy, None, [1], []), (greedy, None, [1], []),
                                                        (sampled, 7, [1], []), (sampled, 7, [1], [])], V))
    assert ids[1] == np.asarray(plain.token_ids)[1] and ids[3] == np.asarray(plain.token_ids)[3]
    np.testing.assert_allclose(np.asarray(out.logprobs)[[1, 3]], np.asarray(plain.logprobs)[[1, 3]], rtol=1e-6)
    # Without a constrained row the tensors carry no mask at all (the sampler's free path).
    assert SamplingTensors.from_params([(greedy, None, [1], [])], V).token_bitmask.shape == (1, 0)


# ---- the engine --------------------------------------------------------------------------
def test_every_kind_valid_in_a_mixed_batch(llm, tokenizer):
    """Greedy and sampled, all kinds in one batch with a free request whose greedy tokens are the
    ones it gets alone."""
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    kinds = constraints()
    params = [SamplingParams(temperature=t, seed=5, max_tokens=40, structured_outputs=c)
              for t in (0.0, 0.8) for c in kinds.values()]
    outs = llm.generate([PROMPT] * (len(params) + 1), params + [free], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone
    for (kind, c), out in zip([*kinds.items()] * 2, outs):
        o = out.outputs[0]
        if kind == "json_object" and o.finish_reason == "length":  # any object: this model may ramble in a string
            assert len(o.token_ids) == 40 and grammar_accepts(tokenizer, grammar_of(c), o.token_ids, complete=False)
            continue
        assert o.finish_reason == "stop", (kind, o.text)
        check_valid(kind, o.text, tokenizer, o.token_ids)


def test_n_best_of_stop_strings_and_truncation(llm, tokenizer):
    outs = llm.generate([PROMPT] * 3, [
        SamplingParams(temperature=1.0, n=3, best_of=4, seed=1, max_tokens=80,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=20, stop="-",
                       structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    ], use_tqdm=False)
    samples = outs[0].outputs
    assert len(samples) == 3 and len({o.text for o in samples}) > 1  # the samples differ, all valid
    for o in samples:
        assert o.finish_reason == "stop"
        check_valid("json", o.text, tokenizer, o.token_ids)
    stopped = outs[1].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "-") and re.fullmatch("[0-9]{3}", stopped.text)
    cut = outs[2].outputs[0]  # a JSON truncated by max_tokens: "length", a valid prefix, no valid JSON
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(cut.text)
    assert grammar_accepts(tokenizer, json_grammar(SCHEMA), cut.token_ids,
                           complete=False)


def test_bad_constraints_are_refused_before_queuing(llm):
    engine = llm.llm_engine
    for params, message in [
        (SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), "structured_outputs.regex is invalid"),
        (SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "minProperties": "x"})),
         "structured_outputs.json is invalid"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", PROMPT, params)
        assert not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


def test_preemption_by_recompute_keeps_outputs_valid(llm, tokenizer):
    """A pool too small for the batch: requests are preempted mid-JSON, recomputed (prompts shared by
    prefix caching), and their outputs are still valid, and equal to those of an uncrowded run."""
    from paged_jax import LLM

    params = [SamplingParams(temperature=t, seed=11, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for t in (0.0, 0.9)] * 3
    prompts = [PROMPT, "class Config:\n    value = ", "x = "] * 2
    small = LLM(num_kv_blocks=8, max_model_len=128, preemption_mode="recompute", enable_prefix_caching=True)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.get_stats()["num_preemptions"].get("recompute", 0) > 0
    for p, out in zip(params, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        check_valid("json", o.text, tokenizer, o.token_ids)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama_gqa", "opt_pre", "gpt2", "qwen2_untied", "mistral_window",
                                     "qwen3_window", "gemma2", "phi3_longrope"])
def test_every_family_tiny_model(hf_model_dir, variant):
    """Each family's tiny random model: every kind valid, greedy and sampled."""
    from transformers import AutoTokenizer

    from paged_jax import LLM

    path = hf_model_dir(variant)
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=str(path), num_kv_blocks=128, max_model_len=256)
    kinds = constraints()
    params = [SamplingParams(temperature=t, seed=2, max_tokens=48, structured_outputs=c)
              for t in (0.0, 1.0) for c in kinds.values()]
    outs = llm.generate(["the"] * len(params), params, use_tqdm=False)
    for (kind, _), out in zip([*kinds.items()] * 2, outs):
        o = out.outputs[0]
        if o.finish_reason == "length":  # a random model may ramble inside a string: a valid prefix then
            assert grammar_accepts(tok, grammar_of(kinds[kind]), o.token_ids, complete=False)
        else:
            check_valid(kind, o.text, tok, o.token_ids)


TP_SCRIPT = """
import json, jsonschema
from paged_jax import LLM, SamplingParams, StructuredOutputsParams
from tests.test_structured_output import PROMPT, SCHEMA
tokens = []
for tp in (1, 2):
    llm = LLM(num_kv_blocks=64, max_model_len=256, tensor_parallel_size=tp)
    outs = llm.generate([PROMPT] * 2, [SamplingParams(temperature=t, seed=3, max_tokens=60,
                                                      structured_outputs=StructuredOutputsParams(json=SCHEMA))
                                       for t in (0, 0.8)], use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    tokens.append([o.outputs[0].token_ids for o in outs])
assert tokens[0] == tokens[1], tokens
print("ok")
"""


@pytest.mark.slow
def test_tensor_parallel_constrained_equals_one_device():
    """Two forced CPU devices (a subprocess): constrained outputs valid and equal to one device's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(2), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
