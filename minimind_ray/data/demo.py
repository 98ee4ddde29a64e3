"""The built-in demo corpus: small, deterministic, bilingual, and learnable.

Real MiniMind data is gigabytes (see docs/data.md). The demo corpus lets ``make demo``
and the tests run end to end with nothing downloaded. Every sentence comes from a few
templates over a small world of facts (capitals, animal sounds and legs, colours,
arithmetic, numbers written out in English and Chinese), so a ~1-2M-parameter model
visibly learns it within minutes on 2 CPU cores. Measured with the ``demo`` preset
(1.6M parameters), batches of 32 x 128 tokens, lr 2e-3: loss 2.25 after 100 steps
(about 3 minutes on 2 busy cores), when greedy decoding already completes
"The capital of France is" with " Paris. The capital of Peru is Lima.".

The written-out numbers also give the builtin tokenizer enough distinct Chinese words
to fill its 6400-token vocabulary. Output is a pure function of (seed, sizes); files are
reused when a stamp says they were written with the same arguments, so their mtimes,
and hence the prepare cache key, stay stable across runs.
"""
from __future__ import annotations

import json
import os
import random
import re
from typing import Dict, List

_VERSION = 1

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


def _sft_record(rng: random.Random) -> dict:
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


ARITHMETIC_HELDOUT = "arithmetic_heldout.jsonl"  # beside the corpus: the RL demo's held-out questions


def addition_pairs_used(paths: List[str]) -> set:
    """Every (a, b) that the files write as "a plus b" or "a加b" (facts, questions, wrong answers)."""
    used = set()
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for m in re.finditer(r"(\d+) plus (\d+)|(\d+)加(\d+)", f.read()):
                a, b = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                used.add((int(a), int(b)))
    return used


def _write_arithmetic_tasks(paths: Dict[str, str], seed: int, n: int) -> None:
    """The RL demo's ``prompt`` records ("What is a plus b?" with the sum as answer): ``n`` training
    questions in ``paths["prompt"]``, and every pair of 0..99 that the corpus never adds, in either
    order, as the held-out set (``ARITHMETIC_HELDOUT``): a model can only answer those by adding."""
    used = addition_pairs_used([paths[k] for k in ("pretrain", "sft", "dpo")])
    pairs = [(a, b) for a in range(100) for b in range(100)]
    unseen = {(a, b) for a, b in pairs if (a, b) not in used and (b, a) not in used}
    seen = [p for p in pairs if p not in unseen]
    rng = random.Random(f"{seed}-prompt")
    train = [rng.choice(seen) for _ in range(n)]
    heldout_path = os.path.join(os.path.dirname(paths["prompt"]), ARITHMETIC_HELDOUT)
    for path, chosen in ((paths["prompt"], train), (heldout_path, sorted(unseen))):
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for a, b in chosen:
                f.write(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": a + b}) + "\n")
        os.replace(tmp, path)


def write_demo_corpus(out_dir: str, seed: int = 0, n_pretrain: int = 40000, n_sft: int = 10000,
                      n_dpo: int = 2000, n_prompt: int = 2000) -> Dict[str, str]:
    """Write pretrain.jsonl, sft.jsonl, dpo.jsonl and prompt.jsonl (RL questions with known answers,
    plus their held-out set ``ARITHMETIC_HELDOUT``) into ``out_dir``; return their paths.

    The defaults give about 1M pretrain tokens with the builtin tokenizer (5 MB),
    enough that a small model learns the facts rather than memorising documents.
    """
    out_dir = os.path.abspath(out_dir)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("pretrain", "sft", "dpo", "prompt")}
    stamp_path = os.path.join(out_dir, "demo.json")
    stamp = {"version": _VERSION, "seed": seed, "n_pretrain": n_pretrain, "n_sft": n_sft, "n_dpo": n_dpo,
             "n_prompt": n_prompt}
    if os.path.exists(stamp_path) and all(os.path.exists(p) for p in paths.values()):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return paths
    os.makedirs(out_dir, exist_ok=True)
    for (name, make), n in zip((("pretrain", _pretrain_record), ("sft", _sft_record), ("dpo", _dpo_record)),
                               (n_pretrain, n_sft, n_dpo)):
        rng = random.Random(f"{seed}-{name}")
        tmp = paths[name] + f".tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for _ in range(n):
                f.write(json.dumps(make(rng), ensure_ascii=False) + "\n")
        os.replace(tmp, paths[name])
    _write_arithmetic_tasks(paths, seed, n_prompt)
    tmp = stamp_path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(stamp, f)
    os.replace(tmp, stamp_path)
    return paths
