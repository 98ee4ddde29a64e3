"""The built-in demo corpus: small, deterministic, bilingual, and learnable.

Real MiniMind data is gigabytes (see docs/data.md). The demo corpus lets ``make demo``
and the tests run end to end with nothing downloaded. Every sentence comes from a few
templates over a small world of facts (capitals, animal sounds and legs, colours,
arithmetic, numbers written out in English and Chinese), so a ~1-2M-parameter model
visibly learns it within minutes on 2 CPU cores. Measured with the ``demo`` preset
(1.6M parameters), batches of 32 x 128 tokens, lr 2e-3: loss 2.25 after 100 steps
(about 3 minutes on 2 busy cores), when greedy decoding already completes
"The capital of France is" with " Paris. The capital of Peru is Lima.".

The SFT mix also holds digit-sorting tasks ("Sort: 7 2 9" -> "2 7 9", the RL demo's skill). Beside
the training files lie ``tool_sft.jsonl`` (chats that call a calculator tool, ``CALCULATOR_TOOL``, for a sum of
three or four digits: about 645 tokens each with the builtin tokenizer, too long for the demo SFT's 128, so apart),
the agent demo's prompts and tool-call evaluation (held-out sums), and two evaluation sets that no training
file holds: held-out sorting prompts (other multisets, and a longer length) and a multiple-choice set
about the demo world's facts. A recipe or the eval verb names any of them as ``demo:<name>``.

The written-out numbers also give the builtin tokenizer enough distinct Chinese words
to fill its 6400-token vocabulary. Output is a pure function of (seed, sizes); files are
reused when a stamp says they were written with the same arguments, so their mtimes,
and hence the prepare cache key, stay stable across runs.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import zlib
from typing import Dict, List

from minimind_ray.fsio import exists, filesystem, is_uri, join, upload_dir

_VERSION = 5  # 2: sorting in the SFT mix, sorting RL prompts, tool-call chats, eval sets; 3: sorting subjects;
#            4: the tool chats add three or four digits; 5: kto.jsonl (the other files as in 4)

COUNTRIES = [  # (English, Chinese, capital, 首都)
    ("France", "法国", "Paris", "巴黎"), ("China", "中国", "Beijing", "北京"), ("Japan", "日本", "Tokyo", "东京"),
    ("Germany", "德国", "Berlin", "柏林"), ("Italy", "意大利", "Rome", "罗马"), ("Spain", "西班牙", "Madrid", "马德里"),
    ("Russia", "俄罗斯", "Moscow", "莫斯科"), ("Egypt", "埃及", "Cairo", "开罗"), ("Canada", "加拿大", "Ottawa", "渥太华"),
    ("Brazil", "巴西", "Brasilia", "巴西利亚"), ("India", "印度", "New Delhi", "新德里"),
    ("Australia", "澳大利亚", "Canberra", "堪培拉"), ("Korea", "韩国", "Seoul", "首尔"), ("Thailand", "泰国", "Bangkok", "曼谷"),
    ("Greece", "希腊", "Athens", "雅典"), ("Kenya", "肯尼亚", "Nairobi", "内罗毕"), ("Turkey", "土耳其", "Ankara", "安卡拉"),
    ("Norway", "挪威", "Oslo", "奥斯陆"), ("Sweden", "瑞典", "Stockholm", "斯德哥尔摩"), ("Poland", "波兰", "Warsaw", "华沙"),
    ("Portugal", "葡萄牙", "Lisbon", "里斯本"), ("Vietnam", "越南", "Hanoi", "河内"), ("Peru", "秘鲁", "Lima", "利马"),
    ("Ireland", "爱尔兰", "Dublin", "都柏林"), ("Austria", "奥地利", "Vienna", "维也纳"), ("Cuba", "古巴", "Havana", "哈瓦那"),
]
ANIMALS = [  # (English, Chinese, sound, 叫声, legs)
    ("dog", "狗", "woof", "汪汪", 4), ("cat", "猫", "meow", "喵喵", 4), ("cow", "牛", "moo", "哞哞", 4),
    ("duck", "鸭子", "quack", "嘎嘎", 2), ("sheep", "羊", "baa", "咩咩", 4), ("chicken", "鸡", "cluck", "咯咯", 2),
    ("frog", "青蛙", "croak", "呱呱", 4), ("bird", "小鸟", "tweet", "叽叽", 2), ("horse", "马", "neigh", "咴咴", 4),
    ("pig", "猪", "oink", "哼哼", 4), ("mouse", "老鼠", "squeak", "吱吱", 4), ("goose", "鹅", "honk", "嘎嘎", 2),
]
COLOURS = [  # (English, Chinese, colour, 颜色)
    ("sky", "天空", "blue", "蓝色"), ("grass", "草", "green", "绿色"), ("snow", "雪", "white", "白色"),
    ("banana", "香蕉", "yellow", "黄色"), ("apple", "苹果", "red", "红色"), ("coal", "煤", "black", "黑色"),
    ("orange", "橙子", "orange", "橙色"), ("grape", "葡萄", "purple", "紫色"), ("lemon", "柠檬", "yellow", "黄色"),
    ("strawberry", "草莓", "red", "红色"), ("milk", "牛奶", "white", "白色"), ("leaf", "树叶", "green", "绿色"),
    ("carrot", "胡萝卜", "orange", "橙色"), ("tomato", "西红柿", "red", "红色"), ("ocean", "大海", "blue", "蓝色"),
]
_EN_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
           "seventeen eighteen nineteen".split()
_EN_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_ZH_DIGITS = "零一二三四五六七八九"


def number_en(n: int) -> str:
    """0..9999 in English words."""
    if n < 20:
        return _EN_ONES[n]
    if n < 100:
        return _EN_TENS[n // 10] + ("" if n % 10 == 0 else "-" + _EN_ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _EN_ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + number_en(rest))
    rest = n % 1000
    return _EN_ONES[n // 1000] + " thousand" + ("" if rest == 0 else (" and " if rest < 100 else " ") + number_en(rest))


def number_zh(n: int) -> str:
    """0..9999 in Chinese numerals (一千零五, 十二, 二十)."""
    if n == 0:
        return "零"
    out, zero = "", False
    for value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        d = n // value % 10
        if d:
            if zero and out:
                out += "零"
            out += ("" if (value == 10 and d == 1 and n < 20) else _ZH_DIGITS[d]) + unit
            zero = False
        elif out:
            zero = True
    return out


def _fact(rng: random.Random, lang: str) -> str:
    """One true sentence in English ('en') or Chinese ('zh')."""
    kind = rng.choice(("capital", "capital", "animal", "legs", "colour", "add", "sub", "mul", "number", "next"))
    if kind == "capital":
        c, cz, cap, capz = rng.choice(COUNTRIES)
        return rng.choice([f"The capital of {c} is {cap}.", f"{cap} is the capital of {c}."]) if lang == "en" \
            else rng.choice([f"{cz}的首都是{capz}。", f"{capz}是{cz}的首都。"])
    if kind in ("animal", "legs"):
        a, az, s, sz, legs = rng.choice(ANIMALS)
        if kind == "animal":
            return rng.choice([f"A {a} says {s}.", f"The {a} goes {s}."]) if lang == "en" else f"{az}的叫声是{sz}。"
        return f"A {a} has {legs} legs." if lang == "en" else f"{az}有{number_zh(legs)}条腿。"
    if kind == "colour":
        t, tz, col, colz = rng.choice(COLOURS)
        return f"The {t} is {col}." if lang == "en" else f"{tz}是{colz}的。"
    if kind in ("add", "sub", "mul"):
        a, b = (rng.randint(0, 99), rng.randint(0, 99)) if kind != "mul" else (rng.randint(1, 12), rng.randint(1, 12))
        if kind == "sub" and a < b:
            a, b = b, a
        r, en, zh = {"add": (a + b, "plus", "加"), "sub": (a - b, "minus", "减"), "mul": (a * b, "times", "乘")}[kind]
        return f"{a} {en} {b} equals {r}." if lang == "en" else f"{a}{zh}{b}等于{r}。"
    n = rng.randint(0, 9999)
    if kind == "number":
        return f"{n} is written {number_en(n)}." if lang == "en" else f"{n}写作{number_zh(n)}。"
    return f"After {n} comes {n + 1}." if lang == "en" else f"{n}后面是{n + 1}。"


def _qa(rng: random.Random, lang: str, wrong: bool = False):
    """A (question, answer) pair; ``wrong`` gives a plausible but false answer (DPO rejected)."""
    kind = rng.choice(("capital", "capital", "animal", "colour", "add", "identity"))
    if kind == "capital":
        i = rng.randrange(len(COUNTRIES))
        c, cz, cap, capz = COUNTRIES[i]
        if wrong:
            _, _, cap, capz = COUNTRIES[(i + rng.randint(1, len(COUNTRIES) - 1)) % len(COUNTRIES)]
        return (f"What is the capital of {c}?", f"The capital of {c} is {cap}.") if lang == "en" \
            else (f"{cz}的首都是哪里？", f"{cz}的首都是{capz}。")
    if kind == "animal":
        i = rng.randrange(len(ANIMALS))
        a, az, s, sz, _ = ANIMALS[i]
        if wrong:
            _, _, s, sz, _ = ANIMALS[(i + rng.randint(1, len(ANIMALS) - 1)) % len(ANIMALS)]
        return (f"What does a {a} say?", f"A {a} says {s}.") if lang == "en" else (f"{az}怎么叫？", f"{az}的叫声是{sz}。")
    if kind == "colour":
        t, tz, col, colz = rng.choice(COLOURS)
        if wrong:
            others = [x for x in COLOURS if x[2] != col]
            _, _, col, colz = rng.choice(others)
        return (f"What colour is the {t}?", f"The {t} is {col}.") if lang == "en" else (f"{tz}是什么颜色？", f"{tz}是{colz}的。")
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        r = a + b + (rng.choice((-3, -2, -1, 1, 2, 3)) if wrong else 0)
        return (f"What is {a} plus {b}?", f"{a} plus {b} equals {r}.") if lang == "en" \
            else (f"{a}加{b}等于多少？", f"{a}加{b}等于{r}。")
    if wrong:
        return ("Who are you?", "I don't know.") if lang == "en" else ("你是谁？", "我不知道。")
    return ("Who are you?", "I am MiniMind, a small language model trained on a Ray cluster.") if lang == "en" \
        else ("你是谁？", "我是MiniMind，一个在Ray集群上训练的小型语言模型。")


def _pretrain_record(rng: random.Random) -> dict:
    lang = rng.choice(("en", "zh"))
    sep = " " if lang == "en" else ""
    return {"text": sep.join(_fact(rng, lang) for _ in range(rng.randint(3, 6)))}


SFT_SORT_SHARE = 0.04  # of the SFT records: sorting tasks (calibrated: the SFT model at the edge of the skill, docs/rl.md)


def _sft_record(rng: random.Random) -> dict:
    kind = rng.random()
    if kind < SFT_SORT_SHARE:
        digits = _trained_digits(rng)
        return {"conversations": [{"role": "user", "content": sort_prompt(digits)},
                                  {"role": "assistant", "content": sort_answer(digits)}]}
    conv: List[dict] = []
    if rng.random() < 0.1:
        conv.append({"role": "system", "content": "You are MiniMind, a helpful assistant."})
    for _ in range(1 if rng.random() < 0.8 else 2):
        q, a = _qa(rng, rng.choice(("en", "zh")))
        conv += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"conversations": conv}


def _dpo_record(rng: random.Random) -> dict:
    lang = rng.choice(("en", "zh"))
    state = rng.getstate()
    q, good = _qa(rng, lang)
    rng.setstate(state)  # same question, now answered wrongly
    _, bad = _qa(rng, lang, wrong=True)
    return {"chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": good}],
            "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": bad}]}


def _kto_record(rng: random.Random) -> dict:
    """An unpaired judged reply (KTO): a question answered rightly (desirable) or plausibly but wrongly, half each."""
    lang, desirable = rng.choice(("en", "zh")), rng.random() < 0.5
    q, a = _qa(rng, lang, wrong=not desirable)
    return {"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], "label": desirable}


# ---- the RL demo task: sorting single digits. One token per digit in the builtin tokenizer, so the skill
# (compare and place digits) is shared by every prompt, unlike sums, which it spells as whole-number tokens.
SORT_LENGTHS = (3, 4, 5, 6)  # lengths in the SFT data and the GRPO prompts
SORT_HELDOUT_LENGTH = 7  # a length no training data has: the length-generalisation probe
SORT_HELDOUT = "sort_heldout.jsonl"  # beside the corpus: multisets no training file holds
MC_EVAL = "mc_eval.jsonl"  # beside the corpus: the demo's multiple-choice benchmark, never trained on


def sort_prompt(digits: List[int]) -> str:
    return "Sort: " + " ".join(map(str, digits))


def sort_answer(digits: List[int]) -> str:
    return " ".join(map(str, sorted(digits)))


def is_heldout_multiset(digits: List[int]) -> bool:
    """One multiset in eight (by a hash of its sorted digits) is held out, and every one of the held-out
    length: no SFT record and no GRPO prompt holds them, in any order."""
    if len(digits) >= SORT_HELDOUT_LENGTH:
        return True
    return zlib.crc32(sort_answer(digits).encode()) % 8 == 0


def _draw_digits(rng: random.Random, lengths, held_out) -> List[int]:
    """Random digits of one of ``lengths``, drawn again while ``held_out(digits)``."""
    while True:
        digits = [rng.randrange(10) for _ in range(rng.choice(lengths))]
        if not held_out(digits):
            return digits


def _trained_digits(rng: random.Random) -> List[int]:
    return _draw_digits(rng, SORT_LENGTHS, is_heldout_multiset)


# ---- tool calls: a calculator the assistant calls when the conversation offers it (the chat template renders
# the system turn's tools; tests/serving and the agent stage use the same schema)
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression such as 12 + 7",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


N_TOOL_SFT = 4000
SUM_TERMS = (3, 4)  # single digits a calculator question adds: one token each, so a call can copy them


def sum_question(digits: List[int]) -> str:
    return "What is " + " plus ".join(map(str, digits)) + "?"


def sum_expression(digits: List[int]) -> str:
    return " + ".join(map(str, digits))


def is_heldout_sum(digits: List[int]) -> bool:
    """One digit sequence in eight (by a hash) is held out of the tool SFT chats and the agent prompts."""
    return zlib.crc32(sum_expression(digits).encode()) % 8 == 0


def _trained_sum(rng: random.Random) -> List[int]:
    return _draw_digits(rng, SUM_TERMS, is_heldout_sum)


def _tool_record(rng: random.Random) -> dict:
    digits = _trained_sum(rng)
    return {"conversations": [
        {"role": "system", "content": "You are MiniMind, a helpful assistant.", "tools": [CALCULATOR_TOOL]},
        {"role": "user", "content": sum_question(digits)},
        {"role": "assistant", "content": "",
         "tool_calls": [{"name": "calculate", "arguments": {"expression": sum_expression(digits)}}]},
        {"role": "tool", "content": json.dumps({"result": sum(digits)})},
        {"role": "assistant", "content": f"The answer is {sum(digits)}."}]}


# ---- the agent demo (stage agent, issue 24): "What is 3 plus 8 plus 5?" with the calculator offered; the right
# final answer holds the sum. The demo model cannot add three or four digits itself (no training file has such sums)
# and copies a digit far more reliably than a whole-number token (docs/rl.md), so the skill to learn is the tool's
# use: copy the digits into the call and the result into the answer. Its own stamp, so these files rewrite none of
# the corpus above. The held-out sums (is_heldout_sum) are in no agent prompt and no tool SFT chat; the tool-call
# evaluation asks 200 of them.
AGENT_FILES = {"agent_rl": "agent_rl.jsonl", "toolcall_eval": "toolcall_eval.jsonl"}
N_AGENT_RL, N_TOOLCALL_EVAL, _AGENT_VERSION = 2000, 200, 3  # 2: the eval's prompts have the system turn; 3: digit sums


def _write_agent_tasks(out_dir: str, seed: int) -> Dict[str, str]:
    paths = {k: os.path.join(out_dir, v) for k, v in AGENT_FILES.items()}
    stamp_path, stamp = os.path.join(out_dir, "agent_tasks.json"), {"version": _AGENT_VERSION, "seed": seed}
    if os.path.exists(stamp_path) and all(os.path.exists(p) for p in paths.values()):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return paths
    os.makedirs(out_dir, exist_ok=True)
    system = {"role": "system", "content": "You are MiniMind, a helpful assistant.", "tools": [CALCULATOR_TOOL]}
    rng = random.Random(f"{seed}-agent")
    tasks = []
    for _ in range(N_AGENT_RL):
        digits = _trained_sum(rng)
        tasks.append({"conversations": [system, {"role": "user", "content": sum_question(digits)},
                                        {"role": "assistant", "content": f"The answer is {sum(digits)}."}],
                      "gt": [sum(digits)]})
    ask = lambda q: [{k: v for k, v in system.items() if k != "tools"}, {"role": "user", "content": q}]  # noqa: E731
    evals = []
    for n in SUM_TERMS:  # as many of each length
        unseen = [list(d) for d in itertools.product(range(10), repeat=n) if is_heldout_sum(list(d))]
        evals += [{"messages": ask(sum_question(d)), "tools": [CALCULATOR_TOOL], "tool": "calculate",
                   "arguments": {"expression": sum_expression(d)}, "answer": sum(d), "subject": "arithmetic"}
                  for d in rng.sample(unseen, N_TOOLCALL_EVAL // len(SUM_TERMS))]
    evals += [{"messages": ask(f"What is the capital of {c}?"), "tools": [CALCULATOR_TOOL], "tool": None,
               "answer": cap, "subject": "no tool"} for c, _, cap, _ in COUNTRIES]  # offered, not needed
    _write_jsonl(paths["agent_rl"], tasks)
    _write_jsonl(paths["toolcall_eval"], evals)
    with open(stamp_path + f".tmp{os.getpid()}", "w") as f:
        json.dump(stamp, f)
    os.replace(stamp_path + f".tmp{os.getpid()}", stamp_path)
    return paths


def _write_sort_tasks(paths: Dict[str, str], seed: int, n: int) -> None:
    """The RL demo's ``prompt`` records ("Sort: 7 2 9" with "2 7 9" as answer): ``n`` training prompts of
    trained multisets in ``paths["prompt"]``, and the held-out set beside it (``SORT_HELDOUT``): 300 held-out
    multisets of the trained lengths and 100 of the held-out length, each in a random order."""
    rng = random.Random(f"{seed}-prompt")
    train = [_trained_digits(rng) for _ in range(n)]
    held, seen = [], set()
    while len(held) < 400:
        length = SORT_HELDOUT_LENGTH if len(held) >= 300 else rng.choice(SORT_LENGTHS)
        digits = [rng.randrange(10) for _ in range(length)]
        if is_heldout_multiset(digits) and sort_answer(digits) not in seen:
            seen.add(sort_answer(digits))
            held.append(digits)
    heldout_path = os.path.join(os.path.dirname(paths["prompt"]), SORT_HELDOUT)
    for path, chosen in ((paths["prompt"], train), (heldout_path, held)):
        _write_jsonl(path, ({"prompt": sort_prompt(d), "answer": sort_answer(d), "subject": f"length {len(d)}"}
                            for d in chosen))


def _mc_questions() -> List[dict]:
    """The demo's multiple-choice set: every capital, animal sound, leg count and colour of the demo world,
    asked in English in words the SFT data does not use, with four answer sentences (one true, three drawn
    from the same kind of fact) in a fixed order. Scored on the choice texts (``minimind-ray eval --task mc``)."""
    rng = random.Random("demo-mc")
    out = []

    def add(question: str, right: str, wrong: List[str]) -> None:
        choices = [right] + rng.sample(sorted(set(wrong) - {right}), 3)
        rng.shuffle(choices)
        out.append({"question": question, "choices": choices, "answer": choices.index(right)})

    for c, _, cap, _ in COUNTRIES:
        add(f"Which city is the capital of {c}?", f"The capital of {c} is {cap}.",
            [f"The capital of {c} is {x[2]}." for x in COUNTRIES])
    for a, _, s, _, legs in ANIMALS:
        add(f"What sound does a {a} make?", f"A {a} says {s}.", [f"A {a} says {x[2]}." for x in ANIMALS])
        add(f"How many legs does a {a} have?", f"A {a} has {legs} legs.",
            [f"A {a} has {n} legs." for n in (0, 1, 2, 3, 4, 6, 8)])
    for t, _, col, _ in COLOURS:
        add(f"Which colour is the {t}?", f"The {t} is {col}.", [f"The {t} is {x[2]}." for x in COLOURS])
    return out


def _write_jsonl(path: str, records) -> None:
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


DEMO_FILES = ("pretrain", "sft", "dpo", "kto", "prompt", "tool_sft", "sort_heldout", "mc_eval",
              *AGENT_FILES)  # demo:<name>


def resolve_demo_path(path: str, data_format: str, cache_dir: str) -> str:
    """``demo`` (the corpus file of ``data_format``) or ``demo:<name>`` -> that file, written on first use into
    ``cache_dir/demo``; any other path as it is."""
    if path != "demo" and not path.startswith("demo:"):
        return path
    name = data_format if path == "demo" else path[len("demo:"):]
    if name not in DEMO_FILES:
        raise ValueError(f"{path}: no such demo file; one of {', '.join('demo:' + n for n in DEMO_FILES)}")
    return write_demo_corpus(os.path.join(cache_dir, "demo"))[name]


def write_demo_corpus(out_dir: str, seed: int = 0, n_pretrain: int = 40000, n_sft: int = 10000,
                      n_dpo: int = 2000, n_prompt: int = 2000) -> Dict[str, str]:
    """Write pretrain.jsonl, sft.jsonl, dpo.jsonl, kto.jsonl (as many judged replies as DPO pairs, half of them
    desirable) and prompt.jsonl (the RL demo's sorting prompts) into ``out_dir``, beside them tool_sft.jsonl
    (calculator tool calls, SFT format) and the two evaluation sets no training file holds: ``SORT_HELDOUT``
    (held-out sorting prompts, a ``gen`` task) and ``MC_EVAL`` (multiple choice); return their paths by name
    (pretrain, sft, dpo, kto, prompt, tool_sft, sort_heldout, mc_eval): a recipe's ``demo:<name>``.

    The defaults give about 1M pretrain tokens with the builtin tokenizer (5 MB),
    enough that a small model learns the facts rather than memorising documents.
    """
    if is_uri(out_dir):  # a bucket: written here, uploaded with its stamp last; every node then reads the bucket's
        return _demo_in_bucket(out_dir, seed, n_pretrain, n_sft, n_dpo, n_prompt)
    out_dir = os.path.abspath(out_dir)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("pretrain", "sft", "dpo", "kto", "prompt")}
    paths["tool_sft"] = os.path.join(out_dir, "tool_sft.jsonl")
    paths["sort_heldout"] = os.path.join(out_dir, SORT_HELDOUT)
    paths["mc_eval"] = os.path.join(out_dir, MC_EVAL)
    paths.update(_write_agent_tasks(out_dir, seed))  # the agent demo's files: their own stamp
    stamp_path = os.path.join(out_dir, "demo.json")
    stamp = {"version": _VERSION, "seed": seed, "n_pretrain": n_pretrain, "n_sft": n_sft, "n_dpo": n_dpo,
             "n_prompt": n_prompt, "sft_sort_share": SFT_SORT_SHARE}
    if os.path.exists(stamp_path) and all(os.path.exists(p) for p in paths.values()):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return paths
    os.makedirs(out_dir, exist_ok=True)
    for (name, make), n in zip((("pretrain", _pretrain_record), ("sft", _sft_record), ("dpo", _dpo_record),
                                ("kto", _kto_record)), (n_pretrain, n_sft, n_dpo, n_dpo)):
        rng = random.Random(f"{seed}-{name}")
        _write_jsonl(paths[name], (make(rng) for _ in range(n)))
    _write_sort_tasks(paths, seed, n_prompt)
    rng = random.Random(f"{seed}-tool")
    _write_jsonl(paths["tool_sft"], (_tool_record(rng) for _ in range(N_TOOL_SFT)))
    _write_jsonl(paths["mc_eval"], _mc_questions())
    tmp = stamp_path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(stamp, f)
    os.replace(tmp, stamp_path)
    return paths


def _demo_in_bucket(uri: str, seed: int, *counts: int) -> Dict[str, str]:
    """:func:`write_demo_corpus` for a URI (``data.cache_dir=s3://...``): the corpus is written into a local temporary
    directory and uploaded, ``demo.json`` last, unless the bucket already holds it; the paths returned are URIs, which
    the prepare's tasks on any node read (a local path of the driver's would be on no other node)."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="mmr-demo-")
    try:
        local = write_demo_corpus(tmp, seed, *counts)
        names = {k: os.path.relpath(v, tmp) for k, v in local.items()}
        stamp = os.path.join(tmp, "demo.json")
        fs_stamp = join(uri, "demo.json")
        have = exists(fs_stamp) and all(exists(join(uri, n)) for n in names.values())
        if have:
            fs, path = filesystem(fs_stamp)
            with fs.open_input_stream(path) as f, open(stamp, "rb") as mine:
                have = f.read() == mine.read()
        if not have:
            upload_dir(tmp, uri, [*sorted(set(names.values())), "demo.json"])
        return {k: join(uri, n) for k, n in names.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
