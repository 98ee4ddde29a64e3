"""Bits per byte (engine/evaluate.py): the cross-entropy in nats summed over the target tokens, over the UTF-8 bytes
those tokens spell, divided by ln 2; the bytes of each token id (tokenizer.py:Tokenizer.token_bytes)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from minimind_ray.engine.evaluate import eval_metrics, eval_sums
from minimind_ray.model.minimind import ModelOutput
from minimind_ray.stages.objective import Objective
from minimind_ray.tokenizer import load_tokenizer

from tests.conftest import minimind_tokenizer_dir
from tests.unit.test_engine import FIXTURE

TEXT = "héllo, 世界"  # 14 UTF-8 bytes: h 1, é 2, llo 3, ',' 1, ' ' 1, 世 3, 界 3


class Uniform(nn.Module):
    """Logits of zeros: every token has probability 1/V, so each target costs ln V nats."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, ids):
        return ModelOutput(logits=torch.zeros(*ids.shape, self.vocab), aux_loss=torch.zeros(()))


def test_bits_per_byte_of_a_string_of_known_bytes_by_hand():
    tok = load_tokenizer(str(FIXTURE / "tokenizer"))
    assert len(TEXT.encode("utf-8")) == 14
    ids = [tok.bos_id, *tok.encode(TEXT), tok.eos_id]  # what the pretrain format makes of a document
    batch = {"input_ids": torch.tensor([ids[:-1]]), "targets": torch.tensor([ids[1:]])}
    n = len(ids) - 1  # every target: the text's tokens and the end of the document (which spells no byte)
    sums = eval_sums(Uniform(tok.vocab_size), Objective(None), [batch], token_bytes=tok.token_bytes())
    assert (sums.weight, sums.text_bytes) == (n, 14)
    metrics = eval_metrics(sums)
    by_hand = n * math.log2(tok.vocab_size) / 14  # n targets of log2(V) bits each, over 14 bytes
    assert metrics["eval_bpb"] == pytest.approx(by_hand, rel=1e-6)
    assert metrics["eval_loss"] == pytest.approx(math.log(tok.vocab_size), rel=1e-6)
    # a padded position (target -100) counts neither loss nor bytes
    padded = {"input_ids": torch.tensor([ids[:-1] + [0]]), "targets": torch.tensor([ids[1:] + [-100]])}
    assert eval_metrics(eval_sums(Uniform(tok.vocab_size), Objective(None), [padded],
                                  token_bytes=tok.token_bytes()))["eval_bpb"] == pytest.approx(by_hand, rel=1e-6)
    assert "eval_bpb" not in eval_metrics(eval_sums(Uniform(tok.vocab_size), Objective(None), [batch]))  # no table


@pytest.mark.parametrize("generation", ["minimind2", "minimind3"])
def test_token_bytes_add_up_to_the_bytes_of_the_text_with_minimind_tokenizers(generation):
    """MiniMind2's and minimind-3's vocabularies cut the same text differently; the bytes the tokens spell are the
    text's bytes either way, which is why bits per byte compares them."""
    tok = load_tokenizer(str(minimind_tokenizer_dir(generation)))
    table = tok.token_bytes()
    text = TEXT + " Bits per byte: 每字节的比特数. <think>"
    ids = tok.encode(text + "<|im_end|>")
    assert sum(table[i] for i in ids) == len(text.encode("utf-8"))
    assert table[tok.eos_id] == table[tok.bos_id] == 0  # special tokens are markup, not text
