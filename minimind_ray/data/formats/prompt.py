"""``prompt``: ``{"prompt": ..., "answer": ...}``: a question with its known answer (a string or number), an RL prompt
(stages ``grpo``, ``ppo``; the demo's sorting task). Prepared and batched as ``rlaif`` (data/formats/rlaif.py), the
question as one user turn."""
from __future__ import annotations

from typing import List

from minimind_ray.data.formats.base import BadRecord
from minimind_ray.data.formats.rlaif import RLAIF


class Prompt(RLAIF):
    name = "prompt"
    record = "{prompt, answer}"

    def check(self, rec: dict) -> int:
        for key, types, expected in (("prompt", (str,), "a string"),
                                     ("answer", (str, int, float), "a string or number")):
            if rec.get(key) is None:
                raise BadRecord("missing_field", f"field '{key}' missing")
            if not isinstance(rec[key], types) or isinstance(rec[key], bool):
                raise BadRecord("wrong_type", f"'{key}' is {type(rec[key]).__name__}, expected {expected}")
        if not rec["prompt"].strip():
            raise BadRecord("no_prompt", "'prompt' is empty")
        return len(rec["prompt"]) + len(str(rec["answer"]))

    def prompt_messages(self, rec: dict) -> List[dict]:
        return [{"role": "user", "content": rec["prompt"]}]

    def answer(self, rec: dict) -> str:
        return str(rec["answer"])


FORMAT = Prompt()
