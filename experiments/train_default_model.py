"""Train the bundled default model: a small LLaMA-family model and its BPE tokenizer, on the
Python standard library's source (see ``stdlib_corpus.py``), in JAX with optax.

    python experiments/train_default_model.py --out paged_jax/models/data/default-model

Deterministic for a given Python version and seed: the file split, the tokenizer, the
initialisation and the batch order are all fixed. The forward pass is the engine's own
LLaMA family code (``paged_jax.models.llama``: embed, layer, final) with plain causal
attention in place of the paged one, so the trained weights mean the same thing to the
engine and to transformers. Writes an ordinary Hugging Face folder (16-bit weights in
``model.safetensors``, ``config.json``, tokenizer files), ``training.json`` (the run's record),
``training_loss.png`` and a model card (``README.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402

from paged_jax.models import FAMILIES, compute_logits  # noqa: E402
from paged_jax.models import model_config_from_hf  # noqa: E402
from paged_jax.models.tiny import TINY_CONFIGS, save_tokenizer, train_tokenizer  # noqa: E402
from paged_jax.weights import DenseLinear  # noqa: E402

FAMILY = "llama"
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True)
# --draft: a speculative-decoding draft for the default model (the same tokenizer: the same corpus and
# vocabulary). One layer and half the width keep it under 2 MB in 16-bit (the embedding is most of it).
DRAFT_SHAPE = dict(SHAPE, hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2)


def params_of(hf: dict, config):
    """The family's params pytree over HF-named arrays (traceable: the gradient flows to ``hf``)."""
    def lin(prefix, parallel):
        return DenseLinear(hf[prefix + ".weight"].T, hf.get(prefix + ".bias"), parallel)

    return FAMILIES[config.family].params_from_hf(config, hf.__getitem__, lin)


def causal_attention(scale: float):
    """Dense causal attention over one sequence, in the ``attn(q, k, v, kv)`` form layers call."""
    def attn(q, k, v, kv):
        T, H, D = q.shape
        G = H // k.shape[1]
        qg = q.reshape(T, k.shape[1], G, D)
        scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e30)
        out = jnp.einsum("kgts,skd->tkgd", jax.nn.softmax(scores, axis=-1), v)
        return out.reshape(T, H, D).astype(q.dtype), kv

    return attn


def sequence_logits(hf: dict, config, ids):
    """Logits [T, vocab] of one token sequence ``ids`` [T]."""
    fam = FAMILIES[config.family]
    params = params_of(hf, config)
    positions = jnp.arange(ids.shape[0])
    attn = causal_attention(config.softmax_scale)
    h = fam.embed(params, config, ids, positions)
    for lp in params["layers"]:
        h, _ = fam.layer(lp, config, h, positions, None, attn)
    return compute_logits(params, config, fam.final(params, config, h))


def loss_fn(hf, config, windows):
    """Mean next-token cross-entropy over ``windows`` [B, T + 1]."""
    logits = jax.vmap(lambda w: sequence_logits(hf, config, w[:-1]))(windows)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def init_params(config, seed: int) -> dict:
    """Normal(0, 0.02) matrices (output projections scaled down by depth, GPT-2 style), unit norms."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(FAMILIES[config.family].hf_tensor_shapes(config).items()):
        if "norm" in name:
            out[name] = np.ones(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) \
                else 0.02
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in out.items()}


def token_stream(tok, files) -> np.ndarray:
    """Every file's tokens (BOS first, from the tokenizer) and an EOS, concatenated."""
    eos = tok.token_to_id(TINY_SPECIALS["eos"])
    ids = []
    for enc in tok.encode_batch([stdlib_corpus.read(f) for f in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


TINY_SPECIALS = FAMILIES[FAMILY].tiny_tokens


def eval_windows(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    starts = np.linspace(0, len(stream) - seq_len - 2, count).astype(np.int64)
    return np.stack([stream[s:s + seq_len + 1] for s in starts])


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, losses = zip(*record["train_loss"])
    ax.plot(steps, losses, lw=0.8, label="training batches")
    ev_steps, ev_losses = zip(*record["eval_loss"])
    ax.plot(ev_steps, ev_losses, "o-", label="held-out files")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("default model training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="model folder to write")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N files of each split (a smoke test)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="override model config fields")
    ap.add_argument("--draft", action="store_true",
                    help="train the default model's speculative-decoding draft (DRAFT_SHAPE, the same tokenizer)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    train_files, held_files = stdlib_corpus.split()
    if a.max_files:
        train_files, held_files = train_files[:a.max_files], held_files[:a.max_files]
    print(stdlib_corpus.describe())
    tok = train_tokenizer(FAMILY, a.vocab_size, files=[str(f) for f in train_files], all_bytes=True)
    cfg = dict(TINY_CONFIGS[FAMILY], **(DRAFT_SHAPE if a.draft else SHAPE), torch_dtype="float32",
               **save_tokenizer(tok, FAMILY, out))
    cfg.update({k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)})
    config = model_config_from_hf(cfg, dtype="float32")
    train_stream, held_stream = token_stream(tok, train_files), token_stream(tok, held_files)
    print(f"tokens: {len(train_stream):,} training, {len(held_stream):,} held out; vocabulary {config.vocab_size}")

    params = init_params(config, a.seed)
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    schedule = optax.warmup_cosine_decay_schedule(0.0, a.lr, min(100, a.steps // 10 + 1), a.steps, a.lr / 10)
    decay_mask = {k: v.ndim == 2 for k, v in params.items()}
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(loss_fn)(params, config, windows)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(lambda p, w: loss_fn(p, config, w))
    held = eval_windows(held_stream, a.seq_len, a.eval_windows)
    rng = np.random.default_rng(a.seed + 1)
    record = {"train_loss": [], "eval_loss": []}
    bar = tqdm(range(1, a.steps + 1), desc="training", dynamic_ncols=True)
    for step in bar:
        starts = rng.integers(0, len(train_stream) - a.seq_len - 1, a.batch_size)
        windows = np.stack([train_stream[s:s + a.seq_len + 1] for s in starts])
        params, opt_state, loss = train_step(params, opt_state, windows)
        if step % 10 == 0 or step == 1:
            record["train_loss"].append((step, float(loss)))
            bar.set_postfix(loss=f"{float(loss):.3f}")
        if step % a.eval_every == 0 or step == a.steps:
            ev = sum(float(eval_loss(params, held[i:i + 8])) for i in range(0, len(held), 8)) / math.ceil(len(held) / 8)
            record["eval_loss"].append((step, ev))
            bar.write(f"step {step}: held-out loss {ev:.3f} (perplexity {math.exp(ev):.1f})")

    from safetensors.numpy import save_file
    import ml_dtypes

    # 16-bit storage halves the folder; the engine and transformers load it as float32 (config dtype).
    save_file({k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in params.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    record.update(corpus=stdlib_corpus.describe(), python=sys.version.split()[0], jax=jax.__version__,
                  optax=optax.__version__, parameters=n_params, tokens_train=int(len(train_stream)),
                  tokens_held_out=int(len(held_stream)), tokens_seen=a.steps * a.batch_size * a.seq_len,
                  args=vars(a), wall_seconds=round(time.time() - t_start, 1))
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, out / "training_loss.png")
    print(f"wrote {out} ({n_params:,} parameters) in {record['wall_seconds']:.0f} s; "
          f"final held-out loss {record['eval_loss'][-1][1]:.3f}")


if __name__ == "__main__":
    main()
