"""KTO without Ray: the ``kto`` record format (data/formats/kto.py) and the loss (stages/kto_objective.py) pinned on a
toy batch computed by hand, with its KL reference point taken over the whole step's micro-batches."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from minimind_ray.config import load_config
from minimind_ray.config_checks import ConfigError
from minimind_ray.data.formats import BadRecord, Encoder, check_record, collate
from minimind_ray.stages import build_objective
from tests.unit.test_formats import tok  # noqa: F401  (a module fixture: a tokenizer trained in a second)

CONV = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "2 plus 2 equals 4."}]
LONG = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "What is 3 plus 3?"}, {"role": "assistant", "content": "3 plus 3 equals 6."}]


@pytest.mark.parametrize("rec, reason, where", [
    ({"conversations": CONV}, "missing_field", "'label'"),
    ({"conversations": CONV, "label": 1}, "wrong_type", "'label' is int"),
    ({"conversations": CONV, "label": "yes"}, "wrong_type", "'label' is str"),
    ({"label": True}, "missing_field", "'conversations'"),
    ({"conversations": CONV[:1], "label": True}, "wrong_type", "conversations[-1].role"),
    ({"conversations": CONV[1:], "label": False}, "no_prompt", "no turn before the assistant's"),
    ({"conversations": [CONV[0], {"role": "assistant", "content": 4}], "label": True}, "wrong_type",
     "conversations[1].content"),
])
def test_a_bad_kto_record_names_its_field(rec, reason, where):
    with pytest.raises(BadRecord) as e:
        check_record("kto", rec)
    assert e.value.reason == reason and where in e.value.detail


def test_kto_rows_split_the_judged_reply_from_its_prompt_and_batches_pair_each_prompt_with_another_reply(tok):
    recs = [{"conversations": CONV, "label": True}, {"conversations": LONG, "label": False},
            {"conversations": [CONV[0], {"role": "assistant", "content": "5."}], "label": False}]
    for r in recs:
        check_record("kto", r)
    enc = Encoder("kto", tok, max_seq_len=256)
    assert enc.add(recs) == []
    rows = enc.take(final=True)
    assert sorted(rows) == ["completion_ids", "label", "prompt_ids"]
    assert [tok.decode(r.tolist()) for r in rows["completion_ids"]] == [
        "2 plus 2 equals 4.<|im_end|>\n", "3 plus 3 equals 6.<|im_end|>\n", "5.<|im_end|>\n"]
    # the earlier assistant turn of LONG is prompt, unscored; a prompt ends where its reply's span starts
    assert tok.decode(rows["prompt_ids"][1].tolist()).endswith("Hello there.<|im_end|>\n<|im_start|>user\n"
                                                                "What is 3 plus 3?<|im_end|>\n<|im_start|>assistant\n")
    assert [int(x[0]) for x in rows["label"]] == [1, 0, 0]
    b = collate("kto", rows, np.array([7, 8, 9]), pad_id=tok.pad_id, max_seq_len=256)
    assert b["label"].tolist() == [True, False, False] and b["sample_ids"].tolist() == [7, 8, 9]

    def scored(prefix, i):
        t = b[prefix + "targets"][i]
        return tok.decode(t[t != -100].tolist())

    assert [scored("", i) for i in range(3)] == [tok.decode(r.tolist()) for r in rows["completion_ids"]]
    # TRL's rotation: prompt i with the reply of row i - 1 (the first with the last's)
    assert [scored("kl_", i) for i in range(3)] == [scored("", 2), scored("", 0), scored("", 1)]
    n = len(rows["prompt_ids"][0]) + len(rows["completion_ids"][2]) - 1
    assert b["kl_input_ids"][0, :n].tolist() == [*rows["prompt_ids"][0], *rows["completion_ids"][2][:-1]]
    # cut at max_seq_len: the reply keeps its start; a reply that starts after the cut has nothing to score
    first_reply = len(rows["prompt_ids"][0])
    enc = Encoder("kto", tok, max_seq_len=first_reply + 2)
    issues = enc.add(recs)
    assert (0, "truncated", f"longer than max_seq_len={first_reply + 2}") in issues
    assert [(i, r) for i, r, _ in issues if r != "truncated"] == [(1, "no_labels")]  # LONG's prompt is longer
    cut = enc.take(final=True)
    assert cut["completion_ids"][0].tolist() == rows["completion_ids"][0][:2].tolist()


class Bigram(nn.Module):
    """Logits that depend on the input token only: ``table[token]`` (V = 4)."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(torch.tensor(table, dtype=torch.float32))

    def forward(self, ids):
        return SimpleNamespace(logits=self.table[ids], aux_loss=self.table.new_zeros(()))


def _rows(*records):
    return {"prompt_ids": [np.array(p) for p, _, _ in records], "completion_ids": [np.array(c) for _, c, _ in records],
            "label": [np.array([label], np.uint8) for _, _, label in records]}


def test_kto_loss_computed_by_hand_with_the_kl_point_of_the_whole_step():
    """The policy puts 1/2 on token 3 after token 1 (1/6 on each other), the reference is uniform, and both are
    uniform after any other token. So a reply's log-ratio r = log pi - log ref is, summed over its tokens that follow
    a 1: ln 2 for a 3 and ln(2/3) for anything else, and 0 for every other token. Two micro-batches of one step:

      A: prompt [2, 1] reply [3, 3] desirable   r = ln 2      KL pair: prompt [2, 1] + reply [0, 1, 0]: 2 ln(2/3)
         prompt [2, 2] reply [1, 3] undesirable r = ln 2      KL pair: prompt [2, 2] + reply [3, 3]:    0
         prompt [1]    reply [0, 1, 0] desirable r = 2 ln(2/3) KL pair: prompt [1] + reply [1, 3]:       ln(4/3)
      B: prompt [1]    reply [3, 3] undesirable r = ln 2      KL pair: prompt [1] + reply [3]:          ln 2
         prompt [1]    reply [3]    desirable   r = ln 2      KL pair: prompt [1] + reply [3, 3]:       ln 2

    The step's reference point z = (2 ln(2/3) + 0 + ln(4/3) + 2 ln 2) / 5 = ln(64/27) / 5 > 0; A's own would be
    max(0, ln(16/27) / 3) = 0 and B's ln 2. Each reply's loss is desirable_weight * (1 - sigmoid(beta (r - z))) or
    undesirable_weight * (1 - sigmoid(beta (z - r))), with beta 0.5 and weights 1 and 1.5."""
    cfg = load_config(None, ["data.train_path=[demo]", "model.preset=tiny", "train.stage=kto", "data.format=kto",
                             "train.micro_batch_size=2", "train.kto.beta=0.5", "train.kto.undesirable_weight=1.5"])
    uniform = [[0.0] * 4] * 4
    policy = Bigram([[0.0] * 4, [0.0, 0.0, 0.0, math.log(3)], [0.0] * 4, [0.0] * 4])
    obj = build_objective(cfg)
    obj.setup(Bigram(uniform), torch.device("cpu"))  # the reference: a frozen copy of what setup is given
    a = collate("kto", _rows(([2, 1], [3, 3], 1), ([2, 2], [1, 3], 0), ([1], [0, 1, 0], 1)), np.arange(3), 0, 16)
    b = collate("kto", _rows(([1], [3, 3], 0), ([1], [3], 1)), np.arange(3, 5), 0, 16)
    state = SimpleNamespace(model=policy, device=torch.device("cpu"), world=1, autocast=contextlib.nullcontext)
    ln2, ln23 = math.log(2), math.log(2 / 3)
    z = math.log(64 / 27) / 5
    step = obj.prepare(state, [a, b], step=1)
    assert float(step[0]["kl"]) == float(step[1]["kl"]) == pytest.approx(z, rel=1e-6)
    assert float(obj.prepare(state, [a], step=1)[0]["kl"]) == 0.0  # clamped: A's pairs alone score below 0
    assert float(obj.prepare(state, [b], step=1)[0]["kl"]) == pytest.approx(ln2, rel=1e-6)

    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    good = lambda r: 1.0 * (1 - sig(0.5 * (r - z)))  # noqa: E731
    bad = lambda r: 1.5 * (1 - sig(0.5 * (z - r)))  # noqa: E731
    expected = [good(ln2) + bad(ln2) + good(2 * ln23), bad(ln2) + good(ln2)]
    for mb, want, accurate in zip(step, expected, ([1, 0, 0], [0, 1])):
        loss, aux, extra = obj.loss_sum(policy, mb)
        assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
        assert float(extra["kl"]) == pytest.approx(z * len(accurate), rel=1e-6)
        assert float(extra["reward_accuracy"]) == sum(accurate)  # on its label's side of z
    assert obj.weight(step[0]) == 3 and obj.weight(step[1]) == 2
    # the step's mean over its 5 replies: what train_step divides the summed losses by
    assert (sum(float(obj.loss_sum(policy, mb)[0]) for mb in step) / 5) == pytest.approx(sum(expected) / 5, rel=1e-6)
    # without a step (the held-out evaluation) a micro-batch uses its own pairs' point: B's is ln 2
    assert float(obj.loss_sum(policy, b)[0]) == pytest.approx(
        1.5 * (1 - sig(0.5 * (ln2 - ln2))) + 1.0 * (1 - sig(0.5 * (ln2 - ln2))), rel=1e-6)
    # gradients reach the policy only through the replies' log-probs, never through z
    loss, _, _ = obj.loss_sum(policy, step[0])
    loss.backward()
    assert policy.table.grad is not None and policy.table.grad[1].abs().sum() > 0
    assert not any(p.requires_grad for p in obj.reference.parameters())


def test_kto_refuses_a_micro_batch_of_one_row():
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        load_config(None, ["data.train_path=[demo]", "model.preset=tiny", "train.stage=kto", "train.micro_batch_size=1"])
