"""Weigh XGrammar against llguidance for structured output, on this machine.

For each library that imports: the time to wrap the tokenizer, to compile a typical 10-field
JSON schema (and a regex), and the per-token cost of the token mask plus the advance, walking a
valid document token by token. Tokenizers: the default model's (byte-level BPE, 4,096 tokens)
and a byte-level BPE of 32,000 tokens trained here on the standard library's source.

    python experiments/weigh_grammar_libs.py

XGrammar needs torch at runtime (its bitmask is a torch tensor), so run it from an environment
that has torch; a library that does not import is reported as missing.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "address", "note"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"id": 7, "name": "Ada Lovelace", "email": "ada@math.org", "age": 36, "score": 99.5,
                       "active": True, "role": "admin", "tags": ["math", "engines"],
                       "address": {"city": "London", "zip": "W1"}, "note": None})
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"


def tokenizers_to_weigh():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from experiments.stdlib_corpus import read, split
    default_model = Path(__file__).resolve().parents[1] / "paged_jax/models/data/default-model"
    yield "default model (BPE 4096)", AutoTokenizer.from_pretrained(default_model)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in split()[0][:400]), trainer)
    yield "byte-level BPE 32000", PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def weigh_llguidance(hf_tok):
    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    V = len(hf_tok)
    lt, t_tok = timed(llguidance.hf.from_tokenizer, hf_tok, V)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    m, t_compile = timed(llguidance.LLMatcher, lt, grammar)
    assert not m.is_error(), m.get_error()
    _, t_regex = timed(llguidance.LLMatcher, lt, llguidance.LLMatcher.grammar_from_regex(REGEX))
    mask = allocate_token_bitmask(1, V)
    per_token = []
    for t in hf_tok.encode(DOCUMENT, add_special_tokens=False):
        t0 = time.perf_counter()
        fill_next_token_bitmask(m, mask)
        ok = m.consume_token(t)
        per_token.append(time.perf_counter() - t0)
        assert ok and (mask[0, t // 32] >> (t % 32)) & 1, (t, m.get_error())
    assert m.is_accepting()
    return t_tok, t_compile, t_regex, per_token, llguidance.__version__


def weigh_xgrammar(hf_tok):
    import xgrammar as xgr

    V = len(hf_tok)
    info, t_tok = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=V))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled, t_compile = timed(compiler.compile_json_schema, json.dumps(SCHEMA))
    _, t_regex = timed(compiler.compile_regex, REGEX)
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, V)
    per_token = []
    for t in hf_tok.encode(DOCUMENT, add_special_tokens=False):
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        ok = m.accept_token(t)
        per_token.append(time.perf_counter() - t0)
        assert ok, t
    assert m.accept_token(hf_tok.eos_token_id)  # the document is complete: EOS ends it
    return t_tok, t_compile, t_regex, per_token, importlib.metadata.version("xgrammar")


def main(argv=None):
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print("| library | tokenizer | wrap tokenizer | compile 10-field schema | compile regex | "
          "mask + advance per token (median / max) |")
    print("|---|---|---|---|---|---|")
    for tname, hf_tok in tokenizers_to_weigh():
        for lname, fn in (("llguidance", weigh_llguidance), ("xgrammar", weigh_xgrammar)):
            try:
                t_tok, t_compile, t_regex, per_token, version = fn(hf_tok)
            except ImportError as exc:
                print(f"| {lname} | {tname} | not importable here: {exc} | | | |")
                continue
            print(f"| {lname} {version} | {tname} | {t_tok * 1e3:.1f} ms | {t_compile * 1e3:.2f} ms | "
                  f"{t_regex * 1e3:.2f} ms | {statistics.median(per_token) * 1e6:.0f} us / "
                  f"{max(per_token) * 1e6:.0f} us ({len(per_token)} tokens) |", flush=True)


if __name__ == "__main__":
    main()
