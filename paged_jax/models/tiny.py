"""Tiny random models in Hugging Face format, made offline and deterministically, and the
path of the bundled (trained) default model.

Writes ``config.json``, ``model.safetensors`` (random weights from a seed) and a
byte-level BPE tokenizer trained with the ``tokenizers`` library on a small
bundled corpus. No torch and no hub: the weights' names and shapes come from
the same per-family tables the loader checks against.

    python -m paged_jax.models.tiny --family llama --out /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from paged_jax.models import FAMILIES
from paged_jax.models import model_config_from_hf

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
DEFAULT_MODEL = Path(__file__).parent / "data" / "default-model"

# Small shapes per family (each family file's ``tiny_config``); override any field with keyword arguments.
TINY_CONFIGS = {name: fam.tiny_config for name, fam in FAMILIES.items()}
SPECIAL_TOKENS = {name: fam.tiny_tokens for name, fam in FAMILIES.items()}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _printable_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    chars = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    return sorted({ch for piece, _ in byte_level.pre_tokenize_str(chars) for ch in piece})


def train_tokenizer(family: str, vocab_size: int = 512, files: list[str] | None = None, all_bytes: bool = False):
    """A byte-level BPE tokenizer trained on ``files`` (default: the bundled corpus), deterministic.

    By default its alphabet is the byte-level images of printable ASCII (other bytes map to
    the unknown token), so the random models' outputs read as word pieces rather than
    control characters and broken UTF-8; ``all_bytes``: every byte (any text encodes), for
    a trained model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    sp = SPECIAL_TOKENS[family]
    specials = [t for t in dict.fromkeys([sp["unk"], sp["pad"], sp["bos"], sp["eos"]]) if t]
    tok = Tokenizer(models.BPE(unk_token=sp["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if all_bytes
                                  else _printable_alphabet())
    tok.train(files or [str(CORPUS)], trainer)
    if sp["add_bos"]:
        bos_id = tok.token_to_id(sp["bos"])
        tok.post_processor = processors.TemplateProcessing(single=f"{sp['bos']} $A", special_tokens=[(sp["bos"], bos_id)])
    return tok


def make_tiny_model(out: str | os.PathLike, family: str = "llama", seed: int = 0, vocab_size: int = 512,
                    dtype: str = "float32", **overrides) -> Path:
    """Write a tiny random ``family`` model folder to ``out`` and return its path."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"family must be one of {sorted(TINY_CONFIGS)}, got {family!r}")
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(family, vocab_size)
    cfg = dict(TINY_CONFIGS[family], torch_dtype=dtype, **save_tokenizer(tok, family, out))
    cfg.update(overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    config = model_config_from_hf(cfg, dtype="float32")
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in sorted(FAMILIES[config.family].hf_tensor_shapes(config).items()):
        if "norm" in name or name.split(".")[-2] in ("ln_1", "ln_2", "ln_f"):
            t = (1.0 + 0.1 * rng.standard_normal(shape)) if name.endswith("weight") else 0.1 * rng.standard_normal(shape)
        else:
            t = 0.2 * rng.standard_normal(shape) if name.endswith("bias") else 0.08 * rng.standard_normal(shape)
        tensors[name] = t.astype(np.float32)
    if dtype != "float32":
        import ml_dtypes

        tensors = {k: v.astype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else np.float16)
                   for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def save_tokenizer(tok, family: str, out: Path) -> dict:
    """Write ``tok`` (from :func:`train_tokenizer`) as HF tokenizer files and a generation config
    into ``out``; returns the config.json fields it fixes (vocabulary size, special token ids)."""
    from transformers import PreTrainedTokenizerFast

    sp = SPECIAL_TOKENS[family]
    fields = dict(vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id(sp["bos"]),
                  eos_token_id=tok.token_to_id(sp["eos"]))
    if sp["pad"]:
        fields["pad_token_id"] = tok.token_to_id(sp["pad"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=sp["bos"], eos_token=sp["eos"],
                                   unk_token=sp["unk"], pad_token=sp["pad"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": fields["bos_token_id"], "eos_token_id": fields["eos_token_id"]}, indent=2) + "\n")
    return fields


def default_model_path() -> Path:
    """The bundled default model: a small LLaMA trained on the Python standard library's source
    (``experiments/train_default_model.py``; its model card is the folder's ``README.md``)."""
    return DEFAULT_MODEL


def main(argv=None):
    ap = argparse.ArgumentParser(description="Create a tiny random model folder (HF format) offline.")
    ap.add_argument("--family", choices=sorted(TINY_CONFIGS), default="llama")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON",
                    help="override config fields, e.g. num_hidden_layers=4 hidden_size=128")
    a = ap.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    path = make_tiny_model(a.out, a.family, a.seed, a.vocab_size, a.dtype, **overrides)
    print(f"wrote {a.family} model to {path}")


if __name__ == "__main__":
    main()
