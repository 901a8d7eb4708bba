"""Builders of tiny local test assets (also used by subprocess tests, so importable as ``tests.tiny``)."""

import os

from hf_xmc.data import XCData, make_synthetic_xmc, write_xc_labels, write_xc_raw


def make_tiny_task(directory: str, num_labels: int = 40, num_train: int = 480, num_test: int = 120, seed: int = 0) -> tuple[XCData, str]:
    """Write a planted synthetic task as XC raw files into ``directory``; returns (data, directory)."""
    data = make_synthetic_xmc(num_labels=num_labels, num_train=num_train, num_test=num_test, seed=seed, zipf_a=None)
    data = XCData(train=data.train, test=data.test, label_texts=list(data.label_texts), label_uids=list(data.label_uids))
    os.makedirs(directory, exist_ok=True)
    write_xc_raw(os.path.join(directory, "trn.json.gz"), data.train)
    write_xc_raw(os.path.join(directory, "tst.json.gz"), data.test)
    write_xc_labels(os.path.join(directory, "lbl.json.gz"), data.label_uids, data.label_texts)
    return data, directory


def make_tiny_encoder(directory: str, data: XCData, hidden_size: int = 32, seed: int = 0) -> str:
    """Save a tiny random BERT (2 layers) and a word-level WordPiece tokenizer for ``data``'s words."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    words = sorted({w for t in list(data.train.texts) + list(data.test.texts) + list(data.label_texts) for w in t.split()})
    os.makedirs(directory, exist_ok=True)
    vocab_file = os.path.join(directory, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    tokenizer = BertTokenizer(vocab=vocab_file)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(words) + 5, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * hidden_size, max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(directory)
    return directory
