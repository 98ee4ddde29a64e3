"""GRPO reward plug-ins: MiniMind's rule rewards, the exact-answer checker, ``module:function`` callables,
their weighted sum, and model-based rewards from tiny randomly initialised models made here."""
from __future__ import annotations

import shutil
import sys
import textwrap

import pytest
import torch

from minimind_ray.failures import Mistake
from minimind_ray.rl.rewards import RewardConfig
from minimind_ray.rl.reward_model import GetScoreReward, load_reward_model, prompt_messages
from minimind_ray.rl.rewards import (build_rewards, close_answer_reward, exact_answer_reward, is_correct,
                                     length_reward, repetition_penalty, repetition_reward, score,
                                     think_format_reward)
from tests.conftest import minimind_tokenizer_dir

PROMPT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n<|im_start|>assistant\n"


def test_length_reward_window():
    done = length_reward(None, ["x" * 19, "  " + "x" * 20 + "  ", "x" * 800, "x" * 801], None)
    assert done == [-0.5, 0.5, 0.5, -0.5]
    assert length_reward(None, ["abc"], None, min_chars=2, max_chars=3, inside=1.0, outside=0.0) == [1.0]


def test_think_format_reward_by_hand():
    long_thought = "I add the ones, then the tens."  # 30 characters: inside 20..300
    completions = ["no thinking at all",
                   f"<think>{long_thought}</think>19",        # +1.0 +0.25
                   "<think>short</think>19",                  # -0.5 +0.25
                   f"{long_thought}</think>a</think>b"]       # +1.0 -0.25 (two closing tags)
    assert think_format_reward(None, completions, None) == [0.0, 1.25, -0.25, 0.75]


def test_repetition_penalty_is_minimind_rule():
    # 6 word 3-grams, 3 of them repeats: min(0.5, 3 * 0.5 * 2 / 6) = 0.5; 1 repeat in 4: 0.25
    assert repetition_penalty("a b c a b c a b") == pytest.approx(0.5)
    assert repetition_penalty("one two three one two three") == pytest.approx(1 * 0.5 * 2 / 4)
    assert repetition_penalty("all different words here") == 0.0 and repetition_penalty("too short") == 0.0
    # only the answer after </think> is judged
    assert repetition_reward(None, ["a b c a b c a b</think>fresh new answer"], None) == [0.0]


@pytest.mark.parametrize("completion, answer, right", [
    ("12 plus 7 equals 19.", "19", True),
    ("12 plus 7 equals 18.", "19", False),
    ("The answer is 1,019", "1019", True),
    ("<think>12 + 7 = 18? no, 19</think>It is 19.", "19", True),
    ("<think>it is 19</think>It is 18.", "19", False),
    ("-3", "-3", True),
    ("2.50", "2.5", True),
    ("no number here", "19", False),
    ("Paris.", "paris", True),
    ("The capital is Paris.", "Paris", False),  # a text answer must be the whole reply
    ("anything", "", False),  # no reference: never right
])
def test_exact_answer(completion, answer, right):
    assert is_correct(completion, answer) is right
    assert exact_answer_reward(None, [completion], [answer]) == [1.0 if right else 0.0]


def test_close_answer_gives_partial_credit_for_a_near_miss():
    completions = ["12 plus 7 equals 19.", "12 plus 7 equals 16.", "12 plus 7 equals 40.", "no number",
                   "<think>19</think>It is 25."]
    assert close_answer_reward(None, completions, ["19"] * 5) == pytest.approx([1.0, 0.7, 0.0, 0.0, 0.4])
    assert close_answer_reward(None, ["16"], ["19"], tolerance=3) == pytest.approx([0.0])
    assert close_answer_reward(None, ["Paris"], ["Paris"]) == [0.0]  # text answers: exact_answer's job


def double_length(prompts, completions, answers, factor=2.0):
    """A ``module:function`` reward for the tests below."""
    return [factor * len(c) for c in completions]


def wrong_count(prompts, completions, answers):
    return [1.0]


def test_terms_are_weighted_and_summed_and_callables_load_by_name():
    terms = build_rewards([RewardConfig("exact_answer", weight=2.0), RewardConfig("length", weight=0.5),
                           RewardConfig("tests.unit.test_grpo_rewards:double_length", weight=0.1,
                                        args={"factor": 3.0}),
                           RewardConfig("length", weight=1.0, args={"min_chars": 1})])
    assert [t.label for t in terms] == ["exact_answer", "length", "double_length", "length_2"]
    completions = ["12 plus 7 equals 19.", "no"]
    total, per_term = score(terms, [PROMPT] * 2, completions, ["19", "19"])
    assert per_term == {"exact_answer": [1.0, 0.0], "length": [0.5, -0.5], "double_length": [60.0, 6.0],
                        "length_2": [0.5, 0.5]}
    assert total == pytest.approx([2.0 + 0.25 + 6.0 + 0.5, 0.0 - 0.25 + 0.6 + 0.5])


def test_a_reward_that_misbehaves_is_named():
    with pytest.raises(ValueError, match="neither a built-in reward"):
        build_rewards([RewardConfig("no_such_reward")])
    # a user's plug-in that cannot load or misbehaves is the user's mistake, named (never retried: failures.py)
    with pytest.raises(Mistake, match="cannot load reward 'tests.unit.test_grpo_rewards:nope'"):
        build_rewards([RewardConfig("tests.unit.test_grpo_rewards:nope")])
    (term,) = build_rewards([RewardConfig("tests.unit.test_grpo_rewards:wrong_count")])
    with pytest.raises(Mistake, match="reward 'wrong_count' returned 1 values for 2 completions"):
        term([PROMPT] * 2, ["a", "b"], ["", ""])


def test_chatml_prompts_come_back_as_messages():
    assert prompt_messages(PROMPT) == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 12 plus 7?"}]
    assert prompt_messages("plain text") == [{"role": "user", "content": "plain text"}]


def _copy_tokenizer(dst):
    src = minimind_tokenizer_dir("minimind2")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)


def make_classifier_dir(d):
    """A tiny randomly initialised HF reward model (one-label sequence classifier) with MiniMind's tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=6400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
        LlamaForSequenceClassification(cfg).save_pretrained(d)
    _copy_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return make_classifier_dir(tmp_path_factory.mktemp("rm-cls"))


def test_sequence_classifier_reward_scores_each_completion_with_the_model(classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    (term,) = build_rewards([RewardConfig("reward_model", path=str(classifier_dir))])
    assert term.label == "reward_model"
    completions = ["12 plus 7 equals 19.", "I do not know, sorry.", "19"]
    got = term([PROMPT] * 3, completions, ["19"] * 3)
    # the same scores by hand: the reward model's chat template over the prompt's turns plus the reply
    tok = AutoTokenizer.from_pretrained(classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    msgs = prompt_messages(PROMPT)
    want = []
    for c in completions:
        text = tok.apply_chat_template(msgs + [{"role": "assistant", "content": c}], tokenize=False)
        with torch.no_grad():
            want.append(float(model(**tok(text, return_tensors="pt")).logits[0, 0]))
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(g, 4) for g in got)) == 3  # the completions are told apart
    # scoring in batches gives what scoring one at a time does (padding is masked); scores are clipped
    one_by_one = load_reward_model(str(classifier_dir), batch_size=1, clip=0.01)
    assert one_by_one([PROMPT] * 3, completions, [""] * 3) == pytest.approx(
        [max(-0.01, min(0.01, g)) for g in got], abs=1e-6)
    # a large reward model loads in half precision, as GetScoreReward's (MiniMind loads its reward model in fp16)
    half = load_reward_model(str(classifier_dir), dtype="bfloat16")
    assert half.model.dtype == torch.bfloat16
    assert half([PROMPT] * 3, completions, [""] * 3) == pytest.approx(got, abs=0.05)


TINY_SCORE_MODULE = '''
import torch
from transformers import PretrainedConfig, PreTrainedModel


class TinyScoreConfig(PretrainedConfig):
    model_type = "tiny_score"

    def __init__(self, vocab=6400, hidden=8, **kw):
        super().__init__(**kw)
        self.vocab, self.hidden = vocab, hidden


class TinyScoreModel(PreTrainedModel):
    """What MiniMind's LMForRewardModel expects of internlm2-1_8b-reward: AutoModel + get_score."""
    config_class = TinyScoreConfig

    def __init__(self, config):
        super().__init__(config)
        self.emb = torch.nn.Embedding(config.vocab, config.hidden)
        self.head = torch.nn.Linear(config.hidden, 1)
        self.post_init()

    def get_score(self, tokenizer, messages):
        text = "".join(m["role"] + ": " + m["content"] + "\\n" for m in messages)
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        return float(self.head(self.emb(ids).mean(1))) * 10
'''


def test_get_score_reward_model_as_minimind_uses_it(tmp_path, monkeypatch):
    import importlib.util

    import transformers.dynamic_module_utils as dyn

    # remote code is copied into HF's module cache: keep it in this test's directory, not ~/.cache
    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    src = tmp_path / "tiny_score.py"
    src.write_text(textwrap.dedent(TINY_SCORE_MODULE))
    spec = importlib.util.spec_from_file_location("tiny_score", src)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tiny_score", mod)
    spec.loader.exec_module(mod)
    mod.TinyScoreConfig.register_for_auto_class()
    mod.TinyScoreModel.register_for_auto_class("AutoModel")
    torch.manual_seed(0)
    model = mod.TinyScoreModel(mod.TinyScoreConfig()).eval()
    d = tmp_path / "rm-get-score"
    model.save_pretrained(d)
    _copy_tokenizer(d)

    with pytest.raises(ValueError, match="trust_remote_code=true"):  # running a directory's code is opt-in
        load_reward_model(str(d))
    rm = load_reward_model(str(d), trust_remote_code=True, clip=3.0)
    assert isinstance(rm, GetScoreReward)
    completions = ["12 plus 7 equals 19.", "no"]
    got = rm([PROMPT] * 2, completions, ["19"] * 2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    # MiniMind's layout: earlier turns folded into one user message ahead of the last question
    context = "system: Be brief.\n以上是对话历史。我的新问题是：\nWhat is 12 plus 7?"
    assert GetScoreReward.messages(PROMPT, "19") == [{"role": "user", "content": context},
                                                     {"role": "assistant", "content": "19"}]
    with torch.no_grad():
        raw = [model.get_score(tok, GetScoreReward.messages(PROMPT, c)) for c in completions]
    assert got == pytest.approx(raw, abs=1e-5) and got[0] != pytest.approx(got[1], abs=1e-4)
    clipped = load_reward_model(str(d), trust_remote_code=True, clip=1e-3)
    assert clipped([PROMPT] * 2, completions, [""] * 2) == pytest.approx([max(-1e-3, min(1e-3, r)) for r in raw])


def test_permutation_answer_rewards_only_orderings_of_the_answers_items():
    from minimind_ray.rl.rewards import permutation_answer_reward

    answers = ["1 2 4 7 9"] * 6
    replies = ["1 2 4 7 9", "1 2 4 9 7", "9 7 4 2 1", "1 2 4 7", "1 2 4 7 9 9", "1 1 1 1 1"]
    # exact; two of five positions wrong -> 0.5 * 3/5; reversed: only the middle right -> 0.5 * 1/5; a dropped
    # item, an invented one and a constant reply are no permutation -> 0
    assert permutation_answer_reward([""] * 6, replies, answers) == pytest.approx([1.0, 0.3, 0.1, 0.0, 0.0, 0.0])
    assert permutation_answer_reward([""], ["<think>x</think> 2 1."], ["1 2"], partial=1.0) == [0.0]
    assert permutation_answer_reward([""], ["1 2."], ["1 2"]) == [1.0]
