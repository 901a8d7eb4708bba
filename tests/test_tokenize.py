"""``tokenize_texts``: long texts are cut after ``max_length`` words before tokenising, and the result must be exactly
what the plain truncating call returns, for every tokenizer family the cut is enabled for."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import BertTokenizer, PreTrainedTokenizerFast

from hf_xmc.models.encoder_utils import cut_after_words, tokenize_texts, word_prefix_is_exact

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "x-ray", "3.14", "naïve", "日本語", "don't", "QUICK", "a"]
SEPARATORS = [" ", "  ", "\t", "\n", " \t "]


def random_texts(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        k = rng.randint(0, max_words)
        parts = [rng.choice(SEPARATORS) if rng.random() < 0.2 else ""]
        for _ in range(k):
            parts += [rng.choice(WORDS) + (rng.choice([",", ".", "!", ""]) if rng.random() < 0.3 else ""), rng.choice(SEPARATORS)]
        texts.append("".join(parts[:-1]) if rng.random() < 0.5 else "".join(parts))
    return texts


@pytest.fixture(scope="module")
def bert_vocab(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("bert")
    pieces = ["alp", "##ha", "beta", "gam", "##ma", "delta", "epsilon", "zeta", "x", "-", "ray", "3", ".", "14", "naive", "日", "本", "語",
              "don", "'", "t", "quick", ",", "!", "a", "##a"]
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + pieces) + "\n")
    return str(directory / "vocab.txt")


@pytest.fixture(scope="module")
def bert_tokenizer(bert_vocab):
    return BertTokenizer(vocab=bert_vocab)


def _trained_fast_tokenizer(pre_tokenizer, decoder, normalizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[PAD]", "[UNK]"], show_progress=False)
    tok.train_from_iterator(random_texts(300, seed=1), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    return _trained_fast_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    return _trained_fast_tokenizer(pre_tokenizers.Metaspace(), decoders.Metaspace(), normalizers.NFKC())


def _assert_same(tokenizer, texts, max_length, **kwargs):
    expected = tokenizer(texts, truncation=True, max_length=max_length, **kwargs)
    got = tokenize_texts(tokenizer, texts, max_length, **kwargs)
    assert set(got.keys()) == set(expected.keys())
    for key in expected:
        if isinstance(expected[key], torch.Tensor):
            assert torch.equal(got[key], expected[key]), key
        else:
            assert got[key] == expected[key], key


@pytest.mark.parametrize("family", ["bert", "byte_level", "metaspace"])
@pytest.mark.parametrize("max_length", [2, 4, 7, 16])
def test_cut_texts_tokenise_exactly_like_the_plain_call(family, max_length, request):
    tokenizer = request.getfixturevalue(f"{family}_tokenizer")
    assert word_prefix_is_exact(tokenizer)
    texts = random_texts(200, seed=max_length)
    assert cut_after_words(texts, max_length)[1] > 50  # the cut really happens on most of these texts
    _assert_same(tokenizer, texts, max_length, padding=True, return_tensors="pt")
    _assert_same(tokenizer, texts, max_length)  # lists of ids, no padding (tokenize_labels' call)


def test_cut_keeps_the_original_characters_and_cuts_after_the_nth_word():
    texts = ["one\ttwo  three four", "  lead one two", "one two", "", "a b c d e f"]
    cut, n = cut_after_words(texts, 3)
    assert cut == ["one\ttwo  three", "  lead one two", "one two", "", "a b c"] and n == 2
    assert cut[2] is texts[2]  # uncut texts are passed through as they are


def test_words_that_normalise_to_nothing_fall_back_to_the_plain_call(bert_tokenizer):
    # combining accents alone are stripped by BERT's normaliser: such "words" give no token, so the first 4 words of
    # these texts give fewer than 4 tokens and the cut alone would lose the words that follow
    texts = ["\u0301 \u0301 \u0301 \u0301 \u0301 alpha beta gamma delta zeta", "alpha beta gamma delta zeta quick"]
    cut, _ = cut_after_words(texts, 4)
    plain = bert_tokenizer(texts, truncation=True, max_length=4, padding=True, return_tensors="pt")
    assert not torch.equal(bert_tokenizer(cut, truncation=True, max_length=4, padding=True, return_tensors="pt")["input_ids"], plain["input_ids"])
    _assert_same(bert_tokenizer, texts, 4, padding=True, return_tensors="pt")


def test_cut_is_off_where_it_could_change_the_result(bert_vocab):
    no_split = _trained_fast_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel())
    assert not word_prefix_is_exact(no_split)  # pieces may span whitespace
    joining = _trained_fast_tokenizer(
        pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), normalizers.Replace("alpha beta", "zeta")
    )
    assert not word_prefix_is_exact(joining)  # a normaliser pattern across two words
    left = BertTokenizer(vocab=bert_vocab, truncation_side="left")
    assert not word_prefix_is_exact(left)
    texts = random_texts(50, seed=3)
    _assert_same(left, texts, 4, padding=True, return_tensors="pt")
    _assert_same(no_split, texts, 4, padding=True, return_tensors="pt")


def test_model_and_collators_tokenise_through_the_cut(bert_tokenizer, monkeypatch):
    """The model's ``tokenize`` (encode_texts, predict) and the training collators send only the kept words to the
    tokenizer: the longest text it sees has at most ``max_length`` words."""
    from hf_xmc.training.collator import tokenize_labels

    seen: list[int] = []
    original = type(bert_tokenizer).__call__

    def spy(self, text, *args, **kwargs):
        seen.append(max(len(t.split()) for t in text))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(bert_tokenizer), "__call__", spy)
    texts = random_texts(64, seed=5, max_words=60)
    tokens = tokenize_labels(bert_tokenizer, texts, max_length=8)
    assert seen and max(seen) <= 8
    monkeypatch.setattr(type(bert_tokenizer), "__call__", original)
    plain = bert_tokenizer(texts, truncation=True, max_length=8)["input_ids"]
    assert tokens.lengths.tolist() == [len(r) for r in plain]
    assert all(tokens.input_ids[i, : len(r)].tolist() == r for i, r in enumerate(plain))
