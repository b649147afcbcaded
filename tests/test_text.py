"""Incremental detokenization (paged_jax/text.py): the text streamed token by token is the text
transformers' ``decode`` gives, whichever decode function the engine picked for the tokenizer."""

from __future__ import annotations

import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.sequence import Sequence
from paged_jax.text import detokenize_incrementally, text_decoder


def streamed(decode, prompt_ids, output_ids, skip_special_tokens=True):
    """Each token's new text and the whole output text, as the engine streams them."""
    seq = Sequence(0, list(prompt_ids))
    seq.prefix_offset, seq.read_offset = max(len(prompt_ids) - 5, 0), len(prompt_ids)  # as add_request starts one
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    pieces = []
    for token in output_ids:
        seq.append_token_id(token)
        pieces.append(detokenize_incrementally(decode, seq, params))
    return pieces, seq.output_text


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    from paged_jax.models.tiny import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.mark.parametrize("skip", [True, False])
def test_a_fast_tokenizer_streams_through_its_own_decode_with_the_same_text(default_tokenizer, skip):
    tok = default_tokenizer
    assert tok.is_fast and tok.clean_up_tokenization_spaces is False
    assert text_decoder(tok) == tok.backend_tokenizer.decode  # transformers' wrapper skipped
    prompt = tok.encode("def greet(name):\n    return")
    # Characters of 2, 3 and 4 bytes, which this byte-level vocabulary splits over several tokens,
    # and the end-of-text token in the middle.
    output = tok.encode(' f"héllo, {name}: 日本語 🙂"') + [tok.eos_token_id] + tok.encode("\n\nprint(greet('wörld'))")
    pieces, text = streamed(text_decoder(tok), prompt, output, skip)
    assert (pieces, text) == streamed(tok.decode, prompt, output, skip)
    assert text == tok.decode(output, skip_special_tokens=skip)
    assert "" in pieces[:-1]  # a token ending inside a character waited for the rest of it


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    """transformers removes the space before punctuation after decoding where a (WordPiece) tokenizer
    asks for it: the Rust decode alone would not, so that tokenizer keeps transformers' decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    rust.decoder = decoders.WordPiece(cleanup=False)  # the clean-up left to transformers
    rust.train_from_iterator(["hello , world . how are you ? fine , thanks !"] * 4,
                             trainers.WordPieceTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    assert text_decoder(tok) == tok.decode
    ids = tok.encode("hello , world . how are you ?")
    _, text = streamed(text_decoder(tok), ids[:1], ids[1:])
    assert text == tok.decode(ids[1:]) and " ," not in tok.decode(ids)
    assert text != rust.decode(ids[1:])  # what the Rust decode alone gives
